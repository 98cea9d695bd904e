"""MTP heads (`--spec-type draft-mtp`) against real b11434 servers: trace token-exact with the server's
draft totals, recover equal to the patched server's values (loop/draft_mtp.py).

The targets are fixtures/make_tiny_mtp.py's tiny hy_v3 models with one nextn layer (the single-head
drafter) and two (chained heads), F32 and Q8_0, and its tiny qwen35 (hybrid: gated delta-net and
attention layers), whose memory an MTP server gives recurrent-state snapshots (n_rs_seq =
--spec-draft-n-max: settings/config.py rollback_snapshots), which change its ubatch split and its
rollback. Each server answers four /completion requests in turn on one slot, so the MTP context's carry
(pending_h, never reset) runs across requests as the server's does.
"""
from __future__ import annotations

import json

import pytest
from cli_helpers import clean_exit, run

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.paths import FIXTURES
from replay.transcripts.entries import record_entries
from replay.transcripts.format import dumps
from replay.transcripts.readers import read_text

pytestmark = [pytest.mark.build, pytest.mark.live_server]

PROMPTS = ("hello world the", "abcabc", "The quick brown fox", "Once upon a time")


def _items(temp: float) -> list[RequestItem]:
    return [RequestItem("/completion", {"prompt": p, "n_predict": 48, "n_probs": 2, "temperature": temp, "seed": 3,
                                        "ignore_eos": True})
            for p in PROMPTS]


def _record(binary, cfg: ServerConfig, temp: float) -> list[dict]:
    with LlamaServer(cfg, binary=binary) as srv:
        return [record_one(srv.url, it, srv.config.flags_block()) for it in _items(temp)]


def _record_one(binary, cfg: ServerConfig, item: RequestItem) -> dict:
    with LlamaServer(cfg, binary=binary) as srv:
        return record_one(srv.url, item, srv.config.flags_block())


def _assert_patched(out, truth: list[dict]) -> None:
    """Every record recover wrote to `out` has the patched server's tokens and values, bit for bit."""
    for line, want in zip(out.read_text().splitlines(), truth):
        a = record_entries(read_text(line, "repaired")[0])
        b = record_entries(read_text(json.dumps(want), "patched")[0])
        assert [e.id for e in a] == [e.id for e in b]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) == 0.0


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
    "hybrid-qwen35-f32-t0": ("tiny-qwen35-mtp1.gguf", 0.0, {}),
    "hybrid-qwen35-q8_0-t1": ("tiny-qwen35-q8_0-mtp1.gguf", 1.0, {}),
    "moe-glm4moe-q8_0-t0": ("tiny-glm4moe-q8_0-mtp1.gguf", 0.0, {}),
}
QWEN35 = "tiny-qwen35-q8_0-mtp1.gguf"


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
@pytest.mark.parametrize("name", ["tiny-hyv3-q8_0-mtp1.gguf", QWEN35], ids=["hy_v3", "hybrid-qwen35"])
def test_recovered_values_are_the_patched_mtp_servers(name, n_parallel, b11434, patched, server_cpu, tmp_path):
    """recover fills every placeholder of an MTP server's transcript with what the same build, patched
    by `spec-replay patch`, reports: bit for bit."""
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


@pytest.mark.parametrize("name", ["tiny-hyv3-q8_0-mtp1.gguf", QWEN35], ids=["hy_v3", "hybrid-qwen35"])
def test_tune_sweeps_an_mtp_servers_draft_depth_and_times_its_heads(name, b11434, server_cpu, tmp_path):
    """tune on MTP traffic: the transcript's own setting reproduces it (tokens and draft totals), every
    --spec-draft-n-max and -p-min emits the recorded tokens at temperature 0 with the verifier's expected
    acceptance equal to the count, fewer drafts per step draft less, and --measure times the heads on an
    MTP context of this host (tuning/measure.py); on the hybrid target each setting's own snapshots
    (n_rs_seq = its n-max), and its verify batches timed from a checkpoint where they outgrow them."""
    from replay.run.tune import tune
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
    assert "speed model: measured on this host" in r.output and "ranked by predicted tok/s" in r.output
    # the hybrid target's longer verify batches are an estimate, and the report says how it was made
    assert ("timed from a checkpoint, its restore's median taken off" in r.output) == (name == QWEN35), r.output


