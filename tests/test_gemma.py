"""Gemma 3 270M Q4_K_M on real b11434 servers: a model whose memory cannot simply drop a suffix.

Its sliding-window layers (window 512) make the server cut every prompt for context checkpoints
(schedule/prompt.py) and restore checkpoints when a request reuses the prompt cache; on its
quantized weights a replay that decodes the prompt in other batches is off by up to 0.2 nats. Each
case records the same request from a speculating server (draft-simple with Gemma requantised to
Q2_K as the draft, so drafts are rejected too) and from an unspeculated one with the same file and
flags, and asks what test_field.py asks of SmolLM2: recover within 5e-4 of the unspeculated
server, trace token-exact with the server's draft totals. The model file has no chat template:
chat requests are rendered by the server's ChatML fallback.
"""
from __future__ import annotations

import json
import threading

import pytest
from cli_helpers import one_error, run
from field_helpers import TOL, aligned, check_recovered, compare_filled, entries, record, trace, traced_real_values
from tiers import WIDE, default_and_wide

from replay.commands.record import server_snapshot
from replay.llamacpp.process import ServerConfig
from replay.transcripts.format import dumps

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

STORY = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
         "in his book. ")
LONG = STORY * 34 + "What happened next?"  # 787 tokens: longer than the 512-token window
CHAT = [{"role": "system", "content": "You are a patient storyteller. " + STORY * 20},
        {"role": "user", "content": "Tell me about the sea."}]
N_CTX = 4096
# The real values a speculating server sends after its first token (sampled outside its loop) come
# from KV its verify batches built: on Gemma 3 they differ from the unspeculated server's by up to
# 0.29 nats (measured here: a low-probability alternative in the cache case), and trace, which
# decodes those batches, gives them within 5e-4; recover, which does not replay the checkpoint restores
# of a target that cannot drop a suffix, labels them approximate past 256 positions (APPROXIMATE_DRIFT).
KV_DRIFT = 0.3


@pytest.fixture(scope="module")
def servers(module_server, gemma3, gemma3_draft):
    """(speculating, unspeculated) -np 1 servers for requests that do not reuse the prompt cache."""
    return (module_server(ServerConfig(gemma3, n_ctx=N_CTX, draft_model=gemma3_draft, spec_types=("draft-simple",))),
            module_server(ServerConfig(gemma3, n_ctx=N_CTX)))


def _md(draft):
    return ("-md", str(draft))


CASES = {
    "completion-t1": ("/completion", {"prompt": LONG, "n_predict": 32, "n_probs": 3, "temperature": 1.0}),
    "completion-post-t0.7": ("/completion", {"prompt": LONG, "n_predict": 32, "n_probs": 3, "temperature": 0.7,
                                             "post_sampling_probs": True}),
    "v1-completions-t0": ("/v1/completions", {"prompt": LONG, "max_tokens": 32, "logprobs": 3, "temperature": 0}),
    "chat-t1": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 32, "logprobs": True, "top_logprobs": 3,
                                         "temperature": 1.0}),
    "completion-stream-t1": ("/completion", {"prompt": LONG, "n_predict": 32, "n_probs": 3, "temperature": 1.0,
                                             "stream": True}),
    "chat-stream-t0": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 32, "logprobs": True,
                                                "top_logprobs": 3, "temperature": 0, "stream": True}),
}


@pytest.mark.parametrize("case", default_and_wide(CASES, {"completion-post-t0.7", "chat-stream-t0"}))
def test_every_endpoint_recovers_exactly_and_traces_token_for_token(servers, gemma3, gemma3_draft, tmp_path, case):
    spec, plain = servers
    endpoint, body = CASES[case]
    body = {**body, "seed": 7}
    s, p = record(spec, endpoint, body), record(plain, endpoint, body)
    rep = check_recovered(s, p, gemma3, tmp_path, case, spec_args=("-md", str(gemma3_draft), "--spec-type",
                                                                   "draft-simple"), drift=KV_DRIFT,
                          trace_args=_md(gemma3_draft))
    sched = rep["schedule"]
    assert sched["checkpoints"] and len(sched["prompt_batches"]) >= 3, sched  # cut: [.., 4 + 512, 4] or at users
    if endpoint == "/v1/chat/completions":
        assert sched["user_message_starts"], "the ChatML fallback's user message was not found"
    tr = trace(s, gemma3, tmp_path, case, *_md(gemma3_draft))[0]
    assert tr["reproduced"] is True, (tr["first_divergence"], tr["divergence"], tr["notes"])


