"""A model's kernel signature: the hash of every logit it computes over batches of the shapes a
replay decodes, so that two CPU variants (or repack on and off) that compute this model bit for bit
alike are known to, and one probe of a transcript stands for both (run/kernels/processes.py).

Which kernel a ggml CPU backend runs for a matrix product depends on the weights' type, the variant's
instruction set, the buffer the weights sit in (repacked, AMX) and the batch's row count (the repack
computes one row with gemv and several with gemm, AMX one row with VNNI and several with tiles:
ggml-cpu/amx/mmq.cpp:2435; chunking changes between 56 and 68 rows on quantized weights). SHAPES
covers each of those: single tokens, every verify-sized batch up to 9 rows, the 17 and 33 of longer
drafts, and a prompt batch of 80 rows, past the 68-row change; the context is the transcript's (flash attention,
cache types and ubatch choose other kernels too).
"""
from __future__ import annotations

import hashlib

import numpy as np

from replay.runtime.llama import Context, Model

# rows of each decode, in order; the prompt batch asks for its last row's logits only (as a server's does,
# so the output matrix computes one row), a verify batch for every row
SHAPES = (80, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 1)
PROMPT = 80
VERSION = 2  # bumped when SHAPES or the ids change: every cached signature is then computed again


def kernel_signature(model: Model, *, n_batch: int, n_ubatch: int, flash_attn: str, type_k: str, type_v: str,
                     swa_full: bool, threads: int) -> str:
    """The sha256 of the float32 logits of SHAPES' decodes (the prompt batch's last row, every row of the
    others), on a context of the given configuration; the ids are fixed draws from the whole vocabulary."""
    n = sum(SHAPES)
    ids = [int(t) for t in np.random.default_rng(20261202).integers(0, model.n_vocab, n)]
    h = hashlib.sha256()
    with Context(model, n_ctx=max(256, n), n_batch=max(n_batch, max(SHAPES)), n_ubatch=n_ubatch, n_threads=threads,
                 flash_attn=flash_attn, type_k=type_k, type_v=type_v, swa_full=swa_full) as ctx:
        pos = 0
        for k, rows in enumerate(SHAPES):
            every = not (k == 0 and rows == PROMPT)
            ctx.decode(ids[pos:pos + rows], pos, [every or i == rows - 1 for i in range(rows)])
            for i in (range(rows) if every else [-1]):
                h.update(ctx.logits_view(i).tobytes())
            pos += rows
    return h.hexdigest()
