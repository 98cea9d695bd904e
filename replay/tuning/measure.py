"""The cost table measured on this host with the user's models (`tune --measure`).

Each operation the generation phase performs (tuning/costs.py) is timed here, in this process, with the
libllama the replay computes with: the target's and the draft model's contexts made as the server makes
its slot's (schedule/memory.py SlotConfig: -c, -b, -ub, -t, -fa, the KV types), filled to the depth the
records generate at, then for every batch size the sweep decodes, a decode of that many rows at that
depth (outputs on every row for the target, on the last for the draft, as the loop decodes them), taken
back out with a sequence removal and repeated; the median of `reps` after one warm-up. Sampling is timed
likewise: the request's own target chain over one row of real logits, and the draft chain (top-k 10,
common/speculative.cpp:273-281) over one of the draft model's.

What it does not see: the server's HTTP and detokenizing work per token, and another machine's speed.
A transcript with timings scales the table to the server's (tuning/calibrate.py).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from replay.errors import ModelError
from replay.loop.draft_model import DRAFT_TOP_K
from replay.runtime.llama import Context, Model
from replay.runtime.sampler import LLAMA_DEFAULT_SEED, SamplerChain
from replay.schedule.memory import SlotConfig
from replay.settings.sampling import SamplingParams
from replay.tuning.costs import CostTable

REPS = 5


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up: first-use allocations, caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def _fill(ctx: Context, tokens: Sequence[int], depth: int) -> None:
    """Decode `depth` positions of `tokens` (repeated as needed) in the context's batches."""
    ids = (list(tokens) * (depth // max(len(tokens), 1) + 1))[:depth]
    for a in range(0, len(ids), ctx.n_batch):
        ctx.decode(ids[a:a + ctx.n_batch], a)


def _mtp_costs(target: Model, slot: SlotConfig, sizes: Iterable[int], depth: int, tokens: Sequence[int],
               draft_types: tuple[str, str], reps: int) -> tuple[dict[int, float], float]:
    """The MTP heads' decode costs (loop/draft_mtp.py): the slot's MTP context, filled to `depth` by the
    heads' catch-up on the target's batches, then a batch of each size with hidden rows, its last row out
    (a draft step; a catch-up batch has none, at about the same cost); and the draft chain's sampling."""
    from replay.loop.draft_mtp import DRAFT_TOP_K as MTP_TOP_K, MtpHeads, backend_top_k, check_mtp
    check_mtp(target)
    memory = slot.open(target, None, draft_types, mtp=True)
    heads = MtpHeads(memory.ctx, memory.draft, suppress_tokens=False)
    try:
        ids = (list(tokens) * (depth // max(len(tokens), 1) + 1))[:depth]
        for a in range(0, len(ids), memory.ctx.n_batch):
            memory.ctx.decode(ids[a:a + memory.ctx.n_batch], a)
            heads.process(ids[a:a + memory.ctx.n_batch], a)
        dctx, token, out = memory.draft, ids[-1] if ids else 0, {}
        rows = np.zeros((max([*sizes, 1]), target.n_embd_out), dtype=np.float32)
        for b in sorted(set(sizes) | {1}):
            if b <= 0 or depth + b > dctx.n_ctx:
                continue

            def once(b=b) -> None:
                dctx.process([token] * b, depth, rows[:b], [False] * (b - 1) + [True])
                dctx.seq_rm(0, depth, -1)
            out[b] = _median_ms(once, reps)
        dctx.process([token], depth, rows[:1], [True])
        logits = backend_top_k(dctx.logits(0), MTP_TOP_K)
        chain = SamplerChain(target, SamplingParams(samplers=("top_k",), top_k=MTP_TOP_K, seed=LLAMA_DEFAULT_SEED),
                             suppress_tokens=False)
        try:
            return out, _median_ms(lambda: chain.apply(logits), reps)
        finally:
            chain.close()
    finally:
        heads.close()
        memory.close()


def _decode_costs(ctx: Context, sizes: Iterable[int], depth: int, token: int, *, all_rows: bool,
                  reps: int) -> dict[int, float]:
    """The median time of a decode of each size at `depth`, undone after each. A memory with recurrent-state
    snapshots (n_rs_seq > 0) drops at most that many rows: a longer batch is undone from a checkpoint of its
    state at `depth` (as the server's would be), whose restore's own median time is taken off."""
    out = {}
    saved = ctx.save_partial() if ctx.n_rs_seq > 0 else None
    restore_ms = None
    for b in sorted(set(sizes)):
        if b <= 0 or depth + b > ctx.n_ctx:
            continue
        outs = [True] * b if all_rows else [False] * (b - 1) + [True]
        bounded = saved is not None and b > ctx.n_rs_seq

        def undo(bounded: bool = bounded) -> None:
            if bounded:
                ctx.load_partial(saved)
            ctx.seq_rm(0, depth, -1)

        def once() -> None:
            ctx.decode([token] * b, depth, outs)
            undo()
        if bounded and restore_ms is None:
            restore_ms = _median_ms(lambda: undo(True), reps)
        out[b] = max(0.0, _median_ms(once, reps) - (restore_ms if bounded else 0.0))
    return out


def measure(target: Model, draft: Model | None, slot: SlotConfig, params: SamplingParams, *,
            target_sizes: Iterable[int], draft_sizes: Iterable[int], depth: int, tokens: Sequence[int],
            draft_types: tuple[str, str] = ("f16", "f16"), draft_threads: int | None = None,
            reps: int = REPS, mtp: bool = False) -> CostTable:
    """The cost table (module docstring): decodes of each size in `target_sizes` / `draft_sizes` at KV depth
    `depth` (filled with `tokens`; less where the context cannot hold it, and the source says so), the target
    chain built from `params` (one request's: tune passes the first record's, and its slot) and the draft
    chain. A target that cannot drop a suffix (recurrent, hybrid, unless an MTP server gave it snapshots)
    is refused: ModelError."""
    wanted = depth
    depth = max(1, min(depth, slot.n_ctx - max([*target_sizes, *draft_sizes, 1]) - 1))
    token = tokens[-1] if tokens else 0
    ctx = slot.context(target, target=True)
    try:
        if not ctx.removes_suffixes():
            raise ModelError(f"{target.path.name} keeps a recurrent state that cannot drop the rows a timing "
                             "decoded (the server checkpoints it instead): --measure cannot time it; without "
                             "--measure the costs come from the transcript's timings")
        _fill(ctx, tokens, depth)
        t_costs = _decode_costs(ctx, target_sizes or [1], depth, token, all_rows=True, reps=reps)
        n_rs = ctx.n_rs_seq if any(b > ctx.n_rs_seq for b in t_costs) else 0
        ctx.decode([token], depth, [True])
        logits = ctx.logits(0)
        ctx.seq_rm(0, depth, -1)
    finally:
        ctx.close()
    chain = SamplerChain(target, params)
    try:
        t_sample = _median_ms(lambda: chain.sample(logits), reps)
    finally:
        chain.close()
    d_costs, d_sample = {}, 0.0
    if mtp:  # the target's own MTP heads draft (no draft model)
        d_costs, d_sample = _mtp_costs(target, slot, draft_sizes, depth, tokens, draft_types, reps)
    elif draft is not None:
        dctx = slot.context(draft, *draft_types, threads=draft_threads)
        try:
            if not dctx.removes_suffixes():
                raise ModelError(f"the draft model {draft.path.name} keeps a recurrent state that cannot drop the rows "
                                 "a timing decoded: --measure cannot time it")
            _fill(dctx, tokens, depth)
            d_costs = _decode_costs(dctx, sorted(set(draft_sizes) | {1}), depth, token, all_rows=False, reps=reps)
            dctx.decode([token], depth, [True])
            d_logits = dctx.logits(0)
        finally:
            dctx.close()
        dchain = SamplerChain(draft, SamplingParams(samplers=("top_k",), top_k=DRAFT_TOP_K, seed=LLAMA_DEFAULT_SEED))
        try:
            d_sample = _median_ms(lambda: dchain.apply(d_logits), reps)
        finally:
            dchain.close()
    at = f"KV depth {depth}" + (f" (the records' {wanted} does not fit the context)" if depth != wanted else "")
    # an estimate, said so: such a batch's time is a decode plus a checkpoint restore, less the restore alone
    rs = (f"; target batches of more than {n_rs} rows timed from a checkpoint, its restore's median taken off"
          if n_rs else "")
    return CostTable(t_costs, d_costs, t_sample, d_sample,
                     source=f"measured on this host ({slot.threads} threads, {at}, median of {reps}{rs})")
