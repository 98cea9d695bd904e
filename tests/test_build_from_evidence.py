"""Transcripts that name no build, from servers on another machine: the build and the CPU kernels are
found from the evidence, never defaulted.

The servers are b11434 release-style builds forced onto `haswell` (a copy of the variants build's bin/
holding only libggml-cpu-haswell.so: what a release server loads on an AVX2 machine such as a Zen 3 EPYC),
on whatever host runs the suite; their requests are kept as an eval harness logs them, `{"endpoint",
"request", "response"}` pairs, so a native /completion record carries no build_info and no
system_fingerprint. The truth is the same build patched by `spec-replay patch`, forced onto the same
variant, sent the same requests.

Specification:
- a transcript that names no build is replayed on a build here chosen by its first real entry (b11434,
  "from evidence"), on the kernels that entry picks (haswell), with the values of the patched server;
- a record with no real entry at all (a stream that asked for no probabilities) is told by what the
  server's loop did: a class whose loop replay parts from its tokens or draft totals is out, and the one
  left computed it (exact); where several are left, the values are approximate, and the bound, the spread
  of the kernel classes left open, holds the true error;
- the server's CPU given as its model name picks haswell, and its values are exact;
- a wrong model file is refused whatever --shared-batches or --server-backend say.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.paths import FIXTURES
from replay.transcripts.entries import record_entries
from replay.transcripts.readers import read_text

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]
VARIANT = "haswell"
STORY = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
         "in his book. ") * 12


def cli(*args, timeout: float = 900) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "replay.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p


def _items() -> list[RequestItem]:
    return [RequestItem("/completion", {"prompt": STORY + "Retell it.", "n_predict": 32, "n_probs": 3,
                                        "temperature": 1.0, "seed": 2}),
            RequestItem("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours of the sea."}],
                                                 "max_tokens": 32, "logprobs": True, "top_logprobs": 3,
                                                 "temperature": 0.8, "seed": 5})]


def _as_harness_logs(records: list[dict], path: Path) -> Path:
    """The requests and responses alone, as a harness logs them: no /props, no flags, no build."""
    path.write_text("".join(json.dumps({"endpoint": r["endpoint"], "request": r["request"], "response": r["response"]})
                            + "\n" for r in records))
    return path


def _class(cpu: dict) -> set[str]:
    """The variants the report says computed alike on the evidence: the one used and those named equal to it
    (on a host with AVX-VNNI, alderlake's kernels compute SmolLM2's and Gemma 3's values as haswell's do)."""
    return {cpu["variant"], *cpu.get("equal", ())}


def _record(binary: Path, cfg: ServerConfig, items: list[RequestItem]) -> list[dict]:
    with LlamaServer(cfg, binary=binary) as srv:
        return [record_one(srv.url, it, srv.config.flags_block()) for it in items]


def _values(text: str) -> list[list[tuple[int, float]]]:
    return [[(e.id, e.logprob) for e in record_entries(read_text(line, "x")[0])] for line in text.splitlines()]


@pytest.fixture(scope="module")
def smollm2_haswell(b11434, patched, smollm2, smollm2_draft, tmp_path_factory):
    cfg = ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",))
    plain = _record(b11434.with_cpu(VARIANT).server, cfg, _items())
    truth = _record(patched.with_cpu(VARIANT).server, cfg, _items())
    return _as_harness_logs(plain, tmp_path_factory.mktemp("evidence") / "smollm2.jsonl"), truth


def test_a_transcript_naming_no_build_is_replayed_on_the_build_and_kernels_its_first_entry_picks(
        smollm2_haswell, smollm2, tmp_path):
    src, truth = smollm2_haswell
    out = tmp_path / "fixed.jsonl"
    p = cli("recover", src, "-m", smollm2, "-o", out, "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    for r in rep["records"]:
        assert VARIANT in _class(r["numerics"]["cpu"]), r["numerics"]["cpu"]
        assert r["loop_shape"]["why"].startswith(
            f"b11434, from evidence: record 1's first entry exact under {r['numerics']['cpu']['variant']}"), \
            r["loop_shape"]
        assert r["numerics"]["approximate"] is False
    got, want = _values(out.read_text()), [[(e.id, e.logprob) for e in record_entries(
        read_text(json.dumps(t), "truth")[0])] for t in truth]
    assert got == want


def test_the_server_machines_cpu_given_by_its_model_name_picks_its_variant(smollm2_haswell, smollm2, tmp_path):
    src, truth = smollm2_haswell
    out = tmp_path / "fixed.jsonl"
    p = cli("recover", src, "-m", smollm2, "-o", out, "--server-cpu", "AMD EPYC 7763 64-Core Processor")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "a release server there loads haswell" in p.stderr
    assert _values(out.read_text()) == [[(e.id, e.logprob) for e in record_entries(
        read_text(json.dumps(t), "truth")[0])] for t in truth]


def test_a_gemma3_chat_on_another_machine_is_exact_through_its_loop(b11434, patched, gemma3, gemma3_draft, tmp_path):
    """Gemma 3 checkpoints (its sliding-window memory cannot drop a suffix): the verify batches rewrite the
    KV of accepted tokens, and below 256 positions too their repacked Q4_K matmuls are not one-row decodes'
    (0.24 nats by token 31 when computed one row at a time); recover replays the loop, and is exact. A
    greedy request that sends no seed, as eval harnesses send them, too: at temperature 0 no draw moves a token."""
    items = _items()[1:] + [RequestItem("/completion", {"prompt": STORY + "Why?", "n_predict": 32, "n_probs": 3,
                                                        "temperature": 0.0})]
    cfg = ServerConfig(gemma3, draft_model=gemma3_draft, spec_types=("draft-simple",))
    plain = _record(b11434.with_cpu(VARIANT).server, cfg, items)
    truth = _record(patched.with_cpu(VARIANT).server, cfg, items)
    src = _as_harness_logs(plain, tmp_path / "gemma3.jsonl")
    out = tmp_path / "fixed.jsonl"
    p = cli("recover", src, "-m", gemma3, "-md", gemma3_draft, "--spec-type", "draft-simple", "-o", out, "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    for r in json.loads(p.stdout)["records"]:
        assert VARIANT in _class(r["numerics"]["cpu"]) and r["schedule"]["loop"]["replayed"], r["schedule"]
        assert r["numerics"]["approximate"] is False
    assert _values(out.read_text()) == [[(e.id, e.logprob) for e in record_entries(
        read_text(json.dumps(t), "truth")[0])] for t in truth]


def test_a_hybrid_mtp_target_quantized_to_q4_0_on_another_machine(b11434, patched, tmp_path):
    q4 = tmp_path / "tiny-qwen35-q4_0-mtp1.gguf"
    r = subprocess.run([str(b11434.quantize), str(FIXTURES / "tiny-qwen35-mtp1.gguf"), str(q4), "Q4_0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-1500:]
    words = " ".join(f"w{i % 97} x{i % 13}" for i in range(160))
    items = [RequestItem("/completion", {"prompt": words + p, "n_predict": 48, "n_probs": 2, "temperature": t,
                                         "seed": 3, "ignore_eos": True}) for p, t in ((" hello", 0.0), (" abc", 1.0))]
    cfg = ServerConfig(q4, n_ctx=2048, n_parallel=1, n_ubatch=64, spec_types=("draft-mtp",))
    plain = _record(b11434.with_cpu(VARIANT).server, cfg, items)
    truth = _record(patched.with_cpu(VARIANT).server, cfg, items)
    src = _as_harness_logs(plain, tmp_path / "q4.jsonl")
    out = tmp_path / "fixed.jsonl"
    p = cli("recover", src, "-m", q4, "--spec-type", "draft-mtp", "-np", "1", "-ub", "64", "-o", out)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "b11434, from evidence" in p.stderr
    assert _values(out.read_text()) == [[(e.id, e.logprob) for e in record_entries(
        read_text(json.dumps(t), "truth")[0])] for t in truth]


def _stream_recovered(b11434, patched, smollm2, smollm2_draft, tmp_path, *, n_predict: int):
    """A greedy SmolLM2 stream that asked for no probabilities, from a server on VARIANT, recovered from the
    file alone: (its record's report, the values recover wrote, the patched server's for the same request
    with n_probs 1)."""
    body = {"prompt": STORY + "The keeper", "n_predict": n_predict, "temperature": 0.0}
    cfg = ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",))
    plain = _record(b11434.with_cpu(VARIANT).server, cfg, [RequestItem("/completion", {**body, "stream": True})])
    truth = _record(patched.with_cpu(VARIANT).server, cfg, [RequestItem("/completion", {**body, "n_probs": 1})])
    src = tmp_path / "stream.jsonl"
    src.write_text(json.dumps(plain[0]) + "\n")
    out = tmp_path / "fixed.jsonl"
    p = cli("recover", src, "-m", smollm2, "-o", out, "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    got = _values(out.read_text())[0]
    want = [(e.id, e.logprob) for e in record_entries(read_text(json.dumps(truth[0]), "truth")[0])]
    return json.loads(p.stdout)["records"][0], got, want


def test_a_record_with_no_real_entry_is_approximate_within_a_bound_that_holds(b11434, patched, smollm2,
                                                                               smollm2_draft, tmp_path):
    """A stream that asked for no probabilities: nothing tells the kernels. Every class computes the record
    for the bound; the true values (the patched server's, the same request not streamed, with n_probs 1)
    are within it of what recover wrote."""
    r, got, want = _stream_recovered(b11434, patched, smollm2, smollm2_draft, tmp_path, n_predict=32)
    n = r["numerics"]
    assert n["approximate"] is True and n["bound"] is not None and n["cpu"]["how"] == "default", n
    assert [i for i, _ in got] == [i for i, _ in want]
    off = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    print(f"no real entry: bound {n['bound']:.4g} nats, true error {off:.4g}")
    assert off <= n["bound"]


def test_a_record_with_no_real_entry_is_told_by_its_tokens_and_draft_totals(b11434, patched, smollm2,
                                                                           smollm2_draft, tmp_path):
    """A greedy stream that asked for no probabilities, long enough for the kernels to show in what the loop
    does: under every class but the server's, the replay of its loop drafts or accepts otherwise than the
    server's timings say (measured: zen4 accepts 117 of 123 drafts where the server accepted 118). That class
    alone is left: the values are exact, computed in the server's verify batches (past 256 positions a
    one-token decode computes them apart), and equal the patched server's; the report names the evidence."""
    r, got, want = _stream_recovered(b11434, patched, smollm2, smollm2_draft, tmp_path, n_predict=160)
    n = r["numerics"]
    assert n["approximate"] is False and n["bound"] is None, n
    assert VARIANT in _class(n["cpu"]) and n["cpu"]["how"] == "loop", n["cpu"]
    assert "zen4 record 1: its loop replay" in n["cpu"]["description"], n["cpu"]["description"]
    assert r["schedule"]["loop"]["replayed"] and r["schedule"]["loop"]["totals_checked"], r["schedule"]
    assert [i for i, _ in got] == [i for i, _ in want] and len(got) > 100
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) <= 1e-6


@pytest.mark.parametrize("options", [("--shared-batches",), ("--server-backend", "CUDA0")],
                         ids=["shared-batches", "server-backend"])
def test_no_option_turns_a_wrong_model_into_a_recovery(options, b11434, tmp_path):
    p = cli("recover", FIXTURES / "transcripts" / "tiny-draft-simple.json", "-m", FIXTURES / "tiny-draft.gguf",
            "--renamed-model", *options, "-o", tmp_path / "out.json")
    assert p.returncode == 3, p.stderr[-1500:]
    assert "the model file or the build is not the server's" in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out.json").exists()
