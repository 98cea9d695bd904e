"""Records of one file that share a prompt prefix: keeping KV between them, and only where it is exact.

Two cases (replay/schedule/prefix.py): the server reused its own cache (`cache_prompt`, its default) and
said so in `timings.cache_n`, so its values come from that KV state and recover must rebuild
it; or the server evaluated every prompt from scratch, and keeping whole n_ubatch blocks of a
shared prefix is a pure speed-up that changes no bit.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import WIDE

from replay.commands.record import RequestItem, record_one
from replay.errors import Exit
from replay.llamacpp.process import ServerConfig
from replay.run.recover import recover
from replay.schedule.prefix import Prefix, plan_prefix, reuse_points
from replay.transcripts.format import dumps

SYSTEM = " ".join(f"Rule {i}: answer politely and mention the number {i * 7 % 13}." for i in range(90))
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Write a haiku about rain.",
             "Why is the sky blue?"]
SHARED = 1274  # SmolLM2 tokens the four prompts have in common (each is 1,282-1,284 tokens)


# --- the rule -------------------------------------------------------------------------------

def test_reuse_points_are_the_ubatch_starts_of_a_fresh_evaluation():
    assert list(reuse_points(1300, 2048, 512)) == [0, 512, 1024]
    # n_batch not a multiple of n_ubatch: ubatches restart at every batch, only batch starts qualify
    assert list(reuse_points(2100, 1000, 512)) == [0, 1000, 2000]


def test_a_shared_prefix_is_kept_down_to_a_ubatch_start():
    a, b = list(range(1284)), list(range(SHARED)) + [9] * 8
    assert plan_prefix(a, len(a), b, 0, 2048, 512) == Prefix(1024, "shared prefix")


def test_the_last_prompt_token_is_always_decoded():
    p = list(range(1024))
    assert plan_prefix(p, len(p), p, 0, 2048, 512).keep == 512


def test_nothing_past_what_the_previous_record_computed_like_the_server():
    a, b = list(range(1284)), list(range(1284)) + [1]
    assert plan_prefix(a, 600, b, 0, 2048, 512).keep == 512


def test_reuse_can_be_switched_off_but_the_server_cache_is_always_rebuilt():
    a, b = list(range(1284)), list(range(SHARED)) + [9] * 8
    assert plan_prefix(a, len(a), b, 0, 2048, 512, reuse=False) == Prefix(0, "fresh")
    assert plan_prefix(a, len(a), b, SHARED, 2048, 512, reuse=False) == Prefix(SHARED, "server cache")


def test_a_server_cache_left_by_another_request_is_rebuilt_and_reported():
    b = list(range(SHARED)) + [9] * 8
    p = plan_prefix([], 0, b, SHARED, 2048, 512)
    assert (p.keep, p.how) == (SHARED, "server cache (rebuilt)") and "evaluated on their own" in p.note


@pytest.mark.model
def test_cells_computed_another_way_are_rebuilt_not_kept(smollm2):
    """The context may hold the right tokens in cells computed in other ubatches (here one token
    per decode); `rebuild` evaluates the kept prefix afresh and gives exactly a fresh context's
    logits, while keeping those cells would not."""
    from replay.evaluation.walk import walk
    from replay.runtime.llama import Context, Model
    from replay.schedule.memory import SlotMemory
    from replay.schedule.prompt import CheckpointRules
    from replay.transcripts.plan import EntryPlace, Known
    keep, rebuild = Prefix(512, "shared prefix"), Prefix(512, "server cache (rebuilt)")

    def slot(ctx):
        return SlotMemory(ctx, CheckpointRules(False), n_swa=0)
    with Model(smollm2) as m:
        prompt = m.tokenize(SYSTEM, add_special=True, parse_special=False)[:600]
        gen = [Known(t, EntryPlace()) for t in m.tokenize(" yes, of course", add_special=False, parse_special=False)]
        with Context(m, n_ctx=1024) as fresh:
            want = [l.copy() for *_, l in walk(slot(fresh), prompt, gen, prefix=keep)]
        with Context(m, n_ctx=1024) as ctx:
            for i, t in enumerate(prompt):
                ctx.decode([t], i, [False])
            assert ctx.kv_tokens == prompt
            kept = [l.copy() for *_, l in walk(slot(ctx), prompt, gen, prefix=keep)]
            ctx.clear()
            for i, t in enumerate(prompt):
                ctx.decode([t], i, [False])
            rebuilt = [l.copy() for *_, l in walk(slot(ctx), prompt, gen, prefix=rebuild)]
    assert all((a == b).all() for a, b in zip(rebuilt, want))
    assert not all((a == b).all() for a, b in zip(kept, want))


# --- live: SmolLM2 on the real b11434 server ---------------------------------------------------


def _record(server, cache_prompt: bool, path: Path) -> list[dict]:
    info = server.config.flags_block() if server.config.get("draft_model") else {}
    ts = []
    for k, q in enumerate(QUESTIONS):
        body = {"prompt": f"{SYSTEM}\nQ: {q}\nA:", "n_predict": 24, "n_probs": 5, "temperature": 0.8,
                "seed": k + 1, "cache_prompt": cache_prompt}
        ts.append(record_one(server.url, RequestItem("/completion", body), info))
    path.write_text("".join(dumps(t, indent=None) + "\n" for t in ts))
    return ts


def _plain_jsonl(module_server, smollm2, tmp_path_factory, cache_prompt: bool) -> tuple[Path, list[dict]]:
    srv = module_server(ServerConfig(smollm2))  # its own server: an empty slot cache to start
    path = tmp_path_factory.mktemp("prefix") / f"cache-{cache_prompt}.jsonl"
    return path, _record(srv, cache_prompt, path)


@pytest.fixture(scope="module")
def cached_plain(module_server, smollm2, tmp_path_factory) -> Path:
    """Four requests to one plain server with its prompt cache on: it reuses the shared prefix."""
    path, ts = _plain_jsonl(module_server, smollm2, tmp_path_factory, True)
    assert [t["response"]["timings"]["cache_n"] for t in ts] == [0, SHARED, SHARED, SHARED]
    return path


@pytest.fixture(scope="module")
def fresh_plain(module_server, smollm2, tmp_path_factory) -> Path:
    """The same requests with `cache_prompt: false`: every prompt evaluated from scratch."""
    path, ts = _plain_jsonl(module_server, smollm2, tmp_path_factory, False)
    assert all(t["response"]["timings"]["cache_n"] == 0 for t in ts)
    return path


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_the_servers_own_cache_is_rebuilt_bit_for_bit(cached_plain, smollm2):
    res = recover(cached_plain, smollm2)
    assert [r.prefix for r in res.records] == ["fresh", "server cache", "server cache", "server cache"]
    assert [r.reused_prompt_tokens for r in res.records] == [0, SHARED, SHARED, SHARED]
    # every value a plain server sends is real: all 4 x 24 agree exactly
    assert res.ok and res.summary()["counts"]["ok"] == sum(len(r.tokens) for r in res.records)
    assert res.summary()["max_abs_diff_real"] == 0.0


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_a_cache_left_by_a_request_outside_the_file_is_rebuilt(cached_plain, smollm2, tmp_path):
    """Record 2 alone: the server took 1,274 tokens from a cache the file does not explain.
    Evaluating those tokens on their own puts them in ubatches of the same kind as the server's
    (full 512-blocks, then one of ~250 rows), which rebuilds its cells exactly."""
    alone = tmp_path / "second.jsonl"
    alone.write_text(cached_plain.read_text().splitlines()[1] + "\n")
    res = recover(alone, smollm2)
    rep = res.records[0]
    assert rep.prefix == "server cache (rebuilt)" and rep.reused_prompt_tokens == SHARED
    assert any("took 1274 prompt tokens from its cache" in n for n in rep.notes)
    assert res.ok and rep.summary()["max_abs_diff_real"] == 0.0


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_a_cache_that_cannot_be_rebuilt_writes_nothing(cached_plain, smollm2, tmp_path, server_cpu):
    """The same record claiming 1,100 cached tokens: rebuilt cells cut at the wrong place give
    values that are not the server's (a fresh evaluation differs too, by 0.06 nats); recover
    says why in one line and writes nothing."""
    t = json.loads(cached_plain.read_text().splitlines()[1])
    t["response"]["timings"]["cache_n"] = 1100
    src = tmp_path / "claims.jsonl"
    src.write_text(json.dumps(t) + "\n")
    res = recover(src, smollm2)
    assert not res.ok and res.records[0].summary()["max_abs_diff_real"] > 1e-2
    out = tmp_path / "out.jsonl"
    p = subprocess.run([sys.executable, "-m", "replay.cli", "recover", str(src), "-m", str(smollm2), "-o", str(out),
                        *server_cpu], capture_output=True, text=True, timeout=600)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == Exit.FAILED and not out.exists()
    assert "Traceback" not in p.stderr and last.startswith("Error: ") and "evaluated on their own" in last


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
@WIDE
def test_keeping_a_shared_prefix_changes_no_byte(fresh_plain, smollm2, tmp_path, server_cpu):
    outs = {}
    for flag in ([], ["--no-prefix-reuse"]):
        out, report = tmp_path / f"out{len(flag)}.jsonl", tmp_path / f"report{len(flag)}.json"
        p = subprocess.run([sys.executable, "-m", "replay.cli", "recover", str(fresh_plain), "-m", str(smollm2),
                            "-o", str(out), "--report", str(report), *flag, *server_cpu], capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stderr
        rep = json.loads(report.read_text())
        outs[bool(flag)] = (out.read_bytes(), [r["reused_prompt_tokens"] for r in rep["records"]],
                            rep["summary"]["max_abs_diff_real"])
    assert outs[False][1] == [0, 1024, 1024, 1024] and outs[True][1] == [0, 0, 0, 0]
    assert outs[False][2] == outs[True][2] == 0.0
    assert outs[False][0] == outs[True][0]


@pytest.fixture(scope="module")
def cached_spec(module_server, smollm2, tmp_path_factory) -> Path:
    """The four requests to SmolLM2 drafting for itself, prompt cache on."""
    srv = module_server(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",)))
    path = tmp_path_factory.mktemp("prefix") / "spec.jsonl"
    _record(srv, True, path)
    return path


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_a_speculating_server_with_its_cache_on_is_recovered(cached_spec, smollm2):
    res = recover(cached_spec, smollm2)
    assert res.ok, res.failure()
    assert [r.prefix for r in res.records][1:] == ["server cache"] * 3
    for r in res.records:
        counts = r.summary()["counts"]
        assert counts["placeholder"] > 0
        first = r.tokens[0]
        assert first.status == "ok" and first.server_logprob == first.true_logprob  # rebuilt state: exact
        for t in r.tokens[1:]:
            if t.status == "ok" and t.server_logprob != t.true_logprob:
                assert "verify batches" in t.note and abs(t.server_logprob - t.true_logprob) <= 0.3


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_trace_continues_the_slot_the_server_reused(cached_spec, smollm2, server_cpu):
    """trace keeps the slot's memory across the records of a file: where the server took prompt tokens
    from its cache, the trace keeps the same cells (its own verify batches left them) and reproduces
    the server token for token, draft totals included, with nothing to excuse."""
    p = subprocess.run([sys.executable, "-m", "replay.cli", "trace", str(cached_spec), "-m", str(smollm2), "-md", str(smollm2),
                        "--json", *server_cpu], capture_output=True, text=True, timeout=900)
    assert "Traceback" not in p.stderr
    recs = json.loads(p.stdout)["records"]
    assert all(r["reproduced"] is True and r["notes"] == [] for r in recs), [(r["first_divergence"], r["notes"])
                                                                           for r in recs]