def test_an_unspeculated_servers_own_200_tokens_are_reproduced_exactly(servers, gemma3, tmp_path):
    """Every value a plain server sends is real: recover must agree with all of them within 5e-4
    (before the prompt cuts it was up to 0.415 nats off and called them ok)."""
    _, plain = servers
    p = record(plain, "/completion", {"prompt": LONG, "n_predict": 200, "n_probs": 3, "temperature": 1.0,
                                      "seed": 3, "ignore_eos": True})
    src = tmp_path / "plain.json"
    src.write_text(dumps(p))
    r = run("recover", src, "-m", gemma3, "-o", tmp_path / "out.json", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)["records"][0]
    assert rep["summary"]["counts"]["ok"] == 200 and rep["numerics"]["cause"] is None
    assert rep["summary"]["max_abs_diff_real"] <= TOL


def test_a_transcript_without_server_details_is_judged_strictly(servers, gemma3, tmp_path, monkeypatch):
    """No slot count, flags or /props (a request and response saved by another tool): exact with the
    server's prompt cuts; with the cuts left out (the code before them), refused in one line, where
    the old rule accepted it as "batches shared with other requests"."""
    import replay.schedule.memory as memory_mod
    from replay.schedule.memory import checkpoint_rules
    spec, _ = servers
    s = record(spec, "/completion", {"prompt": LONG, "n_predict": 24, "n_probs": 3, "temperature": 1.0, "seed": 5})
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"request": s["request"], "response": s["response"]}))
    ok = run("recover", bare, "-m", gemma3, "-o", tmp_path / "ok.json", "--json")
    assert ok.exit_code == 0, ok.output
    rep = json.loads(ok.stdout)["records"][0]
    assert rep["numerics"]["slots"] is None and rep["tokens"][0]["status"] == "ok"

    def uncut(model, removes, **kw):
        return checkpoint_rules(model, True, **{**kw, "swa_full": True})  # never checkpoints: one prompt batch
    monkeypatch.setattr(memory_mod, "checkpoint_rules", uncut)  # where a slot is made (SlotConfig.open)
    err = one_error(run("recover", bare, "-m", gemma3, "-o", tmp_path / "old.json"))
    assert "token 0" in err and "--shared-batches" in err and not (tmp_path / "old.json").exists(), err
    # the user's explicit option brings the lenient judgement back, and says so
    lenient = run("recover", bare, "-m", gemma3, "-o", tmp_path / "lenient.json", "--shared-batches", "--json")
    assert lenient.exit_code == 0, lenient.output
    assert json.loads(lenient.stdout)["records"][0]["numerics"]["cause"] == "batch composition"


def test_the_probabilistic_verifier(start_server, servers, gemma3, gemma3_draft, tmp_path):
    _, plain = servers
    spec = start_server(ServerConfig(gemma3, n_ctx=N_CTX, draft_model=gemma3_draft, spec_types=("draft-simple",),
                                     draft_sampling="probabilistic"))
    body = {"prompt": LONG, "n_predict": 32, "n_probs": 3, "temperature": 1.0, "seed": 9}
    s, p = record(spec, "/completion", body), record(plain, "/completion", body)
    assert s["response"]["timings"]["draft_n_accepted"] < s["response"]["timings"]["draft_n"]  # rejections happened
    # the rejection verifier samples differently from plain decoding: compare up to where they part
    rep = check_recovered(s, p, gemma3, tmp_path, "probabilistic", spec_args=(
        "-md", str(gemma3_draft), "--spec-type", "draft-simple", "--spec-draft-sampling", "probabilistic"),
        drift=KV_DRIFT, trace_args=_md(gemma3_draft))
    assert rep["schedule"]["checkpoints"]
    tr = trace(s, gemma3, tmp_path, "probabilistic", *_md(gemma3_draft))[0]
    assert tr["reproduced"] is True, (tr["first_divergence"], tr["divergence"], tr["notes"])
    assert any(st["rule"] == "rejection" for st in tr["steps"])


