"""Which thread counts reproduce a one-token decode the server computed: its `-t`, found from its values.

Past 256 positions a one-token decode's flash attention sums the KV in one chunk per thread
(ggml/src/ggml-cpu/ops.cpp:9489-9492: chunk_size = ceil(n_kv / nth)), so its values depend on the thread
count the server decoded it with, and nothing in a bare response says what that was (llama-server's `-t`
defaults to the cores of its machine, common/common.cpp cpu_get_num_math). What a transcript does give
is the values themselves: a real entry after the first came from a one-token decode (schedule/rows.py).
The KV before the first such row past 256 positions does not depend on the count (prompt and verify
batches, and one-token decodes under 512 KV cells, take no split), so decoding that one row again
with each candidate count and comparing with the server's entry tells the counts apart, a decode per
candidate: the way the CPU kernels are found from the first entry (run/kernels/).

Counts that cut the KV into the same chunks give the same values there and stay candidates together
(a class); the smallest is used, and the report names the rest.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from replay.runtime.llama import Context

# the counts tried: every count a 1-32 core machine's default gives, then the larger common ones
CANDIDATES: tuple[int, ...] = tuple(range(1, 33)) + (36, 40, 44, 48, 52, 56, 60, 64, 72, 80, 96, 112, 128, 192, 256)


def matching_threads(ctx: Context, token: int, pos: int, agrees: Callable[[np.ndarray], bool],
                     candidates: Sequence[int] = CANDIDATES) -> list[int]:
    """The counts among `candidates` whose one-token decode of `token` at `pos` gives logits that
    `agrees` accepts (the server's entry for the token that row scores). The context must hold the
    positions before `pos` as the server computed them; it holds them again afterwards (the row is
    removed after each try) and keeps its own thread count.

    >>> from replay.paths import FIXTURES
    >>> from replay.runtime.llama import Model
    >>> with Model(FIXTURES / "tiny-qwen3-q8_0-target.gguf") as m, Context(m, n_ctx=512, flash_attn="on") as c:
    ...     prompt = [1 + i % 50 for i in range(300)]
    ...     c.decode(prompt, 0)
    ...     c.single_row_threads(3); c.decode([7], 300, [True]); want = c.logits(0); c.seq_rm(0, 300)
    ...     found = matching_threads(c, 7, 300, lambda row: np.array_equal(row, want), range(1, 9))
    ...     (found, c.n_threads, c.kv_tokens == prompt)
    ([3], 3, True)
    """
    own = ctx.n_threads
    found = []
    try:
        for n in candidates:
            ctx.single_row_threads(n)
            ctx.decode([token], pos, [True])
            ok = agrees(ctx.logits_view(0))
            ctx.seq_rm(0, pos)
            if ok:
                found.append(n)
    finally:
        ctx.single_row_threads(own)
    return found
