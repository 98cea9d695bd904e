"""Flags that change the server's numerics: -fa, -ctk, -ctv, -b, -ub, --swa-full; and a server whose
kernels differ from the replay's (a GPU, another CPU), shown on CPU with a baseline-kernel build.

Each flag case starts a speculating and an unspeculated b11434 server with the same flags; trace must
reproduce the speculating server token for token, and recover must fill exactly the unspeculated
server's values, both reading the flags from the transcript's `server.flags`.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiers import default_and_wide

from replay.cli import main
from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.paths import FIXTURES
from replay.proof.matrix import max_value_diff
from replay.transcripts.entries import record_entries
from replay.transcripts.format import dumps
from replay.transcripts.readers import read_text

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
GEMMA = FIXTURES / "tiny-gemma3-target.gguf", FIXTURES / "tiny-gemma3-draft.gguf"

CASES = {
    "-fa off": {"flash_attn": "off"},
    "-fa on -ctk q8_0 -ctv q8_0": {"flash_attn": "on", "cache_type_k": "q8_0", "cache_type_v": "q8_0"},
    "-ctk q8_0 (-fa auto)": {"cache_type_k": "q8_0"},
    "-b 16 -ub 8": {"n_batch": 16, "n_ubatch": 8},
}


def _record(srv: LlamaServer, prompt: str, seed: int, temp: float = 1.0, n: int = 24) -> dict:
    body = {"prompt": prompt, "n_predict": n, "n_probs": 3, "temperature": temp, "seed": seed, "cache_prompt": False}
    return record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())


def _prove(spec_srv: LlamaServer, plain_srv: LlamaServer, model, draft, prompt: str, tmp_path, seeds=range(1, 6)):
    """trace token-exact and recover equal to the unspeculated server; returns (max |diff|, tokens)."""
    spec = [_record(spec_srv, prompt, s) for s in seeds]
    plain = [_record(plain_srv, prompt, s) for s in seeds]
    src = tmp_path / "spec.jsonl"
    src.write_text("".join(dumps(t, indent=None) + "\n" for t in spec))
    r = CliRunner().invoke(main, ["trace", str(src), "-m", str(model), "-md", str(draft), "--json"])
    assert r.exit_code == 0, r.output[-1500:]
    recs = json.loads(r.stdout)["records"]
    assert all(x["reproduced"] for x in recs), [x["first_divergence"] for x in recs]
    out = tmp_path / "fixed.jsonl"
    r = CliRunner().invoke(main, ["recover", str(src), "-m", str(model), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output[-1500:]
    worst, n = 0.0, 0
    for line, p in zip(out.read_text().splitlines(), plain):
        w, k = max_value_diff(json.loads(line), p)
        worst, n = max(worst, w), n + k
    return worst, n, src


@pytest.mark.parametrize("case", default_and_wide(CASES, {"-fa off", "-b 16 -ub 8"}))
def test_numerics_flags_are_replayed_exactly(case, start_server, smollm2, smollm2_draft, tmp_path, request):
    """With -fa off a verify batch's attention runs through other kernels than a one-row decode's, so
    the values a speculating server computed for its drafted tokens are not an unspeculated server's:
    the truth there is the patched server's (the values its loop computed), which recover gives by
    replaying the loop (commands/looped.py). The other flags keep the unspeculated server's values."""
    flags = CASES[case]
    # greedy drafts at t 1: sample-and-match emits the unspeculated server's tokens, so the two runs
    # can be compared token for token (a probabilistic draft changes the draws)
    spec_srv = start_server(ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",), **flags))
    if flags.get("flash_attn") == "off":
        truth_srv = start_server(ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",), **flags),
                                 binary=request.getfixturevalue("patched").server)
        exact, name = 0.0, "patched"
    else:
        truth_srv, exact, name = start_server(ServerConfig(smollm2, **flags)), 5e-4, "unspeculated"
    worst, n, src = _prove(spec_srv, truth_srv, smollm2, smollm2_draft, STORY, tmp_path)
    assert n >= 20 and worst <= exact, (case, worst, n)
    print(f"\n{case}: max |recovered - {name}| {worst:.2e} over {n} tokens")
    if "cache_type_k" in flags:
        # the flag matters: without it (stripped from server.flags) recover cannot match the server's values
        lines = [json.loads(x) for x in src.read_text().splitlines()]
        for t in lines:
            t["server"]["flags"] = {k: v for k, v in t["server"]["flags"].items()
                                    if k not in ("--cache-type-k", "--cache-type-v", "--flash-attn")}
        stripped = tmp_path / "stripped.jsonl"
        stripped.write_text("".join(json.dumps(t) + "\n" for t in lines))
        r = CliRunner().invoke(main, ["diff", str(stripped), "-m", str(smollm2), "--json"])
        counts = json.loads(r.stdout)["summary"]["counts"]
        assert r.exit_code != 0 and counts["mismatch"] > 0, counts


@pytest.mark.parametrize("swa_full", [False, True], ids=["swa", "swa-full"])
def test_sliding_window_cache_size_is_replayed(swa_full, start_server, tmp_path):
    """Gemma 3's iSWA cache, default and --swa-full, with a context large enough that the SWA cache is
    smaller than the full one when not --swa-full."""
    model, draft = GEMMA
    flags = {"n_ctx": 1024, "swa_full": True if swa_full else None}
    spec_srv = start_server(ServerConfig(model, draft_model=draft, spec_types=("draft-simple",), **flags))
    plain_srv = start_server(ServerConfig(model, **flags))
    worst, n, _ = _prove(spec_srv, plain_srv, model, draft, "hello world, the cat sat on the mat " * 4, tmp_path)
    assert n >= 20 and worst <= 5e-4, (worst, n)
    print(f"\nswa_full={swa_full}: max |recovered - unspeculated| {worst:.2e} over {n} tokens")


@pytest.fixture(scope="module")
def generic_server(b11434):
    """b11434's x64 CPU variant (baseline x86-64 kernels, SSE2), not the replay's native ones."""
    return b11434.with_cpu("x64")


def test_a_server_with_other_kernels_is_filled_kept_measured_and_reported(generic_server, smollm2, smollm2_draft,
                                                                           tmp_path):
    """Like a GPU transcript: values computed by other kernels cannot be bit-exact on this CPU. Told so
    (--server-backend), recover fills the placeholders with its own values, keeps the server's real
    values as sent, measures their disagreement and reports it; trace explains a parting by numerics."""
    cfg = ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",))
    with LlamaServer(cfg, binary=generic_server.server) as srv:
        recs = [_record(srv, STORY, s, temp=0.0, n=48) for s in range(1, 4)]
    src = tmp_path / "generic.jsonl"
    src.write_text("".join(dumps(t, indent=None) + "\n" for t in recs))
    out = tmp_path / "fixed.jsonl"
    r = CliRunner().invoke(main, ["recover", str(src), "-m", str(smollm2), "-o", str(out), "--json",
                                  "--server-backend", "x86-64 baseline kernels (the x64 CPU variant)"])
    assert r.exit_code == 0, r.output[-1500:]
    reps = json.loads(r.stdout)["records"]
    for rep in reps:
        num = rep["numerics"]
        assert num["replay_backend"] == "CPU" and num["server_backend"].startswith("x86-64 baseline")
        assert num["kernels"] and "x86-64 baseline" in num["kernels"]
        assert rep["summary"]["counts"]["mismatch"] == 0
        assert rep["summary"]["counts"]["placeholder"] > 0
    diffs = [rep["numerics"]["weighted_mean_diff_real"] for rep in reps]
    print(f"\nbaseline-kernel server vs native replay: weighted |diff| of real values {diffs}; "
          f"judged numerics: {[rep['numerics']['cause'] for rep in reps]}")
    # the kept values are the server's own: the repaired file carries them unchanged
    for line, t in zip(out.read_text().splitlines(), recs):
        fixed = record_entries(read_text(line, "f")[0])
        sent = record_entries(read_text(json.dumps(t), "s")[0])
        for a, b in zip(fixed, sent):
            if b.top:  # a real entry
                assert (a.logprob, a.top) == (b.logprob, b.top)


LONG = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
        "in his book. ") * 45 + "Retell the story in your own words."  # 1,170 tokens in the chat template


