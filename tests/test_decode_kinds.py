"""Past 256 positions a generated token's values depend on the decode that computed them, and recover
computes each one in the kind of decode the server used (schedule/rows.py, evaluation/walk.py).

A speculating server scores drafted tokens in the rows of a verify batch (they are sent with the
placeholder) and the tokens of undrafted steps in one-token decodes on its own `-t` (sent with real
values). From 512 KV cells on, ggml-cpu sums a one-token decode's flash attention in one chunk of the
KV per thread (ggml/src/ggml-cpu/ops.cpp:9489-9492, use_split_kv_path) and a batch row in one piece, so
the replay decodes a verify-batch row alone on one thread (one chunk: the batch row, bit for bit) and a
one-token decode on the server's `-t`.

These tests run the real walk on quantized tiny models (Q8_0 and Q4_0 weights, whose matmuls take the
same per-row path in a batch and alone) with llama-cpp-python's own library: quick tier, nothing built.
The "server" here is libllama driven as the server drives it: the prompt in one batch, a verify batch
of four rows on two threads, then a one-token decode on two threads. Each test also shows that the
old one-token schedule (every row alone on the server's `-t`) does not give the server's values, so it
fails on that code. F32 weights do not serve: their matmul takes another path for a batch than for one
row (2e-7 apart on tiny-target.gguf), which is not what this measures.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from replay.evaluation.walk import walk
from replay.runtime.llama import Context, Model
from replay.schedule.memory import SlotMemory
from replay.schedule.prompt import CheckpointRules
from replay.schedule.rows import ALONE, BATCHED, split_kv
from replay.transcripts.plan import EntryPlace, Known

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SERVER_THREADS = 2


def _server_rows(model: Model, prompt: list[int], generated: list[int]) -> list[np.ndarray]:
    """The logits rows that scored `generated` on a speculating server: the prompt's last row scores
    token 0; a verify batch [g0, g1, g2, g3] scores tokens 1-4 (the drafts, and the token after them);
    a one-token decode of g4 scores token 5."""
    with Context(model, n_ctx=1024, n_threads=SERVER_THREADS, flash_attn="on") as ctx:
        ctx.decode(prompt, 0)
        rows = [ctx.logits(-1)]
        ctx.decode(generated[:4], len(prompt), [True] * 4)
        rows += [ctx.logits(i) for i in range(4)]
        ctx.decode([generated[4]], len(prompt) + 4, [True])
        rows.append(ctx.logits(0))
    return rows


def _replayed_rows(model: Model, prompt: list[int], generated: list[int], scored) -> list[np.ndarray]:
    with Context(model, n_ctx=1024, n_threads=SERVER_THREADS, flash_attn="on") as ctx:
        slot = SlotMemory(ctx, CheckpointRules(False), n_swa=0)
        plan = [Known(t, EntryPlace()) for t in generated]
        return [logits.copy() for *_, logits in walk(slot, prompt, plan, scored=scored)]


@pytest.mark.parametrize("fixture", ["tiny-qwen3-q8_0-target.gguf", "tiny-gemma3-q4_0-target.gguf"])
def test_past_256_positions_each_token_is_computed_in_the_decode_the_server_computed_it_in(fixture):
    with Model(FIXTURES / fixture) as model:
        rng = np.random.default_rng(7)
        prompt = [int(t) for t in rng.integers(1, model.n_vocab, 300)]
        generated = [int(t) for t in rng.integers(1, model.n_vocab, 6)]
        assert split_kv(len(prompt)), "the verify batch must sit past the 256-position boundary"
        server = _server_rows(model, prompt, generated)
        # what the transcript says: token 0 from the prompt, 1-4 sent as placeholders, 5 with real values
        kinds = [None, BATCHED, BATCHED, BATCHED, BATCHED, ALONE]
        replayed = _replayed_rows(model, prompt, generated, kinds)
        one_token = _replayed_rows(model, prompt, generated, None)
    assert len(replayed) == len(server) == 6
    for k, (mine, theirs) in enumerate(zip(replayed, server)):
        assert np.array_equal(mine, theirs), f"token {k}: max |diff| {np.abs(mine - theirs).max():.3g}"
    # the control: the one-token schedule is the server's for the prompt's row only
    assert np.array_equal(one_token[0], server[0])
    worst = max(float(np.abs(a - b).max()) for a, b in zip(one_token[1:5], server[1:5]))
    assert worst > 1e-3, f"every row alone on -t {SERVER_THREADS} should miss the verify batch's rows ({worst})"


@pytest.mark.parametrize("server_threads", [1, 2, 4, 8])
def test_the_servers_thread_count_is_told_from_one_decode_per_candidate(server_threads):
    """A bare response does not say the server's -t; a real entry from a one-token decode past 256
    positions does, through its values (evaluation/threads.py). Every count whose decode matches is
    kept (its class); the server's own is among them, and the class is a small part of the candidates
    (on this tiny model 16 and 32 share a class of 26, 6 one of two: classes are finer on real widths)."""
    from replay.evaluation.threads import CANDIDATES, matching_threads
    with Model(FIXTURES / "tiny-qwen3-q8_0-target.gguf") as model, \
            Context(model, n_ctx=1024, n_threads=SERVER_THREADS, flash_attn="on") as ctx:
        rng = np.random.default_rng(3)
        prompt = [int(t) for t in rng.integers(1, model.n_vocab, 300)]
        ctx.decode(prompt, 0)
        ctx.single_row_threads(server_threads)
        ctx.decode([5], len(prompt), [True])
        sent = ctx.logits(0)
        ctx.seq_rm(0, len(prompt))
        ctx.single_row_threads(SERVER_THREADS)
        found = matching_threads(ctx, 5, len(prompt), lambda row: np.array_equal(row, sent))
        assert ctx.kv_tokens == prompt and ctx.n_threads == SERVER_THREADS
    assert server_threads in found and len(found) < len(CANDIDATES) // 4, found
