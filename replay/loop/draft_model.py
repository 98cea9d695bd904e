"""draft-simple: the draft model in its own context (common/speculative.cpp:273-472, b11434).

The draft context mirrors every target batch (same tokens and positions: server-context.cpp:
4072-4084, common/speculative.cpp:304-348; the server's unread output row is left out, `mirror`),
and its drafting KV is discarded after each draft (server-context.cpp:3262-3307). The loop owns that context
(`DraftContext`); `DraftSimple` drafts from it.

Greedy: chain [suppress] -> top_k(10) -> dist; the draft is cur_p[0] (argmax).
Probabilistic (b11434, temp > 0): chain [suppress] -> top_k(10) -> temp_ext(temp) ->
dist(S ^ 0x85ebca6b), fresh at each request (begin() resets it); the draft is the sampled token,
q its cur_p (common/speculative.cpp:350-472).

The draft sampler belongs to the server's slot, not to the request (common/speculative.cpp:35-70,
273-302): it is retuned only when a probabilistic request's (temp, seed) differ from the last
one's, so a temperature-0 request after a probabilistic one drafts with that earlier request's
temperature (the argmax is the same; the --spec-draft-p-min test sees other probabilities).
`slot` carries that across requests.

The server drafts only with a draft model whose vocabulary matches the target's
(`compatibility`, common/speculative.cpp:106-174); otherwise it runs without speculation at all.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from replay.builds.loop_shapes import Era
from replay.loop.state import SlotState
from replay.numerics.rng import DRAFT_SEED_XOR
from replay.runtime.binding import L
from replay.runtime.gguf import vocab_digest
from replay.runtime.llama import Context, Model
from replay.runtime.sampler import LLAMA_DEFAULT_SEED, SamplerChain, SamplingParams

DRAFT_TOP_K = 10  # common/speculative.cpp:273-281
VOCAB_MAX_SIZE_DIFFERENCE = 128  # common/speculative.cpp:30
VOCAB_CHECK_START_TOKEN_ID = 5  # common/speculative.cpp:31


def compatibility(target: Model, draft: Model) -> str | None:
    """Why the server would refuse `draft` as the target's draft model, or None
    (common_speculative_are_compatible, common/speculative.cpp:106-174). Asked once per pair of loaded
    models: on a 262k vocabulary the comparison reads every token's text of both (0.25 s), unless the two
    files' token-text arrays are the same bytes (runtime/gguf.py vocab_digest)."""
    known = target.__dict__.setdefault("_drafts_judged", weakref.WeakKeyDictionary())
    if draft not in known:
        known[draft] = _compatibility(target, draft)
    return known[draft]


def _compatibility(target: Model, draft: Model) -> str | None:
    tv, dv = target.vocab, draft.vocab
    if L.llama_vocab_type(tv) != L.llama_vocab_type(dv):
        return "the draft's vocabulary type differs from the target's"
    for name, add, tok in (("BOS", L.llama_vocab_get_add_bos, L.llama_vocab_bos),
                           ("EOS", L.llama_vocab_get_add_eos, L.llama_vocab_eos)):
        if add(tv) != add(dv) or (add(tv) and tok(tv) != tok(dv)):
            return f"the draft's {name} token differs from the target's"
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"the vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE} ({target.n_vocab} vs {draft.n_vocab})"
    digest = vocab_digest(target.path)
    if digest is not None and digest == vocab_digest(draft.path):
        return None  # the files hold the same text for every token id (libllama loads each as it is stored)
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        if L.llama_vocab_get_text(tv, i) != L.llama_vocab_get_text(dv, i):
            return f"token {i} differs between the draft's vocabulary and the target's"
    return None


def mirror(ctx: Context, tokens: Sequence[int], pos0: int) -> None:
    """The draft context's copy of a target batch (common/speculative.cpp:304-343 process), without its
    output row. The server marks the copy's last row for output (:312) and never reads it: draft()
    decodes id_last again at pos0 and samples that row (:383-390). An output row writes no KV cell (a
    model graph takes its output rows after the last layer's attention has stored every row's K and V:
    src/models/gemma3.cpp, llama.cpp likewise), so the draft's memory, and every draft, is the server's
    without it, one vocabulary-wide matmul row less a step (8 ms on Gemma 3's 262k tokens)."""
    ctx.decode(tokens, pos0, [False] * len(tokens))


def draft_chain(model: Model, retune: tuple[float, int] | None, *, suppress_tokens: bool) -> SamplerChain:
    """A draft sampler as common/speculative.cpp builds one: top-k 10 (:1453-1460 for MTP heads, likewise
    for a draft model), or, once retuned to a request's (temp, seed), top-k 10 and that temperature with a
    dist seeded `seed ^ 0x85ebca6b` (spec_retune, :33-70)."""
    if retune is None:
        return SamplerChain(model, SamplingParams(samplers=("top_k",), top_k=DRAFT_TOP_K, seed=LLAMA_DEFAULT_SEED),
                            suppress_tokens=suppress_tokens)
    temp, seed = retune
    s = LLAMA_DEFAULT_SEED if seed == LLAMA_DEFAULT_SEED else (seed ^ DRAFT_SEED_XOR)
    return SamplerChain(model, SamplingParams(samplers=("top_k", "temperature"), top_k=DRAFT_TOP_K, temp=temp, seed=s),
                        suppress_tokens=suppress_tokens)


@dataclass
class DraftContext:
    """The draft model and its context (the slot's memory owns it) for one request."""

    model: Model
    ctx: Context
    era: Era
    temp: float
    seed: int
    slot: SlotState = field(default_factory=SlotState)  # what the slot keeps: its draft sampler's last retune

    def drafter(self, spec) -> "DraftSimple":
        return DraftSimple(self, spec)


class DraftSimple:
    """The draft-simple drafter (module docstring)."""

    name = "draft-simple"

    def __init__(self, source: DraftContext, spec):
        self.source, self.ctx, self.spec = source, source.ctx, spec
        # before b11368 (no rejection verifier) there is no probabilistic drafting and the (argmax) sampler
        # is reset every step, [0c1e570] common/speculative.cpp:326; with argmax drafting that changes nothing
        self.probabilistic_server = source.era.rejection and spec.draft_sampling == "probabilistic"
        self.probabilistic = self.probabilistic_server and source.temp > 0
        self.chain: SamplerChain | None = None  # made at the first draft of the request, as the server retunes
        # q of the last draft: the draft chain's candidates (ids, p) at each drafted position
        self.last_q: list[tuple[np.ndarray, np.ndarray]] | None = None

    def _make_chain(self) -> SamplerChain:
        """The slot's draft sampler for this request: retuned to the request's (temp, seed) when it
        drafts probabilistically, else as the slot's last retune left it (module docstring)."""
        slot = self.source.slot
        if self.probabilistic:
            slot.retune = (self.source.temp, self.source.seed)  # spec_retune (:35-70)
        return draft_chain(self.source.model, slot.retune if self.probabilistic_server else None,
                           suppress_tokens=self.source.era.suppress_tokens)

    @property
    def passes(self) -> int:
        """The draft chain's passes so far this request (one per drafted position)."""
        return self.chain.passes if self.chain is not None else 0

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]:
        """common/speculative.cpp:350-472: decode [id_last], then sample/argmax and decode one token
        at a time until draft.n_max (or the step's n_max) tokens, or cur_p[0].p < p_min."""
        ctx, spec = self.ctx, self.spec
        if self.chain is None:
            self.chain = self._make_chain()
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
        if self.chain is not None:
            self.chain.close()
