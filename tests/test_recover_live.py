"""`recover` against the real b11434 server: placeholders in, the unspeculated server's values out.

For each endpoint, stream and non-stream, temperature 0 and 1, pre- and
post-sampling: the same request (same seed) goes to SmolLM2 speculating with
itself as draft (every token after the first is a placeholder, or absent in a
stream) and to SmolLM2 without speculation (real values everywhere). The
repaired speculative transcript must carry the plain server's values within
5e-4 nats, with identical top-N ids. The measured maximum is printed and is
what README states.
"""
from __future__ import annotations

import json
import math

import pytest
from cli_helpers import run
from tiers import default_and_wide

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.run.recover import recover
from replay.transcripts.entries import sent_entries
from replay.transcripts.format import dumps, final_response, stream_objects

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]
TOL = 5e-4

CHAT_MSGS = [{"role": "user", "content": "Write two sentences about the sea."}]


def _body(endpoint: str, temp: float, n_top: int, post: bool, stream: bool) -> dict:
    common = {"temperature": temp, "seed": 7, "stream": stream}
    if post:
        common["post_sampling_probs"] = True
    if endpoint == "/v1/chat/completions":
        return {"messages": CHAT_MSGS, "logprobs": True, "top_logprobs": n_top, "max_tokens": 32, **common}
    if endpoint == "/v1/completions":
        return {"prompt": "The sea is", "logprobs": n_top, "max_tokens": 32, **common}
    return {"prompt": "The sea is", "n_probs": n_top, "n_predict": 32, **common}


CASES = [
    (ep, stream, temp, n_top, post)
    for ep in ("/v1/chat/completions", "/v1/completions", "/completion")
    for stream in (False, True)
    for temp, n_top, post in ((0.0, 3, False), (1.0, 5, False), (1.0, 3, True))
]


def _probs(t: dict):
    if t["stream"]:
        return sent_entries(t["endpoint"], events=stream_objects(t))
    return sent_entries(t["endpoint"], t["response"])


@pytest.mark.parametrize("endpoint,stream,temp,n_top,post", default_and_wide(
    CASES, {"v1-chat-completions-json-t0-top3", "v1-chat-completions-stream-t1-top3-post", "v1-completions-stream-t1-top5",
            "v1-completions-json-t1-top3-post", "completion-json-t1-top5", "completion-stream-t1-top3-post"},
    ids=[f"{e.strip('/').replace('/', '-')}-{'stream' if s else 'json'}-t{t:g}-top{n}{'-post' if p else ''}"
         for e, s, t, n, p in CASES]))
def test_recovered_values_equal_the_unspeculated_server(self_draft_server, plain_server, smollm2, tmp_path,
                                                        endpoint, stream, temp, n_top, post):
    body = _body(endpoint, temp, n_top, post, stream)
    spec = record_one(self_draft_server.url, RequestItem(endpoint, body), self_draft_server.config.flags_block())
    plain = record_one(plain_server.url, RequestItem(endpoint, body), plain_server.config.flags_block())
    path = tmp_path / "spec.json"
    path.write_text(dumps(spec))

    res = recover(path, smollm2)
    rep = res.records[0]
    counts = rep.summary()["counts"]
    assert counts["mismatch"] == counts["unaligned"] == 0, rep.to_json()
    assert counts["placeholder"] + counts["missing"] >= len(rep.tokens) - 2  # only tokens outside the loop are real
    assert counts["placeholder"] + counts["missing"] > 0

    repaired = json.loads(res.repaired)
    fixed, truth = _probs(repaired), _probs(plain)
    # every token the plain server reported must be in the repaired file with its values
    fixed_ids = [p.id for p in fixed]
    # in order; the repaired file may hold more (tokens the server held back inside a UTF-8 character)
    rest = iter(fixed_ids)
    assert all(any(f == p.id for f in rest) for p in truth), ([p.id for p in truth], fixed_ids)
    j = 0
    worst = 0.0
    for t in truth:
        while fixed[j].id != t.id:
            j += 1
        f = fixed[j]
        assert f.kind == t.kind == ("prob" if post else "logprob")
        assert [x[0] for x in f.top] == [x[0] for x in t.top], (j, f.top, t.top)
        for a, b in [(f.logprob, t.logprob)] + [(x[2], y[2]) for x, y in zip(f.top, t.top)]:
            if math.isfinite(a) or math.isfinite(b):
                worst = max(worst, abs(a - b))
        j += 1
    assert worst <= TOL, f"recover vs unspeculated server: max |logprob diff| {worst:.2e}"


