"""The server's own request parsing (spec-replay-request) rebuilds what a bare transcript lacks.

Eval harnesses record chat requests without the server's echo and without prompt ids. Then the
grammar a JSON schema, `response_format` or a tool list became, and the chat prompt itself, are not in
the file. spec-replay runs llama-server's own functions for them (oaicompat_chat_params_parse,
eval_llama_cmpl_schema, json_schema_to_grammar, the chat templates: native/server_request.cpp,
linked from the b11434 tree the server was built from). These tests hold its output against what a
live b11434 server echoes for the same requests, over a corpus of schemas, and then recover bare
transcripts from a speculating server through it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import one_error, run
from field_helpers import check_recovered, record, settings_of, spec_args

from replay.errors import ServerError
from replay.llamacpp.http import post_json
from replay.llamacpp.process import ServerConfig
from replay.llamacpp.server_request import Helper, render_request
from replay.transcripts.format import dumps

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

# types, enums, nested objects, arrays with min/max items, patterns, $ref, additionalProperties, ...
CORPUS = {
    "empty": {},
    "string": {"type": "string"},
    "integer-range": {"type": "integer", "minimum": -5, "maximum": 1200},
    "number": {"type": "number", "exclusiveMinimum": 0},
    "boolean-null": {"type": ["boolean", "null"]},
    "enum": {"enum": ["red", "green", 3, None]},
    "const": {"const": {"a": 1}},
    "object-required": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                         "city": {"type": "string"}}, "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name"]}}},
    "array-min-max": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5},
    "tuple": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}]},
    "refused": {"type": "array", "items": False},  # b11434 refuses it: "schema must be an object"
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,4}$"},
    "formats": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                                 "u": {"type": "string", "format": "uuid"},
                                                 "t": {"type": "string", "format": "date-time"}}},
    "ref": {"type": "object", "properties": {"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}},
            "$defs": {"addr": {"type": "object", "properties": {"street": {"type": "string"},
                                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                               "required": ["street"]}}},
    "additional-schema": {"type": "object", "properties": {"id": {"type": "integer"}},
                          "additionalProperties": {"type": "number"}},
    "additional-false": {"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": False},
    "any-of": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"x": {"type": "number"}}}]},
    "one-of-all-of": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                                {"type": "object", "properties": {"b": {"oneOf": [{"type": "integer"},
                                                                                  {"const": "none"}]}}}]},
}
PERSON = "Describe a fictional person as JSON."


@pytest.fixture(scope="module")
def helper(b11434) -> Helper:
    assert b11434.request_helper is not None, "the b11434 build has no spec-replay-request"
    return Helper(b11434.request_helper, "b11434")


def _server_echo(url: str, endpoint: str, body: dict) -> dict:
    r = post_json(url, endpoint, {**body, "verbose": True})
    return r["generation_settings"] if endpoint == "/completion" else r["__verbose"]["generation_settings"]


GRAMMAR_KEYS = ("grammar", "grammar_lazy", "grammar_triggers", "preserved_tokens", "generation_prompt", "stop",
                "chat_format")


@pytest.mark.parametrize("endpoint", ["/completion", "/v1/chat/completions"])
def test_every_schema_in_the_corpus_becomes_the_grammar_the_server_echoes(start_server, smollm2, helper, endpoint):
    srv = start_server(ServerConfig(smollm2))
    for name, schema in CORPUS.items():
        if endpoint == "/completion":
            body = {"prompt": PERSON, "json_schema": schema, "n_predict": 1}
        else:
            body = {"messages": [{"role": "user", "content": PERSON}], "max_tokens": 1,
                    "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}
        ours = render_request(helper, smollm2, srv.config.flags_block(), endpoint, body)[0]
        try:
            echo = _server_echo(srv.url, endpoint, body)
        except ServerError as e:  # the server refuses the schema: so must its own parsing, in its words
            assert ours.error is not None and ours.error.splitlines()[-1] in str(e), (name, ours.error, str(e))
            continue
        assert echo["grammar"], f"{name}: the server built no grammar"
        assert ours.error is None, f"{name}: {ours.error}"
        for key in GRAMMAR_KEYS:
            assert ours.generation_settings.get(key) == echo.get(key), f"{name}: {key} differs"


def test_the_chat_prompt_is_the_one_the_server_evaluated(start_server, smollm2, helper):
    from replay.runtime.llama import Model
    srv = start_server(ServerConfig(smollm2))
    model = Model(smollm2)
    try:
        for messages in ([{"role": "user", "content": "Hi"}],
                         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  Why? \n"}]):
            body = {"messages": messages, "max_tokens": 1, "return_tokens": True}
            r = post_json(srv.url, "/v1/chat/completions", {**body, "verbose": True})
            ours = render_request(helper, smollm2, srv.config.flags_block(), "/v1/chat/completions", body)[0]
            assert ours.prompt == r["__verbose"]["prompt"]
            ids = model.tokenize(ours.prompt, add_special=True, parse_special=True)
            assert len(ids) == r["usage"]["prompt_tokens"]
    finally:
        model.close()


def _bare(t: dict) -> dict:
    """What an eval harness keeps: the request and the response without the server's echo or ids."""
    t = json.loads(json.dumps(t))
    t["response"].pop("__verbose", None)
    t.pop("prompt_tokens", None)
    return t


