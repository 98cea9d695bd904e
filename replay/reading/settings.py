"""How the server ran a recorded request: its effective sampling settings, grammar and limits.

    eff = request_settings(rec, asked(rec), flags=ours, model_meta=target.meta)

Settings come from the layers of settings/sampling.py: the transcript's server flags and /props,
the model file, the request, and the response's own echo (`generation_settings`: every
/completion response has it; the OpenAI endpoints only with `"verbose": true`, which
`spec-replay record` adds: transcripts/request.py generation_echo).

Grammars (tools/server/server-schema.cpp:251-382, server-common.cpp:1293-1443): the server turns
`grammar`, `json_schema`, `response_format` and tool definitions into one GBNF grammar, lazy or not,
with trigger words, patterns and tokens. The echo carries the grammar the server built; without it
the caller may pass what the server's own request parsing builds (`rebuilt`: tokens/server_view.py,
run in the transcript's llama.cpp tree); with neither, only a request's own GBNF `grammar` can be
replayed, and the rest is refused by name.
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from replay.errors import TranscriptError
from replay.settings.sampling import Effective, Grammar, check_echo, effective, server_sampling
from replay.settings.table import unreplayed
from replay.transcripts.readers import CHAT, Record
from replay.transcripts.request import Asked

# common_grammar_trigger_type (common/common.h:146-157)
TRIGGER_TOKEN, TRIGGER_WORD, TRIGGER_PATTERN, TRIGGER_PATTERN_FULL = 0, 1, 2, 3
_REASONING_FIELDS = ("reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget_message",
                     "reasoning_control", "thinking")


def request_settings(rec: Record, asked: Asked, *, flags: Mapping[str, Any] | None = None,
                     model_meta: Callable[[str], str | None] | None = None, command: str = "recover",
                     rebuilt: tuple[Mapping, str] | None = None, grammar: bool = True) -> Effective:
    """The effective sampling settings, grammar and limits of a recorded request (module docstring);
    `asked` is what the record says the server made of it (transcripts/request.py).
    A recorded flag or request field that `command` does not reproduce (settings.table: unreplayed) is a
    TranscriptError naming it. `rebuilt`: the generation_settings the server's own request parsing
    produced for a request it did not echo (tokens/server_view.py) and where they came from; its
    grammar is used where the server built one from the request. `grammar=False`: the sampling values
    only (a caller that needs no grammar)."""
    why = unreplayed(rec.flags, rec.request, command)
    if why is not None:
        raise TranscriptError(why)
    for key in _REASONING_FIELDS:
        if rec.request.get(key) not in (None, False):
            raise TranscriptError(f"the request sets \"{key}\": the server's reasoning-budget sampler cannot be "
                                  "replayed yet")
    echo = asked.echo
    defaults = server_sampling(flags=flags, recorded=rec.flags, props=rec.props, model_meta=model_meta)
    if echo is not None:
        try:
            check_echo(echo)
        except ValueError as e:
            raise TranscriptError(str(e)) from e
    eff = effective(rec.endpoint, rec.request, defaults, echo=echo)
    if not grammar:
        return eff
    built, source = _grammar(rec, asked, defaults, rebuilt)
    if built is None:
        return eff
    return replace(eff, grammar=built, sources={**eff.sources, "grammar": source})


def regex_escape(word: str) -> str:
    """common/common.cpp:527-530: escape . ^ $ | ( ) * + ? [ ] { } and backslash."""
    return re.sub(r"([.^$|()*+?\[\]{}\\])", r"\\\1", word)


def _triggers(raw: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Trigger patterns and tokens as common_sampler_init maps them (common/sampling.cpp:225-259)."""
    patterns: list[str] = []
    tokens: list[int] = []
    for t in raw or []:
        if not isinstance(t, dict):
            raise TranscriptError("\"grammar_triggers\" must be a list of objects")
        kind, value, token = t.get("type"), t.get("value", ""), t.get("token")
        if not isinstance(value, str):
            raise TranscriptError("a grammar trigger's \"value\" must be a string")
        if kind == TRIGGER_TOKEN:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise TranscriptError(f"a token grammar trigger needs a token id, not {token!r}")
            tokens.append(token)
        elif kind == TRIGGER_WORD:
            patterns.append(regex_escape(value))
        elif kind == TRIGGER_PATTERN:
            patterns.append(value)
        elif kind == TRIGGER_PATTERN_FULL:
            anchored = "^$"
            if value:
                anchored = ("" if value.startswith("^") else "^") + value + ("" if value.endswith("$") else "$")
            patterns.append(anchored)
        else:
            raise TranscriptError(f"unknown grammar trigger type {kind!r}")
    return tuple(patterns), tuple(tokens)