def _prompt_of(url: str, n: int) -> str:
    """A prompt of exactly `n` tokens on the server's own tokenizer."""
    import urllib.request

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())
    ids = post("/tokenize", {"content": "the quick brown fox jumps over a lazy dog and then " * 40})["tokens"]
    text = post("/detokenize", {"tokens": ids[:n]})["content"]
    assert len(post("/tokenize", {"content": text})["tokens"]) == n
    return text


@pytest.mark.parametrize("n_prompt", [133, 134])
def test_a_hybrid_targets_snapshots_are_the_servers(n_prompt, b11434, patched, server_cpu, tmp_path, monkeypatch):
    """qwen35 on `-np 1 -ub 64`, a prompt of 133 and of 134 tokens, temperature 1: the MTP server makes its
    target context with n_rs_seq = --spec-draft-n-max (3), which keeps the last 4 tokens of a batch in one
    ubatch (the prompt's first 65-token cut goes 61 + 4 on 133 tokens) and lets the target drop up to 3
    rejected drafts without a checkpoint. recover equals the patched server bit for bit; with the snapshots
    left out (the target then a memory that cannot drop a suffix, checkpointed and split as without MTP)
    its values part from the server's, which is what this test would catch."""
    import replay.schedule.memory as memory
    cfg = ServerConfig(FIXTURES / QWEN35, n_ctx=256, n_parallel=1, n_ubatch=64, spec_types=("draft-mtp",))
    item = None
    out = {}
    for binary, tag in ((b11434.server, "plain"), (patched.server, "patched")):
        with LlamaServer(cfg, binary=binary) as srv:
            if item is None:
                item = RequestItem("/completion", {"prompt": _prompt_of(srv.url, n_prompt), "n_predict": 40,
                                                   "n_probs": 2, "temperature": 1.0, "seed": 3})
            out[tag] = record_one(srv.url, item, srv.config.flags_block())
    assert out["plain"]["response"]["timings"]["prompt_n"] == n_prompt
    src = _write([out["plain"]], tmp_path / "q35.jsonl")
    truth = record_entries(read_text(json.dumps(out["patched"]), "patched")[0])

    def worst(path) -> float:
        got = record_entries(read_text(path.read_text(), "repaired")[0])
        assert [e.id for e in got] == [e.id for e in truth]
        return max(abs(x.logprob - y.logprob) for x, y in zip(got, truth))
    r = run("recover", src, "-m", FIXTURES / QWEN35, "-o", tmp_path / "fixed.jsonl", "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    assert worst(tmp_path / "fixed.jsonl") == 0.0
    monkeypatch.setattr(memory, "rollback_snapshots", lambda spec: 0)
    r = run("recover", src, "-m", FIXTURES / QWEN35, "-o", tmp_path / "without.jsonl", "--json", *server_cpu)
    without = worst(tmp_path / "without.jsonl")
    print(f"\n{n_prompt} tokens: recover equal to the patched server; without the snapshots {without:.3g} nats off")
    assert without > 5e-4, without


def test_the_first_entry_of_a_target_that_runs_its_last_layer_on_every_row_for_mtp(b11434, monkeypatch):
    """glm4moe with MTP on keeps every row's hidden state for the heads (llama_set_embeddings_nextn
    unmasked, common/speculative.cpp:1478), and then runs its last trunk layer on every row of a batch
    instead of the output rows (glm4-moe.cpp:368): the prompt's last logits are computed in other shapes.
    The first entries (the prompt batch's, one-token schedule: what the kernel probe evaluates) equal the
    server's bit for bit with the target context made so (schedule/memory.py SlotConfig.nextn), and part
    from them without it (2.4e-7 on these F32 widths; more on real ones)."""
    import dataclasses

    import replay.schedule.memory as memory
    from replay.commands.recover import Recoverer, RecoverOptions
    name = "tiny-glm4moe-mtp1.gguf"
    cfg = ServerConfig(FIXTURES / name, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",))
    records = [read_text(json.dumps(t), "mtp")[0] for t in _record(b11434.server, cfg, 0.0)]

    def first_entries() -> list[float]:
        r = Recoverer(FIXTURES / name, {}, RecoverOptions(only_entries=1))
        try:
            return [max(abs(a - b) for a, b in r.recover(rec).report.tokens[0].real_pairs) for rec in records]
        finally:
            r.close()
    assert first_entries() == [0.0] * len(records)
    opened = memory.SlotConfig.open
    monkeypatch.setattr(memory.SlotConfig, "open", lambda self, *a, **k: opened(dataclasses.replace(self, nextn=False),
                                                                                 *a, **k))
    without = first_entries()
    print(f"\nfirst entries without the hidden states kept: {without}")
    assert max(without) > 0.0, without


@pytest.mark.parametrize("name", ["tiny-hyv3-q8_0-mtp1.gguf", QWEN35], ids=["hy_v3", "hybrid-qwen35"])
def test_a_session_on_the_prompt_cache(name, b11434, patched, server_cpu, tmp_path):
    """Three requests, each prompt the last one's prompt, its reply and a new turn, sent with
    cache_prompt: the server takes the earlier turns from its cache (the MTP context's KV kept with
    them, the heads' carry across requests). trace reproduces every token and the draft totals, and
    recover equals the patched server bit for bit; on the hybrid target (which checkpoints) that needs
    the loop from the first record on, since each next record starts from the state its verify steps
    left (commands/recover.py approximate_from `continued`)."""
    cfg = ServerConfig(FIXTURES / name, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",))

    def session(binary) -> list[dict]:
        out, prompt = [], "hello world the"
        with LlamaServer(cfg, binary=binary) as srv:
            for turn in (" abc", " The quick brown fox", " Once upon"):
                t = record_one(srv.url, RequestItem("/completion", {
                    "prompt": prompt, "n_predict": 32, "n_probs": 2, "temperature": 1.0, "seed": 5,
                    "cache_prompt": True, "ignore_eos": True}), srv.config.flags_block())
                out.append(t)
                prompt += t["response"]["content"] + turn
        return out
    plain, truth = session(b11434.server), session(patched.server)
    assert [t["response"]["timings"]["cache_n"] > 0 for t in plain] == [False, True, True]
    src = _write(plain, tmp_path / "session.jsonl")
    r = run("trace", src, "-m", FIXTURES / name, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    for t in json.loads(r.stdout)["records"]:
        assert t["reproduced"] and (t["draft_n"], t["draft_n_accepted"]) == (t["server_draft_n"],
                                                                            t["server_draft_n_accepted"]), t
    out = tmp_path / "session.fixed.jsonl"
    r = run("recover", src, "-m", FIXTURES / name, "-o", out, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    _assert_patched(out, truth)


SHAPES = {  # id: (server flags, request)
    "chat": ({}, RequestItem("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello world the quick brown fox"}], "max_tokens": 40,
        "logprobs": True, "top_logprobs": 2, "temperature": 1.0, "seed": 4})),
    "draft-n-max-16": ({"draft_n_max": 16}, RequestItem("/completion", {
        "prompt": "the quick brown fox jumps over a lazy dog and then ", "n_predict": 40, "n_probs": 2,
        "temperature": 1.0, "seed": 4, "ignore_eos": True})),
    "1000-token-prompt": ({"n_ctx": 1400}, RequestItem("/completion", {
        "prompt": "the quick brown fox jumps over a lazy dog and then " * 23, "n_predict": 40, "n_probs": 2,
        "temperature": 1.0, "seed": 4, "ignore_eos": True})),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_chat_deep_drafts_and_a_long_prompt_on_a_hybrid_mtp_target(shape, b11434, patched, server_cpu, tmp_path):
    """qwen35 (snapshots = --spec-draft-n-max): a chat completion, 16 drafts a step (16 snapshots), and a
    prompt past 1,000 tokens (past 256 positions, where a one-token decode's thread split starts): trace
    reproduces the tokens and draft totals, recover equals the patched server bit for bit."""
    flags, item = SHAPES[shape]
    cfg = ServerConfig(FIXTURES / QWEN35, **{"n_ctx": 256, "n_parallel": 1, "spec_types": ("draft-mtp",), **flags})
    plain, truth = _record_one(b11434.server, cfg, item), _record_one(patched.server, cfg, item)
    if shape == "1000-token-prompt":
        assert plain["response"]["timings"]["prompt_n"] > 1000
    src = _write([plain], tmp_path / "one.jsonl")
    r = run("trace", src, "-m", FIXTURES / QWEN35, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    t = json.loads(r.stdout)  # one record: the trace itself
    assert t["reproduced"] and (t["draft_n"], t["draft_n_accepted"]) == (t["server_draft_n"],
                                                                        t["server_draft_n_accepted"]), t
    out = tmp_path / "one.fixed.jsonl"
    r = run("recover", src, "-m", FIXTURES / QWEN35, "-o", out, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    a = record_entries(read_text(out.read_text(), "repaired")[0])
    b = record_entries(read_text(json.dumps(truth), "patched")[0])
    assert [e.id for e in a] == [e.id for e in b] and max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) == 0.0


def test_a_hybrid_mtp_target_quantized_by_llama_quantize(b11434, patched, server_cpu, tmp_path):
    """The qwen35 fixture quantized to Q4_0 by the build's own llama-quantize (the nextn layer with it):
    trace reproduces the four requests' tokens and draft totals, recover equals the patched server."""
    import subprocess
    q4 = tmp_path / "tiny-qwen35-q4_0-mtp1.gguf"
    r = subprocess.run([str(b11434.quantize), str(FIXTURES / "tiny-qwen35-mtp1.gguf"), str(q4), "Q4_0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and q4.is_file(), r.stderr[-1500:]
    cfg = ServerConfig(q4, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",))
    plain, truth = _record(b11434.server, cfg, 1.0), _record(patched.server, cfg, 1.0)
    src = _write(plain, tmp_path / "q4.jsonl")
    r = run("trace", src, "-m", q4, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    assert all(t["reproduced"] and t["draft_n"] == t["server_draft_n"] for t in json.loads(r.stdout)["records"])
    out = tmp_path / "q4.fixed.jsonl"
    r = run("recover", src, "-m", q4, "-o", out, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    _assert_patched(out, truth)


def _at_once(binary, cfg: ServerConfig, items: list[RequestItem]) -> list[dict]:
    """The requests sent together, each on its own connection, as an eval harness sends them."""
    import threading
    out: list[dict | None] = [None] * len(items)
    with LlamaServer(cfg, binary=binary) as srv:
        flags = srv.config.flags_block()
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, record_one(srv.url, items[i], flags)))
                   for i in range(len(items))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(out)
    return out


def test_four_requests_at_once_on_a_default_slot_mtp_server(b11434, patched, server_cpu, tmp_path):
    """Four requests at once on a default-flag MTP server (4 slots), each to the end of its slot's context: the
    server verifies them in shared batches, and its MTP context catches up on every slot's rows in one batch, each
    sequence paired with its own carry (common/speculative.cpp:1539-1646). A /completion response carries no
    time, so only its user can say the requests ran together (--shared-batches), unless a request's /slots
    snapshot caught another slot busy: each record is then repaired on the one-token schedule, said
    approximate for that reason (judged by the option or that evidence, never exact), its
    values within the batch bound of what the patched server reported under the same load wherever the
    two runs emitted the same tokens; trace reproduces each record or explains its parting by numerics."""
    from replay.comparison.bounds import BATCH_BOUND
    n = 230  # the fixture's 256 positions a slot, less the prompt
    cfg = ServerConfig(FIXTURES / "tiny-hyv3-q8_0-mtp1.gguf", n_ctx=4 * 256, n_parallel=-1,
                       spec_types=("draft-mtp",))
    items = [RequestItem("/completion", {"prompt": p, "n_predict": n, "n_probs": 2, "temperature": 1.0, "seed": 3,
                                         "ignore_eos": True}) for p in PROMPTS]
    plain, truth = _at_once(b11434.server, cfg, items), _at_once(patched.server, cfg, items)
    assert sorted(r["response"]["id_slot"] for r in plain) == [0, 1, 2, 3]
    src, out = _write(plain, tmp_path / "at-once.jsonl"), tmp_path / "at-once.fixed.jsonl"
    r = run("recover", src, "-m", cfg.model, "-o", out, "--json", "--shared-batches", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    reps = json.loads(r.stdout)["records"]
    compared, worst = 0, 0.0
    for rep, line, want in zip(reps, out.read_text().splitlines(), truth):
        # a request sent while another's was running carries that in its /slots snapshot: the file then shows
        # it (judged by the evidence); the first one sent has only the user's word (the option)
        assert (rep["numerics"]["why"], rep["numerics"]["judged_by"]) in {
            ("batches shared with other requests (--shared-batches)", "option"),
            ("batches shared with other requests (another slot was busy when it was sent (/slots))", "evidence")}, \
            rep["numerics"]
        assert any("approximate" in note for note in rep["notes"]), rep["notes"]
        assert rep["summary"]["counts"]["mismatch"] == 0 and rep["summary"]["counts"]["placeholder"] > n // 2, rep
        a = record_entries(read_text(line, "repaired")[0])
        b = record_entries(read_text(json.dumps(want), "patched")[0])
        for x, y in zip(a, b):
            if x.id != y.id:
                break
            compared += 1
            worst = max(worst, abs(x.logprob - y.logprob))
    print(f"\nat once: {compared} values compared with the patched server's under the same load, "
          f"max |diff| {worst:.3g}")
    assert compared >= 40 and worst <= BATCH_BOUND, (compared, worst)
    # nothing in a /completion file shows the requests ran at once: the user says so, as for recover
    r = run("trace", src, "-m", cfg.model, "--json", "--shared-batches", *server_cpu)
    assert clean_exit(r), r.output[-2000:]
    traced = json.loads(r.stdout)["records"]
    for t in traced:
        assert t["reproduced"] is True or (t["divergence"] and t["divergence"]["cause"] == "numerics"), \
            (t["first_divergence"], t["divergence"], t["notes"])
    assert (r.exit_code == 0) == all(t["reproduced"] for t in traced), r.exit_code
    print(f"trace: {sum(t['reproduced'] for t in traced)} of 4 records reproduced, the rest parted by numerics")


def test_the_heads_carry_runs_from_one_request_into_the_next(b11434, server_cpu, tmp_path, monkeypatch):
    """The MTP context pairs the first token of each batch with `pending_h`, the target's last hidden row of
    the batch before, and the server never resets it (common/speculative.cpp:1494, 1583-1590): a request that
    processes its prompt from position 0 pairs that position with the previous request's last row, and every
    later draft of the request attends to it. On the hy_v3 fixture at temperature 0 that moves a draft of the
    second request: trace reproduces every token and the server's draft totals with the carry, and misses
    the second record's totals with it reset when a request begins (this test's own control)."""
    import numpy as np

    import replay.loop.draft_mtp as draft_mtp
    name = "tiny-hyv3-q8_0-mtp1.gguf"
    cfg = ServerConfig(FIXTURES / name, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",))
    src = _write(_record(b11434.server, cfg, 0.0), tmp_path / "mtp.jsonl")

    notes: list[str] = []

    def totals() -> list[tuple[bool, int, int, int, int]]:
        r = run("trace", src, "-m", FIXTURES / name, "--json", *server_cpu)
        assert clean_exit(r), r.output[-2000:]
        records = json.loads(r.stdout)["records"]
        notes[:] = [n for t in records for n in t["notes"] if "the draft totals differ" in n]
        return [(t["reproduced"], t["draft_n"], t["draft_n_accepted"], t["server_draft_n"],
                 t["server_draft_n_accepted"]) for t in records]
    carried = totals()
    assert all(ok and (n, a) == (sn, sa) for ok, n, a, sn, sa in carried), carried
    begin = draft_mtp.MtpHeads.begin

    def reset(self) -> None:
        begin(self)
        self.pending_h = np.zeros_like(self.pending_h)
    monkeypatch.setattr(draft_mtp.MtpHeads, "begin", reset)
    zeroed = totals()
    print(f"\n(reproduced, drafted, accepted, server drafted, server accepted) per record, the carry reset: {zeroed}")
    assert zeroed[0] == carried[0]  # the first request starts from zeros on the server too
    assert any((n, a) != (sn, sa) for _, n, a, sn, sa in zeroed[1:]), zeroed
    # a one-slot server's record, nothing beside it: the totals are not explained away, and the note says
    # what can move an MTP drafter's choices (its kernels), not an n-gram drafter's state
    assert notes and all("the MTP heads' argmax at a near-tie follows the kernels" in n for n in notes), notes


def test_sampling_defaults_from_the_model_file_and_the_command_line_with_mtp_heads(b11434, patched, server_cpu,
                                                                                     tmp_path):
    """An MTP server started as users start theirs: the model file's general.sampling.* (top-k 12, top-p 0.9,
    repeat penalty 1.05), `--temp 0.9 --min-p 0.1` on the command line, `-t 1`, and requests that give only a
    seed. The target's chain is the request's over the flags' over the file's (common/common.cpp,
    server-schema.cpp); the heads draft greedily from their own top-k 10 chain whatever the request samples.
    trace reproduces every token and the draft totals, recover equals the patched server bit for bit, and
    its report says where each setting came from."""
    from replay.llamacpp.models import with_sampling_defaults
    model = with_sampling_defaults(FIXTURES / "tiny-hyv3-q8_0-mtp1.gguf", tmp_path / "hyv3-sampling.gguf",
                                   {"top_k": 12, "top_p": 0.9, "penalty_repeat": 1.05})
    cfg = ServerConfig(model, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",), threads=1, temp=0.9, min_p=0.1)
    items = [RequestItem("/completion", {"prompt": p, "n_predict": 48, "n_probs": 2, "seed": 7, "ignore_eos": True})
             for p in PROMPTS]

    def recorded(binary) -> list[dict]:
        with LlamaServer(cfg, binary=binary) as srv:
            return [record_one(srv.url, it, srv.config.flags_block()) for it in items]
    plain, truth = recorded(b11434.server), recorded(patched.server)
    assert all(r["response"]["timings"]["draft_n"] > 0 for r in plain)
    src, out = _write(plain, tmp_path / "defaults.jsonl"), tmp_path / "defaults.fixed.jsonl"
    r = run("trace", src, "-m", model, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    for t in json.loads(r.stdout)["records"]:
        assert t["reproduced"] and (t["draft_n"], t["draft_n_accepted"]) == (t["server_draft_n"],
                                                                            t["server_draft_n_accepted"]), t
    r = run("recover", src, "-m", model, "-o", out, "--json", *server_cpu)
    assert r.exit_code == 0, r.output[-2000:]
    sources = {s["setting"]: (s["value"], s["source"]) for s in json.loads(r.stdout)["records"][0]["settings"]}
    assert sources["--top-k"] == (12, "model file") and sources["--top-p"][1] == "model file", sources
    assert sources["--repeat-penalty"][1] == "model file" and sources["--temp"] == (pytest.approx(0.9), "server.flags")
    assert sources["--min-p"] == (pytest.approx(0.1), "server.flags") and sources["--seed"] == (7, "request"), sources
    _assert_patched(out, truth)