def test_the_drafts_thread_count_is_the_servers_from_its_recorded_flags(b11434, smollm2, smollm2_draft, tmp_path):
    """-td (--spec-draft-threads) is the draft context's thread count (common/speculative.cpp:2553-2556).
    Past 256 positions a one-token decode splits its KV sum by thread (ggml-cpu/ops.cpp:9489), so the
    draft's probabilities, and with --spec-draft-p-min its draft lengths, depend on it. From a server
    started with -t 2 -td 1, trace reads -td from the transcript's flags and drafts what the server drafted
    (44 of 44); on the target's count, 2, it drafts another total (measured 45) and says so. recover, on
    a target whose values do not need the loop, is exact without it."""
    cfg = ServerConfig(smollm2, n_ctx=4096, draft_model=smollm2_draft, spec_types=("draft-simple",), draft_threads=1,
                       draft_p_min=0.9)
    with LlamaServer(cfg, binary=b11434.server) as srv:
        t = record_one(srv.url, RequestItem("/v1/chat/completions", {
            "messages": [{"role": "user", "content": LONG}], "max_tokens": 64, "logprobs": True, "top_logprobs": 2,
            "temperature": 0.0, "seed": 3}), srv.config.flags_block())
    assert t["server"]["flags"]["--spec-draft-threads"] == 1
    src = tmp_path / "td1.json"
    src.write_text(dumps(t))
    r = CliRunner().invoke(main, ["trace", str(src), "-m", str(smollm2), "-md", str(smollm2_draft), "--json"])
    assert r.exit_code == 0, r.output[-1500:]
    rec = json.loads(r.stdout)  # one record: its trace
    assert rec["reproduced"] and (rec["draft_n"], rec["draft_n_accepted"]) == (
        rec["server_draft_n"], rec["server_draft_n_accepted"]), rec["first_divergence"]
    r = CliRunner().invoke(main, ["trace", str(src), "-m", str(smollm2), "-md", str(smollm2_draft), "-td", "2"])
    assert r.exit_code == 1 and "the draft totals differ" in r.output, r.output[-1500:]
    # the same transcript with -td left out of its flags: recover needs no drafts for this target (it can
    # drop a suffix, and flash attention gives a verify row the values of its own decode, schedule/rows.py),
    # so the unknown -td changes nothing: every real entry agrees exactly and no value is approximate
    bare = json.loads(src.read_text())
    del bare["server"]["flags"]["--spec-draft-threads"]
    (tmp_path / "bare.json").write_text(dumps(bare))
    r = CliRunner().invoke(main, ["recover", str(tmp_path / "bare.json"), "-m", str(smollm2), "-md", str(smollm2_draft),
                                  "-o", str(tmp_path / "fixed.json"), "--json"])
    assert r.exit_code == 0, r.output[-1500:]
    out = json.loads(r.stdout)["records"][0]
    assert out["summary"]["max_abs_diff_real"] == 0 and not out.get("notes"), out.get("notes")
