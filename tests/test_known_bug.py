"""The bug spec-replay exists for, pinned against the real b11434 llama-server.

With speculation on, every token emitted inside the speculative loop is sent
with a placeholder (tools/server/server-context.cpp :4350-4357,
`result.prob = 1.0f; // set later`): logprob 0.0 / prob 1.0 and an empty top
list. The same request to a server without speculation returns real values
for every token, and the tokens themselves are the same: the server's
sample-and-match verification runs the target sampler once per emitted
position with the same RNG stream (docs/server-loop.md, fact 2).
A token sampled outside the loop keeps its real values: with one token of
n_predict left the server cannot draft (get_n_draft_max: n_remaining - 1 = 0,
server-context.cpp:517-536), so the last token is real when the steps before
it leave exactly one; where that happens depends on how many drafts the
verification accepted (on this machine's kernels or another's).
"""
from __future__ import annotations

import math

import pytest

from replay.commands.record import RequestItem, record_one
from replay.transcripts.entries import sent_entries

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

CHAT = {
    "messages": [{"role": "user", "content": "Write two sentences about the sea."}],
    "logprobs": True, "top_logprobs": 3, "temperature": 1, "seed": 1, "max_tokens": 32,
}
COMPLETION = {
    "prompt": "The sea is", "n_predict": 32, "n_probs": 3, "post_sampling_probs": True,
    "temperature": 1, "seed": 1,
}


def _record(server, endpoint, body):
    return record_one(server.url, RequestItem(endpoint, body), server.config.flags_block())


def _outside_the_loop(k: int, n: int, n_predict: int) -> bool:
    """Can entry k of n be a token sampled outside the speculative loop? The first (the prompt batch's),
    and the last of a response that reached n_predict (no room left to draft)."""
    return k == 0 or (k == n - 1 and n == n_predict)


def _generated_ids(t):
    if t["endpoint"] == "/completion":
        return t["response"]["tokens"]
    return [e["id"] for e in sent_entries(t["endpoint"], t["response"])]


def test_chat_logprobs_are_placeholders_after_the_first_token(self_draft_server, plain_server):
    spec = _record(self_draft_server, "/v1/chat/completions", CHAT)
    plain = _record(plain_server, "/v1/chat/completions", CHAT)

    spec_probs = sent_entries("/v1/chat/completions", spec["response"])
    plain_probs = sent_entries("/v1/chat/completions", plain["response"])
    assert len(spec_probs) == len(plain_probs) >= 8
    assert [p.id for p in spec_probs] == [p.id for p in plain_probs], "speculation changed the tokens"

    first = spec_probs[0]
    assert first.logprob < 0 and len(first.top) == 3
    inside = [p for k, p in enumerate(spec_probs) if not _outside_the_loop(k, len(spec_probs), CHAT["max_tokens"])]
    assert len(inside) >= 8 and all(p.logprob == 0.0 and p.top == () for p in inside), \
        [(p.token, p.logprob, len(p.top)) for p in inside]
    assert all(p.logprob < 0 and len(p.top) == 3 for p in plain_probs)
    assert spec["response"]["timings"]["draft_n"] > 0


def test_completion_post_sampling_probs_are_placeholders(self_draft_server, plain_server):
    spec = _record(self_draft_server, "/completion", COMPLETION)
    plain = _record(plain_server, "/completion", COMPLETION)

    assert spec["response"]["tokens"] == plain["response"]["tokens"]
    spec_entries = spec["response"]["completion_probabilities"]
    plain_entries = plain["response"]["completion_probabilities"]
    assert len(spec_entries) == len(plain_entries) >= 8

    assert spec_entries[0]["prob"] < 1.0 and len(spec_entries[0]["top_probs"]) == 3
    for k, e in enumerate(spec_entries):
        if not _outside_the_loop(k, len(spec_entries), COMPLETION["n_predict"]):
            assert e["prob"] == 1.0 and e["top_probs"] == [], (k, e)
    for e in plain_entries:
        assert 0.0 < e["prob"] <= 1.0 and len(e["top_probs"]) >= 1
    assert any(e["prob"] < 1.0 for e in plain_entries[1:])


def test_transcript_prompt_ids_match_what_the_server_evaluated(self_draft_server):
    t = _record(self_draft_server, "/v1/chat/completions", CHAT)
    assert t["prompt_tokens_checked_against"] == "usage.prompt_tokens"
    assert len(t["prompt_tokens"]) == t["response"]["usage"]["prompt_tokens"]
    assert t["server"]["build_info"].startswith("b11434-")
    assert t["response"]["system_fingerprint"].startswith("b11434-")
    assert t["server"]["flags"]["--spec-type"] == ["draft-simple"]
    assert t["added_fields"] == ["cache_prompt", "return_tokens", "verbose"] and t["request"]["cache_prompt"] is False


def test_streamed_speculative_tokens_carry_no_probabilities(self_draft_server, plain_server):
    body = {**COMPLETION, "stream": True, "post_sampling_probs": False}
    spec = _record(self_draft_server, "/completion", body)
    plain = _record(plain_server, "/completion", body)
    from replay.transcripts.format import stream_objects
    spec_probs = sent_entries("/completion", events=stream_objects(spec))
    plain_probs = sent_entries("/completion", events=stream_objects(plain))
    n = plain["events"] and len(plain_probs)
    assert n >= 8 and all(p.top for p in plain_probs)
    # only tokens sampled outside the speculative loop keep their entry
    assert 1 <= len(spec_probs) < n
    assert all(p.top and not math.isnan(p.logprob) for p in spec_probs)
