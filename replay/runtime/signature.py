"""A model's kernel signature: the hash of every logit it computes over batches of the shapes a
replay decodes, so that two CPU variants (or repack on and off) that compute this model bit for bit
alike are known to, and one probe of a transcript stands for both (run/kernels/processes.py).

Which kernel a ggml CPU backend runs for a matrix product depends on the weights' type, the variant's
instruction set, the buffer the weights sit in (repacked, AMX) and the batch's row count (the repack
computes one row with gemv and several with gemm, AMX one row with VNNI and several with tiles:
ggml-cpu/amx/mmq.cpp:2435; chunking changes between 56 and 68 rows on quantized weights). SHAPES
covers each of those: a prompt batch of 80 rows, past the 68-row change, every verify-sized batch up to
9 rows and the 17 and 33 of longer drafts, then single tokens; the context is the transcript's (flash
attention, cache types and ubatch choose other kernels too).

Three hashes come out of one run: the whole signature (every shape: what makes a class), the batch
signature, of the batches alone, taken before any single-token decode has written the KV they read,
and the prompt signature, of the prompt batch alone. Two classes with different batch (or prompt)
signatures compute a prompt of two rows or more differently, so a first entry one of them reproduces
exactly the other does not (run/kernels/choice.py batch_alone). A run may stop after the prompt batch
(`upto="prompt"`): what a baseline variant (x64, sse42: a tenth of the others' speed) is asked for
where only its prompt batches matter.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from replay.runtime.llama import Context, Model

# rows of each decode, in order; the prompt batch asks for its last row's logits only (as a server's does,
# so the output matrix computes one row), a verify batch for every row
SHAPES = (80, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 1, 1)
PROMPT = 80
VERSION = 4  # bumped when SHAPES or the ids change: every cached signature is then computed again


class Signature(NamedTuple):
    """A model's kernel signature under one candidate: `whole` over every shape, `batches` over the
    batches of two rows or more that come before the first single-token decode, `prompt` over the prompt
    batch alone; `whole` and `batches` None for a run stopped after the prompt batch."""

    whole: str | None
    batches: str | None
    prompt: str


def kernel_signature(model: Model, *, n_batch: int, n_ubatch: int, flash_attn: str, type_k: str, type_v: str,
                     swa_full: bool, threads: int, upto: str = "whole") -> Signature:
    """The sha256 of the float32 logits of SHAPES' decodes (the prompt batch's last row, every row of the
    others), on a context of the given configuration, whole, up to the first single-token decode and
    over the prompt batch alone; the ids are fixed draws from the whole vocabulary. `upto="prompt"`
    stops after the prompt batch."""
    n = sum(SHAPES)
    ids = [int(t) for t in np.random.default_rng(20261202).integers(0, model.n_vocab, n)]
    h = hashlib.sha256()
    batches: str | None = None
    prompt: str | None = None
    with Context(model, n_ctx=max(256, n), n_batch=max(n_batch, max(SHAPES)), n_ubatch=n_ubatch, n_threads=threads,
                 flash_attn=flash_attn, type_k=type_k, type_v=type_v, swa_full=swa_full) as ctx:
        pos = 0
        for k, rows in enumerate(SHAPES):
            every = not (k == 0 and rows == PROMPT)
            if rows == 1 and batches is None:
                batches = h.copy().hexdigest()
            ctx.decode(ids[pos:pos + rows], pos, [every or i == rows - 1 for i in range(rows)])
            for i in (range(rows) if every else [-1]):
                h.update(ctx.logits_view(i).tobytes())
            pos += rows
            if k == 0:
                prompt = h.copy().hexdigest()
                if upto == "prompt":
                    return Signature(None, None, prompt)
    return Signature(h.hexdigest(), batches if batches is not None else h.hexdigest(), prompt)
