"""Rules of the server's request path, each pinned on a real b11434 server (found in review against
the source; each failed before it was fixed): the context-limit stop, n-gram map cleanup across
requests, sampler names, `logprobs: true`, max_completion_tokens, the draft sampler's temperature
across requests, `-md` without `--spec-type`, and a draft model the server cannot use."""
from __future__ import annotations

import json

import pytest
from cli_helpers import run

from replay.commands.record import RequestItem, record_one
from replay.run.recover import recover
from replay.llamacpp.models import tiny_draft, tiny_target
from replay.llamacpp.process import ServerConfig
from replay.transcripts.entries import sent_entries
from replay.transcripts.format import dumps

pytestmark = [pytest.mark.build, pytest.mark.live_server]


def _record(srv, endpoint, body, path):
    t = record_one(srv.url, RequestItem(endpoint, body), srv.config.flags_block())
    path.write_text(dumps(t))
    return t


def _trace(path, model, *extra) -> dict:
    r = run("trace", path, "-m", model, "--json", *extra)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return json.loads(r.stdout)


def test_a_normal_step_stops_when_the_context_is_full_and_a_prompt_one_short_of_it_gets_a_token(start_server,
                                                                                               tmp_path):
    """The server stops when prompt + emitted tokens reach -c (server-context.cpp:2018-2026), one token
    later than the old `+ 1` rule, and answers a prompt of n_ctx - 1 tokens with one token. (A slot's
    context is a multiple of 256.)"""
    srv = start_server(ServerConfig(tiny_target(), n_ctx=256, spec_types=("ngram-simple",)))
    t = _record(srv, "/completion", {"prompt": "bcd" * 83 + "b", "n_predict": 40, "n_probs": 1, "temperature": 1,
                                     "seed": 3, "ignore_eos": True}, tmp_path / "full.json")
    assert t["response"]["truncated"] and len(t["response"]["tokens"]) == 256 - 250
    assert _trace(tmp_path / "full.json", tiny_target())["reproduced"] is True
    t = _record(srv, "/completion", {"prompt": "bcd" * 85, "n_predict": 8, "n_probs": 1, "seed": 3},
                tmp_path / "short.json")
    assert len(t["prompt_tokens"]) == 255 and len(t["response"]["tokens"]) == 1
    assert _trace(tmp_path / "short.json", tiny_target())["reproduced"] is True


def test_a_fully_accepted_draft_that_fills_the_context_emits_only_its_first_token(start_server, tmp_path):
    """The context check of every token of a speculative step counts all of the step's tokens
    (n_tokens = prompt + before + step - 1): a draft capped by the context and fully accepted stops
    generation after its first token. The target drafting for itself at temperature 0 always
    accepts."""
    srv = start_server(ServerConfig(tiny_target(), n_ctx=256, draft_model=tiny_target(),
                                    spec_types=("draft-simple",)))
    prompt = "bcd" * 80  # 240 tokens: 16 to go, drafted 3 at a time and all accepted
    t = _record(srv, "/completion", {"prompt": prompt, "n_predict": 64, "n_probs": 1, "temperature": 0,
                                     "seed": 1, "ignore_eos": True}, tmp_path / "t.json")
    n = len(t["response"]["tokens"])
    assert t["response"]["truncated"] and n < 256 - 240  # stopped before the context was full token by token
    res = _trace(tmp_path / "t.json", tiny_target(), "-md", tiny_target())
    assert res["reproduced"] is True and len(res["emitted"]) == n


@pytest.mark.model
def test_request_sampler_names_and_letters_are_read_as_the_server_reads_them(start_server, smollm2, tmp_path):
    srv = start_server(ServerConfig(smollm2, spec_types=("ngram-mod",)))
    prompt = "The tide came in and the tide went out. " * 6
    for k, samplers in enumerate([["Top_K", "MinP", "temperature"], "top_k;temperature"]):
        _record(srv, "/completion", {"prompt": prompt, "n_predict": 24, "n_probs": 1, "temperature": 1.3,
                                     "seed": 9 + k, "samplers": samplers}, tmp_path / f"{k}.json")
        res = _trace(tmp_path / f"{k}.json", smollm2)
        assert res["reproduced"] is True, res["notes"]


