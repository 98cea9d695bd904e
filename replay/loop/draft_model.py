"""draft-simple: the draft model in its own context (common/speculative.cpp:273-472, b11434).

The draft context mirrors every target batch (same tokens and positions, output on the last
row: server-context.cpp:4072-4084, common/speculative.cpp:304-348), and its drafting KV is
discarded after each draft (server-context.cpp:3262-3307). The loop owns that context
(`DraftContext`); `DraftSimple` drafts from it.

Greedy: chain [suppress] -> top_k(10) -> dist; the draft is cur_p[0] (argmax).
Probabilistic (b11434, temp > 0): chain [suppress] -> top_k(10) -> temp_ext(temp) ->
dist(S ^ 0x85ebca6b), fresh at each request (begin() resets it); the draft is the sampled token,
q its cur_p (SERVER_LOOP.md 3.5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..numerics.rng import DRAFT_SEED_XOR
from ..runtime.llama import Context, Model
from ..runtime.sampler import LLAMA_DEFAULT_SEED, SamplerChain, SamplingParams

DRAFT_TOP_K = 10  # common/speculative.cpp:273-281


@dataclass
class DraftContext:
    """The draft model and its context for one request, as the loop drives it."""

    model: Model
    ctx: Context
    profile: str
    temp: float
    seed: int

    def drafter(self, spec) -> "DraftSimple":
        return DraftSimple(self, spec)

    def close(self) -> None:
        self.ctx.close()


class DraftSimple:
    """The draft-simple drafter (module docstring)."""

    name = "draft-simple"

    def __init__(self, source: DraftContext, spec):
        self.ctx, self.spec = source.ctx, spec
        # 0c1e570 has no probabilistic drafting and resets the (argmax) sampler every step,
        # [0c1e570] common/speculative.cpp:326; with argmax drafting the reset changes nothing
        self.probabilistic = (source.profile == "b11434" and spec.draft_sampling == "probabilistic"
                              and source.temp > 0)
        if self.probabilistic:
            s = LLAMA_DEFAULT_SEED if source.seed == LLAMA_DEFAULT_SEED else (source.seed ^ DRAFT_SEED_XOR)
            params = SamplingParams(samplers=("top_k", "temperature"), top_k=DRAFT_TOP_K, temp=source.temp, seed=s)
        else:
            params = SamplingParams(samplers=("top_k",), top_k=DRAFT_TOP_K, seed=LLAMA_DEFAULT_SEED)
        self.chain = SamplerChain(source.model, params)
        # q of the last draft: the draft chain's candidates (ids, p) at each drafted position
        self.last_q: list[tuple[np.ndarray, np.ndarray]] | None = None

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]:
        """common/speculative.cpp:350-472: decode [id_last], then sample/argmax and decode one token
        at a time until draft.n_max (or the step's n_max) tokens, or cur_p[0].p < p_min."""
        ctx, spec = self.ctx, self.spec
        pos0 = len(inp)
        ctx.decode([id_last], pos0, [True])
        out: list[int] = []
        qs: list[tuple[np.ndarray, np.ndarray]] = []
        i = 0
        while True:
            cands, sel = self.chain.apply(ctx.logits(0))
            tok = int(cands["id"][sel]) if self.probabilistic else int(cands["id"][0])
            if cands["p"][0] < spec.draft_p_min:
                break
            self.chain.accept(tok)
            out.append(tok)
            qs.append((cands["id"].copy(), cands["p"].copy()))
            if spec.draft_n_max <= len(out) or (n_max > 0 and n_max <= len(out)):
                break
            ctx.decode([tok], pos0 + i + 1, [True])
            i += 1
        if len(out) < spec.draft_n_min:
            out, qs = [], []
        self.last_q = qs if self.probabilistic else None
        return out

    def accept(self, n_accepted: int) -> None:
        pass

    def close(self) -> None:
        self.chain.close()