def test_ngram_mod_on_a_repetitive_prompt(start_server, servers, gemma3, tmp_path):
    _, plain = servers
    spec = start_server(ServerConfig(gemma3, n_ctx=N_CTX, spec_types=("ngram-mod",)))
    body = {"prompt": STORY * 40, "n_predict": 96, "n_probs": 2, "temperature": 0, "seed": 1}
    s, p = record(spec, "/completion", body), record(plain, "/completion", body)
    assert s["response"]["timings"].get("draft_n", 0) >= 48, "ngram-mod drafted nothing: the case proves nothing"
    check_recovered(s, p, gemma3, tmp_path, "ngram-mod", drift=KV_DRIFT, trace_args=())
    tr = trace(s, gemma3, tmp_path, "ngram-mod")[0]
    assert tr["reproduced"] is True, (tr["first_divergence"], tr["divergence"], tr["notes"])


def _bodies(k: int) -> dict:
    return {"prompt": STORY * (12 + 6 * k) + f"Question {k}: what happened next?", "n_predict": 32, "n_probs": 3,
            "temperature": 1.0, "seed": 40 + k}


@pytest.fixture
def default_np(start_server, servers, gemma3, gemma3_draft):
    """The server as users start it: default -np (4 slots on a unified KV cache, whose sliding-window
    cache then holds 4 x 512 + 512 cells), speculating."""
    return start_server(ServerConfig(gemma3, n_ctx=N_CTX, n_parallel=-1, draft_model=gemma3_draft,
                                     spec_types=("draft-simple",))), servers[1]


@WIDE
def test_default_slots_with_sequential_requests_are_exact(default_np, gemma3, gemma3_draft, tmp_path):
    spec, plain = default_np
    recs, compared = [], 0
    for k in range(4):
        s = record(spec, "/completion", _bodies(k))
        # a 4-slot server's unified cache lays cells out otherwise than the 1-slot reference: where a
        # draw lies near a boundary the runs part early (explained by numerics in check_recovered)
        rep = check_recovered(s, record(plain, "/completion", _bodies(k)), gemma3, tmp_path, f"sequential-{k}",
                              spec_args=("-md", str(gemma3_draft), "--spec-type", "draft-simple"), drift=KV_DRIFT,
                              min_same=1, trace_args=_md(gemma3_draft))
        assert rep["numerics"]["slots"] == 4 and rep["numerics"]["cause"] is None  # no real value needed the bound
        compared += rep["compared_with_unspeculated"]
        recs.append(s)
    assert compared >= 32, f"only {compared} values could be compared with the unspeculated server"
    traced = trace(recs, gemma3, tmp_path, "sequential", *_md(gemma3_draft))
    assert all(tr["reproduced"] is True for tr in traced), [(t["first_divergence"], t["notes"]) for t in traced]


def test_default_slots_with_four_concurrent_requests(default_np, gemma3, gemma3_draft, tmp_path):
    spec, plain = default_np
    snap = server_snapshot(spec.url)
    out: list[dict | None] = [None] * 4
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, record(spec, "/completion", _bodies(i), snap)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out)
    for k, s in enumerate(out):
        rep = check_recovered(s, record(plain, "/completion", _bodies(k)), gemma3, tmp_path, f"concurrent-{k}",
                              concurrent=True)
        assert rep["numerics"]["slots"] == 4
    for tr in trace(out, gemma3, tmp_path, "concurrent", *_md(gemma3_draft), "--shared-batches"):
        assert tr["reproduced"] is True or (tr["divergence"] and tr["divergence"]["cause"] == "numerics"), \
            (tr["first_divergence"], tr["divergence"], tr["notes"])


TURNS = ["Tell me about the sea.", "And the lighthouse?", "What did the keeper write?"]
REPLIES = ["The sea is wide and grey, and it never sleeps.", "It stands on a rock at the end of the bay."]


def _cached_requests() -> list[tuple[str, dict]]:
    """A multi-turn chat whose turns share the system prompt and the earlier turns, and a long prompt
    extended twice, with the prompt cache on (the server's default)."""
    reqs = []
    for k in range(3):
        msgs = [CHAT[0]]
        for j in range(k):
            msgs += [{"role": "user", "content": TURNS[j]}, {"role": "assistant", "content": REPLIES[j]}]
        msgs.append({"role": "user", "content": TURNS[k]})
        reqs.append(("/v1/chat/completions", {"messages": msgs, "max_tokens": 24, "logprobs": True,
                                              "top_logprobs": 3, "temperature": 1, "seed": 10 + k,
                                              "cache_prompt": True}))
    for k in range(2):
        reqs.append(("/completion", {"prompt": STORY * 34 + " And then" * (1 + 40 * k), "n_predict": 24,
                                     "n_probs": 3, "temperature": 1, "seed": 20 + k, "cache_prompt": True}))
    return reqs