@pytest.mark.model
def test_logprobs_true_on_completion_is_one_alternative(start_server, smollm2, tmp_path):
    spec = start_server(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",)))
    plain = start_server(ServerConfig(smollm2))
    body = {"prompt": "The sea is", "n_predict": 16, "logprobs": True, "temperature": 1, "seed": 4}
    _record(spec, "/completion", body, tmp_path / "spec.json")
    truth = _record(plain, "/completion", body, tmp_path / "plain.json")
    res = recover(tmp_path / "spec.json", smollm2)
    assert res.records[0].n_probs == 1 and res.records[0].summary()["counts"]["placeholder"] > 0
    fixed = sent_entries("/completion", json.loads(res.repaired)["response"])
    want = sent_entries("/completion", truth["response"])
    assert [(f.id, [t[0] for t in f.top]) for f in fixed] == [(w.id, [t[0] for t in w.top]) for w in want]
    assert max(abs(f.logprob - w.logprob) for f, w in zip(fixed, want)) <= 5e-4


@pytest.mark.model
def test_max_completion_tokens_wins_over_max_tokens(start_server, smollm2, tmp_path):
    srv = start_server(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",)))
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 40,
            "max_completion_tokens": 9, "seed": 2, "temperature": 1, "logprobs": True}
    t = _record(srv, "/v1/chat/completions", body, tmp_path / "t.json")
    assert t["response"]["usage"]["completion_tokens"] == 9
    res = _trace(tmp_path / "t.json", smollm2)
    assert res["reproduced"] is True and len(res["emitted"]) == 9


@pytest.mark.model
def test_the_draft_sampler_keeps_the_last_probabilistic_requests_temperature(start_server, smollm2,
                                                                            smollm2_draft, tmp_path):
    """One slot, probabilistic drafting, --spec-draft-p-min 0.3: a temperature-0 request after a
    temperature-1.5 one drafts with the draft sampler the first one retuned (its p_min test sees
    probabilities at 1.5), and trace carries that over when it replays the requests in order."""
    srv = start_server(ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",),
                                    draft_sampling="probabilistic", draft_p_min=0.3))
    lines = []
    for k, temp in enumerate((1.5, 0.0, 0.0)):
        body = {"prompt": "Once upon a time", "n_predict": 32, "n_probs": 1, "temperature": temp, "seed": 5 + k}
        lines.append(json.dumps(record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())))
    p = tmp_path / "all.jsonl"
    p.write_text("\n".join(lines) + "\n")
    res = _trace(p, smollm2, "-md", smollm2_draft)
    assert all(r["reproduced"] for r in res["records"]), [r["notes"] for r in res["records"]]


@pytest.mark.model
def test_a_draft_model_without_a_spec_type_does_not_speculate(start_server, smollm2, tmp_path):
    srv = start_server(ServerConfig(smollm2, draft_model=smollm2))
    t = _record(srv, "/completion", {"prompt": "Once upon a time", "n_predict": 16, "n_probs": 1,
                                     "temperature": 1, "seed": 3}, tmp_path / "t.json")
    assert not t["response"]["timings"].get("draft_n")
    res = _trace(tmp_path / "t.json", smollm2)
    assert res["reproduced"] is True and res["draft_n"] == 0
    assert any("-md alone" in n for n in res["notes"])


@pytest.mark.model
def test_a_draft_whose_vocabulary_does_not_match_turns_speculation_off(start_server, smollm2, tmp_path):
    srv = start_server(ServerConfig(smollm2, draft_model=tiny_draft(), spec_types=("draft-simple",)))
    t = _record(srv, "/completion", {"prompt": "Once upon a time", "n_predict": 16, "n_probs": 1,
                                     "temperature": 1, "seed": 3}, tmp_path / "t.json")
    assert not t["response"]["timings"].get("draft_n") and t["server"]["slots"][0]["speculative"] is False
    res = _trace(tmp_path / "t.json", smollm2, "-md", tiny_draft())
    assert res["reproduced"] is True and res["draft_n"] == 0
    assert any("cannot draft with tiny-draft.gguf" in n for n in res["notes"])


def test_ngram_map_cleanup_runs_even_before_any_key_was_stored(start_server, tmp_path):
    """common_ngram_map_begin resets the hash map's last index whenever a prompt is shorter than what
    the slot last checked; upstream's map is a fixed vector, never "empty", so this happens even when
    no key was stored yet. A first request too short to store a key (prompt and output within
    size_n + size_m + 1) still moves the index to 11; the next, shorter prompt must start from 0, or
    its first 11 positions are never searched (the old rule drafted 23 and 27 tokens where the server
    drafted 57 and 59)."""
    base = "bcdbcebcdbcfbcd"
    lines = []
    for seed in (0, 2):  # a fresh server each: its slot starts with an empty map
        srv = start_server(ServerConfig(tiny_target(), n_ctx=256, spec_types=("ngram-map-k",),
                                        ngram_map_k_size_n=2, ngram_map_k_size_m=8))
        for prompt, n_predict, s in ((base[:11], 11, 20 + seed), (base[:2], 40, 30 + seed)):
            body = {"prompt": prompt, "n_predict": n_predict, "n_probs": 1, "temperature": 0.7, "seed": s,
                    "ignore_eos": True}
            lines.append(json.dumps(record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())))
    for k in (0, 2):  # one slot's history per file
        (tmp_path / f"{k}.jsonl").write_text(lines[k] + "\n" + lines[k + 1] + "\n")
        res = _trace(tmp_path / f"{k}.jsonl", tiny_target())
        assert [r["server_draft_n"] > 0 for r in res["records"]] == [False, True]
        assert all(r["reproduced"] for r in res["records"]), [(r["draft_n"], r["server_draft_n"]) for r in res["records"]]
