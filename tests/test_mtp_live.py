"""MTP heads (`--spec-type draft-mtp`) against real b11434 servers: trace token-exact with the server's
draft totals, recover equal to the patched server's values (loop/draft_mtp.py).

The targets are fixtures/make_tiny_mtp.py's tiny hy_v3 models with one nextn layer (the single-head
drafter) and two (chained heads), F32 and Q8_0. Each server answers four /completion requests in turn on
one slot, so the MTP context's carry (pending_h, never reset) runs across requests as the server's does.
"""
from __future__ import annotations

import json

import pytest
from cli_helpers import run

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.paths import FIXTURES
from replay.transcripts.entries import record_entries
from replay.transcripts.format import dumps
from replay.transcripts.readers import read_text

pytestmark = [pytest.mark.build, pytest.mark.live_server]

PROMPTS = ("hello world the", "abcabc", "The quick brown fox", "Once upon a time")


def _items(temp: float) -> list[RequestItem]:
    return [RequestItem("/completion", {"prompt": p, "n_predict": 48, "n_probs": 2, "temperature": temp, "seed": 3})
            for p in PROMPTS]


def _record(binary, cfg: ServerConfig, temp: float) -> list[dict]:
    with LlamaServer(cfg, binary=binary) as srv:
        return [record_one(srv.url, it, srv.config.flags_block()) for it in _items(temp)]


def _write(records: list[dict], path):
    path.write_text("".join(dumps(t, indent=None) + "\n" for t in records))
    return path


CASES = {  # id: (fixture, temperature, server flags)
    "one-head-f32-t0": ("tiny-hyv3-mtp1.gguf", 0.0, {}),
    "two-heads-f32-t0": ("tiny-hyv3-mtp2.gguf", 0.0, {}),
    "one-head-q8_0-t0": ("tiny-hyv3-q8_0-mtp1.gguf", 0.0, {}),
    "two-heads-q8_0-t1": ("tiny-hyv3-q8_0-mtp2.gguf", 1.0, {}),
    "one-head-q8_0-t1-probabilistic": ("tiny-hyv3-q8_0-mtp1.gguf", 1.0, {"draft_sampling": "probabilistic"}),
    "two-heads-f32-t1-probabilistic": ("tiny-hyv3-mtp2.gguf", 1.0, {"draft_sampling": "probabilistic"}),
}


@pytest.mark.parametrize("case", CASES)
def test_trace_drafts_and_verifies_as_a_real_mtp_server(case, b11434, server_cpu, tmp_path):
    """Every token and the draft totals of each record (a drafted/accepted count per record, from the
    server's timings), on one and two heads, at temperature 0 and 1: greedy drafts verified by
    sample-and-match, and probabilistic ones (the retuned draft sampler) by the rejection rule."""
    name, temp, flags = CASES[case]
    cfg = ServerConfig(FIXTURES / name, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",), **flags)
    records = _record(b11434.server, cfg, temp)
    assert all(r["response"]["timings"]["draft_n"] > 0 for r in records)
    src = _write(records, tmp_path / "mtp.jsonl")
    r = run("trace", src, "-m", FIXTURES / name, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    traced = json.loads(r.stdout)["records"]
    assert len(traced) == len(PROMPTS)
    for t in traced:
        assert t["reproduced"], t.get("first_divergence")
        rules = {step["rule"] for step in t.get("steps", []) if step.get("draft")}
        assert not rules or rules == {"rejection" if flags else "sample-and-match"}, rules
        assert (t["draft_n"], t["draft_n_accepted"]) == (t["server_draft_n"], t["server_draft_n_accepted"]), t
    print(f"\n{case}: drafted/accepted " + ", ".join(f"{t['draft_n']}/{t['draft_n_accepted']}" for t in traced))


@pytest.mark.parametrize("n_parallel", [1, -1], ids=["one-slot", "default-4-slots"])
def test_recovered_values_are_the_patched_mtp_servers(n_parallel, b11434, patched, server_cpu, tmp_path):
    """recover fills every placeholder of an MTP server's transcript with what the same build, patched
    by `spec-replay patch`, reports: bit for bit."""
    name = "tiny-hyv3-q8_0-mtp1.gguf"
    cfg = ServerConfig(FIXTURES / name, n_ctx=256, n_parallel=n_parallel, spec_types=("draft-mtp",))
    plain, truth = _record(b11434.server, cfg, 1.0), _record(patched.server, cfg, 1.0)
    src, out = _write(plain, tmp_path / "mtp.jsonl"), tmp_path / "mtp.repaired.jsonl"
    r = run("recover", src, "-m", FIXTURES / name, "-o", out, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    reps = json.loads(r.stdout)["records"]
    assert sum(rep["summary"]["counts"]["placeholder"] for rep in reps) >= 4 * 40
    for line, want in zip(out.read_text().splitlines(), truth):
        a = record_entries(read_text(line, "repaired")[0])
        b = record_entries(read_text(json.dumps(want), "patched")[0])
        assert [e.id for e in a] == [e.id for e in b]
        worst = max(abs(x.logprob - y.logprob) for x, y in zip(a, b))
        assert worst == 0.0, worst


def test_tune_sweeps_an_mtp_servers_draft_depth_and_times_its_heads(b11434, server_cpu, tmp_path):
    """tune on MTP traffic: the transcript's own setting reproduces it (tokens and draft totals), every
    --spec-draft-n-max and -p-min emits the recorded tokens at temperature 0 with the verifier's expected
    acceptance equal to the count, fewer drafts per step draft less, and --measure times the heads on an
    MTP context of this host (tuning/measure.py)."""
    from replay.run.tune import tune
    name = "tiny-hyv3-q8_0-mtp1.gguf"
    cfg = ServerConfig(FIXTURES / name, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",))
    src = _write(_record(b11434.server, cfg, 0.0), tmp_path / "mtp.jsonl")
    cpu = server_cpu[1] if server_cpu else None
    runs = tune(src, FIXTURES / name, ["--spec-draft-n-max=1,2,3", "--spec-draft-p-min=0,0.5"], server_cpu=cpu)
    assert all(r.exact for r in runs[0].records)
    for run_ in runs[1:]:
        assert all(r.same_tokens for r in run_.records), run_.setting.spelled
    for run_ in runs:
        assert all(r.expected is not None and r.expected.accepted == r.accepted for r in run_.records)
    by = {r.setting.spelled: r for r in runs}
    drafted = {n: sum(r.drafted for r in by[f"--spec-draft-n-max {n} --spec-draft-p-min 0"].records) for n in (1, 2, 3)}
    assert drafted[1] < drafted[2] < drafted[3], drafted
    r = run("tune", src, "-m", FIXTURES / name, "--vary", "--spec-draft-n-max=1,3", "--measure", *server_cpu)
    assert r.exit_code == 0, r.output[-1500:]
    assert "speed model: measured on this host" in r.output