def test_requests_that_reuse_the_prompt_cache(start_server, gemma3, gemma3_draft, tmp_path):
    """The server restores its context checkpoints, or keeps what the window still holds: recover
    follows it record by record (cache_n from the response), trace continues the slot's memory."""
    spec = start_server(ServerConfig(gemma3, n_ctx=N_CTX, draft_model=gemma3_draft, spec_types=("draft-simple",)))
    plain = start_server(ServerConfig(gemma3, n_ctx=N_CTX))
    s_recs = [record(spec, ep, body) for ep, body in _cached_requests()]
    p_recs = [record(plain, ep, body) for ep, body in _cached_requests()]
    cached = [t["response"]["timings"]["cache_n"] for t in s_recs]
    assert cached[0] == 0 and all(c > 500 for c in cached[1:3]) and cached[4] > 700, cached
    for name, recs in (("spec", s_recs), ("plain", p_recs)):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(dumps(t, indent=None) + "\n" for t in recs))
        r = run("recover", src, "-m", gemma3, "-o", tmp_path / f"{name}.out.jsonl", "--json")
        assert r.exit_code == 0, r.output
        reps = json.loads(r.stdout)["records"]
        assert [x["prefix"] for x in reps] == ["server cache" if t["response"]["timings"]["cache_n"] else "fresh"
                                               for t in recs]
        if name == "spec":
            repaired = [json.loads(line) for line in (tmp_path / "spec.out.jsonl").read_text().splitlines()]
            traced = trace(s_recs, gemma3, tmp_path, "cached", *_md(gemma3_draft))
            compared = 0
            for k, (fixed, truth, rep, tr) in enumerate(zip(repaired, p_recs, reps, traced)):
                same, worst, kept = compare_filled(*aligned(entries(fixed), entries(truth)), rep)
                assert worst <= TOL and kept <= KV_DRIFT, (k + 1, same, worst, kept)
                assert traced_real_values(tr, s_recs[k]) <= TOL  # the kept values are the server's verify-batch KV's
                compared += same
                if same < len(entries(truth)):  # the runs part: the speculating server's numerics moved a draw
                    why = trace(p_recs[:k + 1], gemma3, tmp_path, f"cached-plain-{k}", "-md", str(gemma3_draft),
                                "--spec-type", "draft-simple")[-1]
                    assert why["divergence"] and why["divergence"]["cause"] == "numerics", (k + 1, why["divergence"])
            assert compared >= 48, f"only {compared} values compared with the unspeculated server"
        else:
            assert all(x["summary"]["max_abs_diff_real"] <= TOL for x in reps)
            assert all(tr["reproduced"] is True for tr in traced), [(t["first_divergence"], t["notes"]) for t in traced]


@pytest.mark.parametrize("flags", [{"n_ctx_checkpoints": 0}, {"swa_full": True}], ids=["ctx-checkpoints-0", "swa-full"])
def test_a_server_that_does_not_checkpoint_does_not_cut(start_server, gemma3, tmp_path, flags):
    """--ctx-checkpoints 0, or --swa-full (the whole window kept: n_swa 0): no checkpoints, so the prompt
    goes in one batch; recorded in server.flags, the replay follows."""
    srv = start_server(ServerConfig(gemma3, n_ctx=N_CTX, **flags))
    p = record(srv, "/completion", {"prompt": LONG, "n_predict": 24, "n_probs": 3, "temperature": 1.0, "seed": 2})
    src = tmp_path / "plain.json"
    src.write_text(dumps(p))
    r = run("recover", src, "-m", gemma3, "-o", tmp_path / "out.json", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)["records"][0]
    assert rep["schedule"]["checkpoints"] is False and rep["schedule"]["prompt_batches"] == [787]
    assert rep["summary"]["max_abs_diff_real"] <= TOL