SCHEMA = CORPUS["object-required"]


@pytest.mark.parametrize("temp", [0.0, 1.0], ids=["greedy", "t1"])
def test_a_bare_chat_transcript_with_a_json_schema_is_recovered(start_server, smollm2, smollm2_draft, tmp_path,
                                                                temp):
    spec = start_server(ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",)))
    plain = start_server(ServerConfig(smollm2))
    body = {"messages": [{"role": "user", "content": PERSON + " Give name, age and city."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
            "max_tokens": 64, "logprobs": True, "top_logprobs": 2, "temperature": temp, "seed": 31}
    s, p = record(spec, "/v1/chat/completions", body), record(plain, "/v1/chat/completions", body)
    rep = check_recovered(_bare(s), p, smollm2, tmp_path, f"bare-schema-{temp:g}", spec_args=spec_args(smollm2_draft))
    assert any("own request parsing" in n for n in rep["notes"]), rep["notes"]
    assert settings_of(rep)["--grammar"][1].startswith("b11434's own request parsing")


def test_a_template_that_reads_the_date_is_rebuilt_where_it_does_not_use_it_and_refused_where_it_does(
        start_server, b11434, smollm2, smollm2_draft, tmp_path):
    """Granite 3.3's template puts today's date (strftime_now) in its default system message only: a
    request with its own system message is rebuilt (this was refused while any mention of a date
    was), one without is refused, as is Llama 3.1's, which prints the server's `date_string`. The day
    depends on the server's time zone, and two neighbouring days give prompts of the same length:
    refused by name, never guessed."""
    templates = Path(b11434.manifest["source"]) / "models" / "templates"
    ask = {"role": "user", "content": "Name three rivers."}
    cases = [("ibm-granite-granite-3.3-2B-Instruct.jinja", [{"role": "system", "content": "Be brief."}, ask], True),
             ("ibm-granite-granite-3.3-2B-Instruct.jinja", [ask], False),
             ("meta-llama-Llama-3.1-8B-Instruct.jinja", [ask], False)]
    servers = {}
    for k, (name, messages, ok) in enumerate(cases):
        args = ("--jinja", "--chat-template-file", str(templates / name))
        if name not in servers:
            servers[name] = start_server(ServerConfig(smollm2, draft_model=smollm2_draft,
                                                      spec_types=("draft-simple",), extra_args=args))
        body = {"messages": messages, "max_tokens": 32, "logprobs": True, "top_logprobs": 2, "temperature": 1.0,
                "seed": 5}
        s = _bare(record(servers[name], "/v1/chat/completions", body))
        s["server"]["flags"].update({"--jinja": True, "--chat-template-file": str(templates / name)})
        src, out = tmp_path / f"{k}.json", tmp_path / f"{k}.out.json"
        src.write_text(dumps(s))
        r = run("recover", src, "-m", smollm2, "-o", out, "--json")
        if ok:
            assert r.exit_code == 0, r.output
            rep = json.loads(r.stdout)["records"][0]
            assert any("does not read the date" in n for n in rep["notes"]), rep["notes"]
            assert rep["summary"]["counts"]["placeholder"] > 0 and rep["summary"]["counts"]["mismatch"] == 0
        else:
            err = one_error(r)
            assert "reads the date" in err and "time zone is not known" in err, err
            assert not out.exists()


def test_template_kwargs_are_rendered_as_the_server_rendered_them(start_server, b11434, smollm2, smollm2_draft,
                                                                 tmp_path):
    """Qwen3's template closes an empty think block when the request sets enable_thinking false
    (chat_template_kwargs): a different prompt from the same messages. Refused while prompts were
    rebuilt with Jinja2; rendered by the server's own code now, and every filled value is the
    unspeculated server's."""
    template = Path(b11434.manifest["source"]) / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
    args = ("--jinja", "--chat-template-file", str(template))
    spec = start_server(ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",),
                                     extra_args=args))
    plain = start_server(ServerConfig(smollm2, extra_args=args))
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 48,
            "logprobs": True, "top_logprobs": 2, "temperature": 1.0, "seed": 12,
            "chat_template_kwargs": {"enable_thinking": False}}
    flags = {"--jinja": True, "--chat-template-file": str(template)}
    helper = Helper(b11434.request_helper, "b11434")
    off, on = (render_request(helper, smollm2, flags, "/v1/chat/completions",
                              {**body, "chat_template_kwargs": {"enable_thinking": v}})[0].prompt for v in (False, True))
    assert off != on and "</think>" in off, (off, on)
    s, p = record(spec, "/v1/chat/completions", body), record(plain, "/v1/chat/completions", body)
    s = _bare(s)
    s["server"]["flags"].update(flags)
    rep = check_recovered(s, p, smollm2, tmp_path, "kwargs", spec_args=spec_args(smollm2_draft))
    assert any("own request parsing" in n for n in rep["notes"]), rep["notes"]
