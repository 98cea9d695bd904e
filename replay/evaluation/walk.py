"""Evaluate the target over a transcript's tokens with the server's decode schedule: the truth.

The truth of a generated token is what the server computed for it, in the decode it computed it in
(what a server patched to report real probabilities sends: docs/architecture.md, "The truth"): the
prompt in the server's prompt batches, then each generated token's row decoded alone in its kind
(`scored`: a one-token decode with the server's -t, a verify-batch row with one thread, which gives
the batch row bit for bit). Where the transcript does not show the batches, recover takes the values
from the loop replayed instead (commands/looped.py).

Why the schedule matters (docs/numerics.md): on CPU the matmul kernel
depends on the batch's row count, so teacher-forcing prompt + completion in one
big batch shifts SmolLM2's logprobs by up to 0.2 nats. llama-server evaluates the
prompt in sub-batches of n_batch with logits only at the last prompt token
(server-context.cpp:3781-3874), then one generated token per decode when it
does not speculate. Replaying exactly that reproduces its logits.

Measured on SmolLM2 on the b11434 CPU build: decoding generated tokens in chunks
of 16 gives the one-per-decode logits exactly while the KV window is one 256-cell
block (libllama pads it to 256, `get_n_kv`, src/llama-kv-cache.cpp:1285-1290), but
once positions pass 256 the chunked batches drift (up to 0.24 nats on a 2,000-token
transcript, from token 253 on) even with chunks cut at the 256 boundary. So every
generated token is decoded on its own, the unspeculated server's schedule.

Memory stays flat: one logits row is alive at a time, never an N x vocab array.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from replay.errors import ModelError, TranscriptError, Unaligned
from replay.numerics.server_probs import pre_sampling
from replay.runtime.llama import Context, Model
from replay.runtime.sampler import SamplerChain, post_sampling
from replay.schedule.memory import SlotMemory
from replay.schedule.prefix import FRESH, Prefix
from replay.schedule.prompt import NO_SPANS, MessageSpans
from replay.schedule.rows import threads_for
from replay.settings.sampling import Effective
from replay.transcripts.plan import Gap, Known, PlanItem

@dataclass
class Truth:
    """What a correct server reports for one emitted token."""

    index: int
    id: int
    item: PlanItem  # the plan item it came from (a Gap may yield several tokens)
    logprob: float  # pre-sampling: log softmax of the raw logits (float32 like the server)
    top: list[tuple[int, float]]  # pre-sampling top-N (id, logprob)
    post_prob: float | None = None  # post-sampling p of the token (dist sampler's value)
    post_top: list[tuple[int, float]] | None = None  # post-sampling top-N (id, p), p > 0


class PieceIndex:
    """Token pieces (bytes) of a vocabulary, for aligning generated text to ids."""

    def __init__(self, model: Model):
        self.pieces = [model.piece(t, special=True) for t in range(model.n_vocab)]
        by_first: dict[int, list[int]] = {}
        for t, b in enumerate(self.pieces):
            if b:
                by_first.setdefault(b[0], []).append(t)
        self.by_first = {k: np.array(v, dtype=np.int64) for k, v in by_first.items()}

    def candidates(self, data: bytes) -> np.ndarray:
        """Ids whose piece is a non-empty prefix of `data`."""
        if not data:
            return np.empty(0, dtype=np.int64)
        ids = self.by_first.get(data[0])
        if ids is None:
            return np.empty(0, dtype=np.int64)
        return np.array([t for t in ids if data.startswith(self.pieces[t])], dtype=np.int64)

    def splittable(self, data: bytes, boundaries: Sequence[bool] | None = None) -> list[bool]:
        """ok[i]: data[i:] can be written as a sequence of pieces (ok[len] is True), where a token
        may end inside `data` only at offsets k with boundaries[k] true (None: anywhere).

        Alignment only steps to offsets from which the rest can still be
        completed, so a preferred long piece never strands the remainder
        (gap b"abc" with pieces {"ab", "a", "bc"} aligns as "a" + "bc").
        """
        ok = [False] * (len(data) + 1)
        ok[len(data)] = True
        for i in range(len(data) - 1, -1, -1):
            if i > 0 and boundaries is not None and not boundaries[i]:
                continue
            ok[i] = any(ok[i + len(self.pieces[t])] for t in self.candidates(data[i:]))
        return ok


def walk(slot: SlotMemory, prompt: Sequence[int], plan: Sequence[PlanItem], *, prefix: Prefix = FRESH,
         spans: MessageSpans = NO_SPANS, pieces: PieceIndex | None = None,
         scored: Sequence[str | None] | None = None) -> Iterator[tuple[int, int, PlanItem, np.ndarray]]:
    """Yield (index, token id, plan item, logits that scored it) for every generated token.

    The logits are a view of libllama's buffer, valid until the generator is resumed: read them
    before asking for the next token (truths does), copy them to keep them.

    The prompt goes in as SlotMemory.start says. Known ids are decoded one per call; a Gap is
    resolved one token at a time, each step taking, among the tokens whose bytes continue the
    gap, the one the target ranks highest (pieces with the same bytes are told apart by the
    model's own distribution).

    `scored` (schedule/rows.py scored_by, one per plan item) says which decode computed each item's
    values on the server: the row that scores an item is decoded with the server's threads where the
    server decoded it alone, with one thread where a verify batch computed it (the batch row, bit for
    bit); None: every row alone, the unspeculated server's schedule.
    """
    ctx = slot.ctx
    ctx.single_row_threads(ctx.threads)  # the prompt's last batch may be one row: the server's -t
    kinds = list(scored) if scored is not None else [None] * len(plan)

    def decode_row(tok: int, pos: int, kind: str | None) -> None:
        ctx.single_row_threads(threads_for(kind, ctx.threads))
        ctx.decode([tok], pos, [True])

    n_prompt = len(prompt)
    _check_room(ctx, positions_needed(n_prompt, plan), at_least=any(isinstance(i, Gap) for i in plan))
    slot.start(prompt, prefix, spans)
    pending = ctx.logits_view(-1)  # scores generated token 0 (views: each is read before the next decode)
    pos = n_prompt
    index = 0
    items = list(plan)
    i = 0
    gap_rest: bytes | None = None
    gap: Gap | None = None
    reach: list[bool] = []
    while i < len(items) or gap_rest:
        if gap_rest:
            if pieces is None:
                raise TranscriptError("token ids are missing and no piece index was given")
            off = len(gap.data) - len(gap_rest)
            cands = [t for t in pieces.candidates(gap_rest) if reach[off + len(pieces.pieces[t])]]
            if not cands:
                raise Unaligned(index, gap_rest)
            cands = np.array(cands, dtype=np.int64)
            tok = int(cands[np.argmax(pending[cands])])
            gap_rest = gap_rest[len(pieces.pieces[tok]):] or None
            yield index, tok, gap, pending
            index += 1
            if gap_rest is not None or i < len(items):
                _check_room(ctx, pos + 1)
                decode_row(tok, pos, kinds[i - 1] if gap_rest is not None else kinds[i])
                pos += 1
                pending = ctx.logits_view(0)
            continue
        item = items[i]
        if isinstance(item, Gap):
            gap, gap_rest = item, item.data or None
            if pieces is not None and gap_rest:
                reach = pieces.splittable(item.data, item.boundaries)
                if not reach[0]:
                    raise Unaligned(index, item.data)
            i += 1
            continue
        # a known id: scored by the row before it, then decoded on its own if anything follows
        yield index, item.id, item, pending
        index += 1
        i += 1
        if i < len(items):
            _check_room(ctx, pos + 1)
            decode_row(item.id, pos, kinds[i])
            pos += 1
            pending = ctx.logits_view(0)


def positions_needed(n_prompt: int, plan: Sequence[PlanItem]) -> int:
    """The KV positions evaluating a record takes: the prompt, then every generated token but the last
    (it is scored by the row before it and never decoded). A Gap (text without ids) takes at least one
    token, so with gaps this is a lower bound.

    >>> positions_needed(5, [Known(i, None) for i in range(20)])   # the fixture: -c 24 is enough
    24
    >>> positions_needed(5, [])
    5
    """
    return n_prompt + max(len(plan) - 1, 0)


def _check_room(ctx: Context, n: int, at_least: bool = False) -> None:
    if n > ctx.n_ctx:
        raise ModelError(f"prompt + completion need {'at least ' if at_least else ''}{n} positions but the "
                         f"context holds {ctx.n_ctx}: pass --ctx-size {n} or more")


def stateful_sampler(params) -> str | None:
    """The sampler in the chain whose state follows the token it selects, or None: mirostat (its mu,
    llama-sampler.cpp: llama_sampler_mirostat_apply) and adaptive-p (its running average of the
    selected token's probability, active for a target >= 0).

    >>> from replay.settings.sampling import SamplingParams
    >>> stateful_sampler(SamplingParams(mirostat=2)), stateful_sampler(SamplingParams()) is None
    ('mirostat 2', True)
    """
    if params.mirostat:
        return f"mirostat {params.mirostat}"
    if "adaptive_p" in params.samplers and params.adaptive_target >= 0:
        return "adaptive-p"
    return None


def truths(model: Model, slot: SlotMemory, prompt: Sequence[int], plan: Sequence[PlanItem], settings: Effective,
           n_top: int, *, post: bool, pieces: PieceIndex | None = None,
           prefix: Prefix = FRESH, spans: MessageSpans = NO_SPANS, suppress_tokens: bool = True,
           single_draw: bool = True, scored: Sequence[str | None] | None = None) -> Iterator[Truth]:
    """The true probabilities of every generated token, in order.

    `post` also runs the target sampler chain (prompt fed to its history, each
    emitted token accepted after its position) for post-sampling values; `suppress_tokens` and
    `single_draw` are the build's chain rules (builds/loop_shapes.py). A chain with state that follows the
    token it selects itself (mirostat's mu, adaptive-p's running average: stateful_sampler) is exact
    only while it selects the token the server emitted; where it does not, a TranscriptError says so.
    """
    chain = SamplerChain(model, settings.params, settings.grammar, suppress_tokens=suppress_tokens,
                         single_draw=single_draw) if post else None
    stateful = stateful_sampler(settings.params) if post else None
    try:
        if chain is not None:
            chain.accept_prompt(prompt)
        for index, tok, item, logits in walk(slot, prompt, plan, prefix=prefix, spans=spans, pieces=pieces,
                                             scored=scored):
            if not 0 <= tok < model.n_vocab:
                raise TranscriptError(f"generated token {index}: id {tok} is outside the model's vocabulary "
                                      f"({model.n_vocab} tokens)")
            # a server reports a token's probability only with n_probs >= 1 (tools/server/server-context.cpp:
            # 2210, 4218), and its float32 sum's order depends on n_probs (numerics/server_probs.py): a record
            # that asked for none gets the values of n_probs 1, as the loop's (loop/loop.py) and a fixed server's
            logprob, top = pre_sampling(logits, tok, max(n_top, 1))
            top = top[:n_top]
            t = Truth(index=index, id=tok, item=item, logprob=logprob, top=top)
            if chain is not None:
                cands, sel = chain.sample(logits)  # with a grammar, masked only when it resampled
                if stateful and int(cands["id"][sel]) != tok:
                    raise TranscriptError(
                        f"generated token {index}: {stateful} needs the speculative loop's own draws from here "
                        f"(this replay selected {int(cands['id'][sel])}, the server emitted {tok}): spec-replay trace"
                    ).with_detail(
                        f"generated token {index}: {stateful} updates its state from the token the chain selects, "
                        f"and this replay's chain selected {int(cands['id'][sel])} where the server emitted {tok} "
                        "(its speculative loop drew differently): post-sampling values from here on need the "
                        "loop's own draws (spec-replay trace)")
                t.post_prob, t.post_top = post_sampling(cands, tok, n_top)
                chain.accept(tok)
            yield t
    finally:
        if chain is not None:
            chain.close()