def _kind(rec: Record, defaults: Mapping) -> str:
    """common_grammar_type: which grammar the server built (it is not echoed). A chat request's schema,
    response_format or tools become a tool_calls grammar (server-common.cpp:1429-1443); on the
    completion endpoints `grammar` wins over `json_schema` (server-schema.cpp:251-285)."""
    body = rec.request
    if rec.endpoint == CHAT:
        if body.get("grammar"):
            return "user"
        return "tool_calls"
    if "grammar" in body:
        return "tool_calls" if body.get("grammar_type") == "tool_calls" else "user"
    if body.get("json_schema") is not None:
        return "output_format"
    return "output_format" if defaults.get("json_schema", (None,))[0] else "user"


def _echo_grammar(rec: Record, echo: Mapping, defaults: Mapping) -> Grammar | None:
    text = echo.get("grammar")
    if not text:
        return None
    if not isinstance(text, str):
        raise TranscriptError("\"generation_settings.grammar\" must be a string")
    patterns, tokens = _triggers(echo.get("grammar_triggers"))
    return Grammar(text, _kind(rec, defaults), bool(echo.get("grammar_lazy")), patterns, tokens,
                   echo.get("generation_prompt") or "")


def _grammar(rec: Record, asked: Asked, defaults: Mapping,
             rebuilt: tuple[Mapping, str] | None = None) -> tuple[Grammar | None, str]:
    body, echo = rec.request, asked.echo
    if echo is not None:
        text = echo.get("grammar")
        if not text:
            return None, "generation_settings"
        return _echo_grammar(rec, echo, defaults), "generation_settings"
    built = asked.grammar_from
    if built and rebuilt is not None:
        return _echo_grammar(rec, rebuilt[0], defaults), rebuilt[1]
    if built:
        head = f"the server built a grammar from the request's {', '.join(built)}, and the response does not carry it"
        raise TranscriptError(f"{head}: record with `spec-replay record`, or `spec-replay build` the server's build"
                              ).with_detail(
            f"{head} (only /completion responses, and the others with \"verbose\": true, echo it): record with "
            "`spec-replay record`, which asks for it, or build the transcript's llama.cpp with `spec-replay build` so "
            "its own request parsing rebuilds it")
    if isinstance(body.get("grammar"), str) and body["grammar"]:
        if body.get("grammar_lazy"):
            patterns, tokens = _triggers(body.get("grammar_triggers"))
            return Grammar(body["grammar"], _kind(rec, defaults), True, patterns, tokens), "request"
        return Grammar(body["grammar"], _kind(rec, defaults)), "request"
    for attr in ("json_schema", "json_schema_file"):
        if defaults.get(attr, (None,))[0]:
            raise TranscriptError(f"the server was started with a JSON schema (--{attr.replace('_', '-')}) and the "
                                  "response does not carry the grammar it built: record with `spec-replay record`")
    text, source = defaults.get("grammar", (None, "default"))
    if not text and defaults.get("grammar_file", (None,))[0]:
        path = Path(defaults["grammar_file"][0])
        try:
            text, source = path.read_text(encoding="utf-8"), defaults["grammar_file"][1]
        except OSError as e:
            raise TranscriptError(f"cannot read the server's --grammar-file {path}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise TranscriptError(f"the server's --grammar-file {path} is not UTF-8 text") from e
    return (Grammar(text, "user"), source) if text else (None, "default")