REPEAT = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, wrote the weather in "
          "his book, and watched the ships pass slowly along the dark coast until morning came. ")


def test_ngram_mod_transcript_recovers(ngram_mod_server, start_server, patched, smollm2, tmp_path):
    """ngram-mod drafts 48-64 tokens, so its verify batches reach 64 rows, whose attention ggml computes tile
    by tile: the truth is the patched server's (the values its loop computed), not an unspeculated
    server's, which computes every token alone (their near-tied alternatives can swap)."""
    body = {"prompt": REPEAT * 4, "n_predict": 96, "n_probs": 3, "temperature": 0, "seed": 1}
    spec = record_one(ngram_mod_server.url, RequestItem("/completion", body), ngram_mod_server.config.flags_block())
    truth_server = start_server(ngram_mod_server.config, binary=patched.server)
    plain = record_one(truth_server.url, RequestItem("/completion", body), truth_server.config.flags_block())
    assert spec["response"]["timings"]["draft_n_accepted"] > 0, "ngram-mod never drafted: the test proves nothing"
    path = tmp_path / "ngram.json"
    path.write_text(dumps(spec))
    res = recover(path, smollm2)
    counts = res.records[0].summary()["counts"]
    assert counts["placeholder"] >= spec["response"]["timings"]["draft_n_accepted"]
    assert counts["mismatch"] == 0 and counts["ok"] >= 1
    fixed = sent_entries("/completion", json.loads(res.repaired)["response"])
    truth = sent_entries("/completion", plain["response"])
    assert [p.id for p in fixed] == [p.id for p in truth]
    for f, t in zip(fixed, truth):
        assert abs(f.logprob - t.logprob) <= TOL
        assert [x[0] for x in f.top] == [x[0] for x in t.top]


STORY = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
         "in his book. ") * 16


