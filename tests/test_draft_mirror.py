"""The draft context's copy of each target batch leaves out the row the server outputs and never reads
(loop/draft_model.py mirror): the draft's memory, and so every draft, is the server's without it.

Real decodes of the tiny quantized Gemma 3 draft (sliding-window layers, Q4_0) past 256 positions: one
context mirrors as the server does (the last row output), the other as the replay does (no output). The
sequence's whole state and the draft decode that follows are compared bit for bit; the control shows the
comparison sees a one-token change in a mirrored batch."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from replay.loop.draft_model import mirror
from replay.paths import FIXTURES
from replay.runtime.llama import Context, Model

DRAFT = FIXTURES / "tiny-gemma3-q4_0-draft.gguf"
PROMPT = [(7 * i + 3) % 200 + 10 for i in range(300)]  # past 256 positions, in two prompt batches
STEPS = [[11, 12, 13, 14], [21, 22], [31, 32, 33, 34, 35], [41]]  # verify batches: [sampled] + drafts


def _state(ctx: Context) -> bytes:
    """Sequence 0's whole state (every layer's cells, full-attention and sliding-window)."""
    from replay.runtime.binding import L  # (not at module level: pytest's collection would load libllama)
    n = int(L.llama_state_seq_get_size(ctx.ptr, 0))
    buf = (ctypes.c_ubyte * n)()
    assert int(L.llama_state_seq_get_data(ctx.ptr, buf, n, 0)) == n
    return bytes(buf)


@pytest.fixture(scope="module")
def draft():
    m = Model(DRAFT)
    yield m
    m.close()


def _run(model: Model, server_rows: bool, steps=STEPS) -> tuple[list[bytes], np.ndarray]:
    """Prompt and verify batches mirrored (the server's way, or `mirror`); returns the states after each
    and the logits of the draft's next decode (draft(): id_last decoded again, its row sampled)."""
    ctx = Context(model, n_ctx=512, n_batch=256, n_ubatch=128)
    states = []
    try:
        pos = 0
        for part in [PROMPT[:256], PROMPT[256:]] + steps:
            if server_rows:
                ctx.decode(part, pos, [False] * (len(part) - 1) + [True])
            else:
                mirror(ctx, part, pos)
            pos += len(part)
            states.append(_state(ctx))
        ctx.decode([99], pos, [True])
        return states, ctx.logits(0).copy()
    finally:
        ctx.close()


def test_a_mirrored_batch_without_its_output_row_leaves_the_draft_as_the_server_has_it(draft):
    server, replay = _run(draft, True), _run(draft, False)
    assert len(server[0]) == 6 and server[0] == replay[0]
    assert np.array_equal(server[1], replay[1])


def test_the_comparison_sees_one_token_changed_in_a_mirrored_batch(draft):
    server = _run(draft, True)
    other = _run(draft, False, [STEPS[0][:-1] + [15]] + STEPS[1:])
    assert server[0][:2] == other[0][:2]  # the prompt batches are the same
    assert server[0][2] != other[0][2] and not np.array_equal(server[1], other[1])
