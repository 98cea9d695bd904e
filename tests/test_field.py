"""The field grid: servers configured the way users run them, recorded live from real b11434 servers.

Each case records the same requests from a speculating server and from an unspeculated server with
the same model file and flags, then asks two things of the speculative transcript:

- recover: every value it fills is the unspeculated server's within 5e-4 nats (same top ids), and
  it says which settings it used and where each came from;
- trace: token-exact (`reproduced` true); for concurrent traffic on a multi-slot server, reproduced
  or its divergence explained, with the cause.

Cases: sampling defaults in the model file (general.sampling.*), sampling flags on the server's
command line, structured output (grammar, json_schema, response_format, tools), default `-np` (4
slots, unified KV) with 4 concurrent requests and with sequential ones, streams of multi-byte text.
The draft is SmolLM2 quantised to Q2_K, so drafts are rejected as well as accepted.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from cli_helpers import one_error, run
from field_helpers import check_recovered as _check_recovered
from field_helpers import record as _record
from field_helpers import settings_of as _settings
from field_helpers import spec_args as _spec
from field_helpers import trace as _trace
from tiers import WIDE, default_and_wide

from replay.commands.record import server_snapshot
from replay.llamacpp.models import SMOLLM2_FILE_DEFAULTS, smollm2_with_defaults
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.transcripts.format import stream_objects

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]


@pytest.fixture
def pair(start_server, smollm2_draft):
    """pair(model, **flags) -> (speculating server, unspeculated server), same model file and flags."""
    def make(model: Path, **flags) -> tuple[LlamaServer, LlamaServer]:
        spec = start_server(ServerConfig(model, draft_model=smollm2_draft, spec_types=("draft-simple",), **flags))
        return spec, start_server(ServerConfig(model, **flags))
    return make


def test_sampling_defaults_in_the_model_file_apply_under_a_request_that_sets_only_the_temperature(
        pair, smollm2_draft, tmp_path):
    model = smollm2_with_defaults()
    spec, plain = pair(model)
    for k, (endpoint, body) in enumerate([
            ("/completion", {"prompt": "Once upon a time", "n_predict": 48, "n_probs": 3, "temperature": 1,
                             "seed": 11}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                                      "max_tokens": 48, "logprobs": True, "top_logprobs": 3, "temperature": 1,
                                      "seed": 12, "post_sampling_probs": True})]):
        s, p = _record(spec, endpoint, body), _record(plain, endpoint, body)
        rep = _check_recovered(s, p, model, tmp_path, f"file-defaults-{k}", spec_args=_spec(smollm2_draft))
        got = _settings(rep)
        assert got["--top-k"] == (SMOLLM2_FILE_DEFAULTS["top_k"], "model file")
        assert got["--repeat-penalty"][1] == "model file" and got["--temp"][1] == "request"
        tr = _trace(s, model, tmp_path, f"file-defaults-{k}", "-md", smollm2_draft)[0]
        assert tr["reproduced"] is True, tr["notes"]


def test_sampling_flags_on_the_server_command_line(pair, smollm2, smollm2_draft, tmp_path):
    flags = {"top_k": 8, "penalty_repeat": 1.1, "min_p": 0.02}
    spec, plain = pair(smollm2, **flags)
    body = {"prompt": "The best way to learn a language is", "n_predict": 48, "n_probs": 3, "temperature": 1.2,
            "seed": 21}
    s, p = _record(spec, "/completion", body), _record(plain, "/completion", body)
    rep = _check_recovered(s, p, smollm2, tmp_path, "server-flags", spec_args=_spec(smollm2_draft))
    assert _settings(rep)["--top-k"] == (8, "server.flags")
    tr = _trace(s, smollm2, tmp_path, "server-flags", "-md", smollm2_draft)[0]
    assert tr["reproduced"] is True, tr["notes"]
    # a transcript recorded by another tool carries no flags: the user passes them as the server's
    bare = json.loads(json.dumps(s))
    del bare["server"]["flags"]
    del bare["server"]["props"]  # nor /props: nothing to read them back from
    bare["response"].pop("generation_settings")
    without = _trace(bare, smollm2, tmp_path, "server-flags-bare", "-md", smollm2_draft, "--spec-type",
                     "draft-simple")[0]
    assert without["reproduced"] is False
    told = _trace(bare, smollm2, tmp_path, "server-flags-told", "-md", smollm2_draft, "--spec-type",
                  "draft-simple", "--top-k", "8", "--repeat-penalty", "1.1", "--min-p", "0.02")[0]
    assert told["reproduced"] is True, told["notes"]


@pytest.mark.parametrize("mirostat", [1, 2])
def test_mirostat_post_sampling_values_follow_the_servers_own_state(pair, smollm2, smollm2_draft, tmp_path, mirostat):
    """Mirostat's mu follows the token the chain selects: recover's chain selects the emitted tokens
    (its draws are the server's), so its post-sampling values are the unspeculated server's; where it
    would not, recover refuses by name (evaluation/walk.py: stateful_sampler)."""
    spec, plain = pair(smollm2)
    body = {"prompt": "Write a short story about a fox:", "n_predict": 48, "n_probs": 3, "temperature": 1.0,
            "seed": 17, "mirostat": mirostat, "post_sampling_probs": True}
    s, p = _record(spec, "/completion", body), _record(plain, "/completion", body)
    rep = _check_recovered(s, p, smollm2, tmp_path, f"mirostat-{mirostat}", spec_args=_spec(smollm2_draft))
    assert _settings(rep)["--mirostat"] == (mirostat, "request")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PERSON = "Describe a fictional person as JSON with name, age and city."
STRUCTURED = {
    "completion-json_schema": ("/completion", {"prompt": PERSON + "\n", "json_schema": SCHEMA, "n_predict": 64,
                                               "n_probs": 2}),
    "completion-grammar": ("/completion", {"prompt": "Count in words: ", "n_predict": 40, "n_probs": 2,
                                           "grammar": 'root ::= ("one" | "two" | "three" | " " | "," )+'}),
    "chat-json_object": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PERSON}],
                                                  "response_format": {"type": "json_object"}, "max_tokens": 64,
                                                  "logprobs": True, "top_logprobs": 2}),
    "chat-json_schema": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PERSON}],
                                                  "response_format": {"type": "json_schema", "json_schema": {
                                                      "name": "person", "schema": SCHEMA}},
                                                  "max_tokens": 64, "logprobs": True, "top_logprobs": 2}),
}


# id: (case, temperature)
STRUCTURED_RUNS = {f"{label}-{c}": (c, t) for label, t in (("greedy", 0.0), ("t1", 1.0)) for c in STRUCTURED}


@pytest.mark.parametrize("case,temp", default_and_wide(
    STRUCTURED_RUNS.values(), {"greedy-chat-json_schema", "t1-completion-grammar", "t1-chat-json_object"},
    ids=STRUCTURED_RUNS))
def test_structured_output_is_replayed_through_the_grammar(pair, smollm2, smollm2_draft, tmp_path, case, temp):
    spec, plain = pair(smollm2)
    endpoint, body = STRUCTURED[case]
    body = {**body, "temperature": temp, "seed": 31}
    s, p = _record(spec, endpoint, body), _record(plain, endpoint, body)
    rep = _check_recovered(s, p, smollm2, tmp_path, f"{case}-t{temp:g}", spec_args=_spec(smollm2_draft))
    assert "--grammar" in _settings(rep)
    tr = _trace(s, smollm2, tmp_path, case, "-md", smollm2_draft)[0]
    assert tr["reproduced"] is True, tr["notes"]


# a system prompt and one example call, so SmolLM2 answers with a call
TOOL_CHAT = [
    {"role": "system", "content": 'You call tools. To get the weather, answer only with <tool_call>\n{"name": '
                                  '"get_weather", "arguments": {"city": CITY}}\n</tool_call>'},
    {"role": "user", "content": "Weather in London?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "London"}'}}]},
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.mark.parametrize("tool_choice", default_and_wide(["required", "auto"], {"required"}))
def test_tool_call_grammars_are_replayed(start_server, b11434, smollm2, smollm2_draft, tmp_path, tool_choice):
    """Tools with a template that supports them (Qwen2.5's, from the build's own models/templates),
    and a reply that calls one: `required` gives a grammar over the whole reply, prefilled with the
    generation prompt; `auto` a lazy grammar that starts at its trigger ("<tool_call>")."""
    template = Path(b11434.manifest["source"]) / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    args = ("--jinja", "--chat-template-file", str(template))
    spec = start_server(ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",),
                                     extra_args=args))
    plain = start_server(ServerConfig(smollm2, extra_args=args))
    for k, temp in enumerate((0.0, 1.0)):
        body = {"messages": TOOL_CHAT, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 64,
                "logprobs": True, "top_logprobs": 2, "temperature": temp, "seed": 61}
        s, p = _record(spec, "/v1/chat/completions", body), _record(plain, "/v1/chat/completions", body)
        assert s["response"]["choices"][0]["message"]["tool_calls"], "no tool call: the case proves little"
        echo = s["response"]["__verbose"]["generation_settings"]
        assert echo["grammar"] and echo["grammar_lazy"] is (tool_choice == "auto")
        rep = _check_recovered(s, p, smollm2, tmp_path, f"tools-{tool_choice}-{k}", spec_args=_spec(smollm2_draft))
        assert _settings(rep)["--grammar"][0].startswith("tool")
        tr = _trace(s, smollm2, tmp_path, f"tools-{tool_choice}-{k}", "-md", smollm2_draft)[0]
        assert tr["reproduced"] is True, tr["notes"]


STORY = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
         "in his book. ")


def _concurrent_bodies() -> list[dict]:
    return [{"prompt": STORY * (1 + 3 * k) + f"Question {k}: what happened next?", "n_predict": 48,
             "n_probs": 3, "temperature": 1.0, "seed": 40 + k} for k in range(4)]


@pytest.fixture
def default_np(start_server, smollm2, smollm2_draft):
    """The server as users start it: default -np (auto: 4 slots, unified KV), speculating, and the
    unspeculated reference (one request at a time)."""
    spec = start_server(ServerConfig(smollm2, n_parallel=-1, draft_model=smollm2_draft,
                                     spec_types=("draft-simple",)))
    return spec, start_server(ServerConfig(smollm2))


def test_default_slots_with_four_concurrent_requests(default_np, smollm2, smollm2_draft, tmp_path):
    spec, plain = default_np
    bodies = _concurrent_bodies()
    snap = server_snapshot(spec.url)
    assert snap["props"]["total_slots"] == 4
    out: list[dict | None] = [None] * 4
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _record(spec, "/completion", bodies[i], snap)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out)
    batched = compared = 0
    for k, s in enumerate(out):
        rep = _check_recovered(s, _record(plain, "/completion", bodies[k]), smollm2, tmp_path, f"concurrent-{k}",
                               concurrent=True)
        assert rep["numerics"]["slots"] == 4
        batched += rep["numerics"]["cause"] == "batch composition"
        compared += rep["compared_with_unspeculated"]
    assert compared >= 16, f"only {compared} filled values could be compared with the unspeculated server"
    # a wrong model file is told apart: by the name the transcript carries, by its file type when renamed,
    # and by the batch rule where the transcript names neither
    for k in range(4):
        src = tmp_path / f"concurrent-{k}.json"
        err = one_error(run("recover", src, "-m", smollm2_draft, "-o", tmp_path / f"wrong-{k}.json"))
        assert f"-m is {smollm2_draft.name}" in err and not (tmp_path / f"wrong-{k}.json").exists(), err
        err = one_error(run("recover", src, "-m", smollm2_draft, "--renamed-model", "-o", tmp_path / f"wrong-{k}.json"))
        assert "the server loaded a Q4_1 model (/props model_ftype)" in err, err
        t = json.loads(src.read_text())
        del t["server"]["props"]["model_ftype"], t["server"]["models_meta"]
        unnamed = tmp_path / f"unnamed-{k}.json"
        unnamed.write_text(json.dumps(t))
        err = one_error(run("recover", unnamed, "-m", smollm2_draft, "--renamed-model", "-o", tmp_path / f"wrong-{k}.json"))
        assert "not the server's" in err and not (tmp_path / f"wrong-{k}.json").exists(), err
    traced = _trace(out, smollm2, tmp_path, "concurrent", "-md", smollm2_draft, "--shared-batches")
    for tr in traced:
        assert tr["reproduced"] is True or (tr["divergence"] and tr["divergence"]["cause"] == "numerics"), \
            (tr["first_divergence"], tr["divergence"], tr["notes"])
    # each slot's state is its own (commands/trace_state.py): 2 workers print what one process prints
    assert _trace(out, smollm2, tmp_path, "concurrent", "-md", smollm2_draft, "--shared-batches", "--workers", "2") == traced
    print(f"\nconcurrent: {batched} of 4 records' real values judged batch numerics")


@WIDE
def test_default_slots_with_sequential_requests_are_exact(default_np, smollm2, smollm2_draft, tmp_path):
    spec, plain = default_np
    recs = []
    for k, body in enumerate(_concurrent_bodies()):
        s = _record(spec, "/completion", body)
        rep = _check_recovered(s, _record(plain, "/completion", body), smollm2, tmp_path, f"sequential-{k}", spec_args=_spec(smollm2_draft))
        assert rep["numerics"]["cause"] is None and rep["summary"]["counts"]["ok"] >= 1
        recs.append(s)
    traced = _trace(recs, smollm2, tmp_path, "sequential", "-md", smollm2_draft)
    assert all(tr["reproduced"] is True for tr in traced)
    assert _trace(recs, smollm2, tmp_path, "sequential", "-md", smollm2_draft, "--workers", "2") == traced


MULTIBYTE = {
    "completion": ("/completion", {"prompt": "Voici une phrase en français, avec des accents : « Élodie",
                                   "n_predict": 40, "n_probs": 2}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                    "Écris une phrase en français avec des accents et un emoji 🌊."}],
                                      "max_tokens": 40, "logprobs": True, "top_logprobs": 2}),
    "v1-completions": ("/v1/completions", {"prompt": "Ça commence à être très élégant — déjà «", "max_tokens": 40,
                                           "logprobs": 2}),
}


@pytest.mark.parametrize("case", default_and_wide(MULTIBYTE, {"chat"}))
def test_streams_of_multibyte_text_align_on_chunk_boundaries(pair, smollm2, smollm2_draft, tmp_path, case):
    spec, plain = pair(smollm2)
    endpoint, body = MULTIBYTE[case]
    body = {**body, "temperature": 1.0, "seed": 51, "stream": True}
    s = _record(spec, endpoint, body)
    p = _record(plain, endpoint, body)
    assert any(ord(ch) > 127 for ch in "".join(str(e) for e in stream_objects(s)))
    _check_recovered(s, p, smollm2, tmp_path, f"stream-{case}", spec_args=_spec(smollm2_draft))
    tr = _trace(s, smollm2, tmp_path, f"stream-{case}", "-md", smollm2_draft)[0]
    assert tr["reproduced"] is True and tr["compared"], (tr["compared"], tr["notes"])