def test_a_file_of_ngram_mod_chat_streams_recovers_over_the_table_the_server_kept(ngram_mod_server, start_server,
                                                                                  patched, smollm2, tmp_path):
    """ngram-mod's table is the server's, kept across requests: `recover FILE -o OUT` replays the server's loop
    over the file's records in order, as one unit of work (transcripts/chains.py keeps_state), or the second
    record drafts from a fresh table. A chat stream's speculative chunks carry text and no ids: the loop's
    tokens are matched to each chunk's text (comparison/trace.py items_of_emitted). Truth: the patched server
    sent the same requests in the same order."""
    def chat(n: int, temp: float, stream: bool) -> dict:
        return {"messages": [{"role": "user", "content": STORY[:n] + " Repeat the story exactly."}],
                "max_tokens": 64, "logprobs": True, "top_logprobs": 3, "temperature": temp, "seed": 1,
                "stream": stream}
    shapes = [(600, 0.0), (1700, 0.0), (1700, 1.0)]
    block = ngram_mod_server.config.flags_block()
    spec = [record_one(ngram_mod_server.url, RequestItem("/v1/chat/completions", chat(n, t, True)), block)
            for n, t in shapes]
    truth_server = start_server(ngram_mod_server.config, binary=patched.server)
    truth = [record_one(truth_server.url, RequestItem("/v1/chat/completions", chat(n, t, False)), block)
             for n, t in shapes]
    assert all((final_response(r) or {})["timings"]["draft_n_accepted"] > 0 for r in spec[:2]), "no drafts"
    src, out = tmp_path / "chats.jsonl", tmp_path / "fixed.jsonl"
    src.write_text("".join(dumps(r, indent=None) + "\n" for r in spec))
    r = run("recover", str(src), "-m", str(smollm2), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "approximate" not in r.stderr, r.stderr
    for fixed, want in zip((json.loads(line) for line in out.read_text().splitlines()), truth):
        got, real = _probs(fixed), _probs(want)
        assert [p.id for p in got] == [p.id for p in real]
        for f, t in zip(got, real):
            assert abs(f.logprob - t.logprob) <= TOL
            assert [x[0] for x in f.top] == [x[0] for x in t.top]
            assert all(abs(x[2] - y[2]) <= TOL for x, y in zip(f.top, t.top))


def test_real_values_come_out_ok_and_unchanged(plain_server, smollm2, tmp_path):
    body = _body("/v1/chat/completions", 1.0, 3, False, False)
    plain = record_one(plain_server.url, RequestItem("/v1/chat/completions", body), plain_server.config.flags_block())
    path = tmp_path / "plain.json"
    path.write_text(dumps(plain))
    res = recover(path, smollm2)
    assert {t.status for t in res.records[0].tokens} == {"ok"}
    assert json.loads(res.repaired) == plain


def test_a_long_transcript_recovers_in_flat_memory(b11434, smollm2, tmp_path):
    """Peak RSS of recovering 500 tokens stays within 1.2x of recovering 100 (an N x vocab float32 array
    would add 94 MB for 500 tokens of SmolLM2's 49,152-token vocabulary, more than 0.2x of the 254 MiB
    a recover of 100 tokens peaked at, measured 2026-12-04; 500 tokens peaked at 255 MiB)."""
    import subprocess
    import sys
    paths = {}
    with LlamaServer(ServerConfig(smollm2, n_ctx=4096), binary=b11434.server) as srv:
        for n in (100, 500):
            body = {"prompt": "Once upon a time", "n_predict": n, "n_probs": 1, "temperature": 1, "seed": 5,
                    "ignore_eos": True}
            t = record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())
            assert len(t["response"]["completion_probabilities"]) == n
            paths[n] = tmp_path / f"t{n}.json"
            paths[n].write_text(dumps(t))
    probe = ("import resource, sys; from replay.run.recover import recover; "
             "r = recover(sys.argv[1], sys.argv[2], flags={'n_ctx': 4096}); "
             "assert r.records[0].summary()['counts']['ok'] == int(sys.argv[3]); "
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    rss = {n: int(subprocess.run([sys.executable, "-c", probe, str(p), str(smollm2), str(n)], check=True,
                                 capture_output=True, text=True).stdout.split()[-1]) for n, p in paths.items()}
    print(f"\npeak RSS: 100 tokens {rss[100] / 1024:.0f} MiB, 500 tokens {rss[500] / 1024:.0f} MiB")
    assert rss[500] <= 1.2 * rss[100]


def _fixture_names() -> list[str]:
    from replay.paths import FIXTURES
    return sorted(p.name for p in (FIXTURES / "transcripts").glob("*.json"))


@pytest.mark.parametrize("name", _fixture_names())
def test_committed_fixture_transcripts_recover_to_the_unspeculated_values(b11434, tmp_path, name):
    """The README's first command: every committed transcript, checked against a live plain server
    started as the fixture's was (its chat template), same request. With probabilistic drafting the
    rejection verifier draws differently from the plain server, so the two agree on a prefix only."""
    import importlib.util

    from replay.llamacpp.models import tiny_target
    from replay.paths import FIXTURES
    spec_ = importlib.util.spec_from_file_location("record_transcripts", FIXTURES / "record_transcripts.py")
    rt = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(rt)
    src = FIXTURES / "transcripts" / name
    t = json.loads(src.read_text())
    res = recover(src, tiny_target())
    c = res.records[0].summary()["counts"]
    assert c["mismatch"] == c["unaligned"] == 0 and c["placeholder"] + c["missing"] > 0 and c["ok"] >= 1
    template = tmp_path / "chat.jinja"
    template.write_text(rt.CHAT_TEMPLATE)
    cfg = ServerConfig(tiny_target(), n_ctx=256, extra_args=("--jinja", "--chat-template-file", str(template)))
    with LlamaServer(cfg, binary=b11434.server) as plain:
        truth = record_one(plain.url, RequestItem(t["endpoint"], t["request"]), {})
    fixed, ref = _probs(json.loads(res.repaired)), _probs(truth)
    same = next((k for k, (f, r) in enumerate(zip(fixed, ref)) if f.id != r.id), min(len(fixed), len(ref)))
    if "probabilistic" not in name:
        assert [p.id for p in fixed] == [p.id for p in ref]
    assert same >= 1
    for f, r in zip(fixed[:same], ref[:same]):
        assert abs(f.logprob - r.logprob) <= TOL and [x[0] for x in f.top] == [x[0] for x in r.top]


JAPANESE = [
    ("/completion", {"prompt": "日本語の文章：東京は", "n_probs": 2, "n_predict": 24}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "東京について日本語で一文書いてください。"}],
                              "logprobs": True, "top_logprobs": 2, "max_tokens": 24}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint,body", JAPANESE, ids=["completion", "chat"])
def test_tokens_ending_in_incomplete_utf8_are_aligned_and_explained(self_draft_server, plain_server, smollm2,
                                                                    tmp_path, endpoint, body, stream):
    """Byte-level tokens of Japanese text end in incomplete UTF-8: the server sends no entry (and no
    chunk) for them. recover aligns their bytes to ids, gives them values, and says why they were missing."""
    body = {**body, "temperature": 1, "seed": 3, "stream": stream}
    spec = record_one(self_draft_server.url, RequestItem(endpoint, body), {})
    plain = record_one(plain_server.url, RequestItem(endpoint, {**body, "stream": False}), {})
    path = tmp_path / "ja.json"
    path.write_text(dumps(spec))
    res = recover(path, smollm2)
    rep = res.records[0]
    c = rep.summary()["counts"]
    assert c["mismatch"] == c["unaligned"] == 0 and rep.error is None
    utf8 = [t for t in rep.tokens if "incomplete UTF-8" in t.note]
    if not (stream and endpoint == "/v1/chat/completions"):
        # (a chat stream carries text only: its partial characters arrive inside later chunks'
        # text and are aligned with them, so they are not told apart there)
        assert utf8, "the prompt no longer produces partial characters: pick another"
    generated = plain["response"].get("tokens_predicted") or plain["response"]["usage"]["completion_tokens"]
    assert len(rep.tokens) + sum(int(n.split("the last ")[1].split()[0]) for n in rep.notes) == generated
    # every value the plain server did send is reproduced
    fixed = _probs(json.loads(res.repaired))
    j = 0
    for t in sent_entries(endpoint, plain["response"]):
        while fixed[j].id != t.id:
            j += 1
        assert abs(fixed[j].logprob - t.logprob) <= TOL
        assert [x[0] for x in fixed[j].top] == [x[0] for x in t.top]
        j += 1


@pytest.mark.parametrize("endpoint", ["/completion", "/v1/chat/completions"])
def test_stop_words_and_penalised_sampler_chain(self_draft_server, plain_server, smollm2, tmp_path, endpoint):
    """Post-sampling values come from the whole chain (penalties see the prompt), and a stop word's
    trimmed entries stay trimmed but are reported."""
    extra = {"stop": [" and"], "repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2,
             "top_k": 20, "temperature": 0.9, "seed": 5, "post_sampling_probs": True}
    body = ({"prompt": "The sea is blue. The sky is", "n_probs": 4, "n_predict": 40, **extra}
            if endpoint == "/completion" else
            {"messages": CHAT_MSGS, "logprobs": True, "top_logprobs": 4, "max_tokens": 40, **extra})
    spec = record_one(self_draft_server.url, RequestItem(endpoint, body), {})
    plain = record_one(plain_server.url, RequestItem(endpoint, body), {})
    path = tmp_path / "stop.json"
    path.write_text(dumps(spec))
    res = recover(path, smollm2)
    rep = res.records[0]
    assert rep.summary()["counts"]["mismatch"] == 0
    fixed, truth = _probs(json.loads(res.repaired)), _probs(plain)
    assert [p.id for p in fixed] == [p.id for p in truth]
    for f, t in zip(fixed, truth):
        assert f.kind == "prob"
        assert abs(f.logprob - t.logprob) <= TOL and [x[0] for x in f.top] == [x[0] for x in t.top]
    if endpoint == "/completion":
        assert spec["response"]["stop_type"] == "word"
        assert [t.note for t in rep.tokens if t.status == "missing"] == ["the stop word's entries are trimmed by the server"]
