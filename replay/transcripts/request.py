"""What the record says the server made of its request, read from the record alone (pure): the settings
the server echoed for it, the request fields from which the server builds a grammar itself, and the
server's build. reading/ turns these into the effective settings, grammar and prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

from replay.builds.loop_shapes import build_of
from replay.transcripts.readers import CHAT, Record


@dataclass(frozen=True)
class Asked:
    """What the record says the server made of its request (asked)."""

    echo: dict | None  # the generation_settings it echoed (generation_echo), None: none
    grammar_from: tuple[str, ...]  # the request fields it built a grammar from (builds_grammar)
    build: int | None  # its build number, by its build_info or system_fingerprint (None: not said)


def asked(rec: Record) -> Asked:
    """Read once what the record says of the server's handling of its request."""
    return Asked(generation_echo(rec), tuple(builds_grammar(rec)), build_of(rec.server_build))


def generation_echo(rec: Record) -> dict | None:
    """The settings the server echoed for this request (task_params::to_json, server-task.cpp:95-144):
    /completion's generation_settings, or the `__verbose` copy the OpenAI endpoints add on request."""
    objs = [rec.final()] if not rec.stream else list(reversed(rec.chunks()))
    for obj in objs:
        if not isinstance(obj, dict):
            continue
        for holder in (obj, obj.get("__verbose")):
            echo = holder.get("generation_settings") if isinstance(holder, dict) else None
            if isinstance(echo, dict):
                return echo
    return None


def builds_grammar(rec: Record) -> list[str]:
    """The request fields from which the server builds a grammar itself (its JSON schema,
    response_format, tools; server-common.cpp:1293-1320, server-schema.cpp:251-285): what is not in the
    transcript unless the response echoes it. A /completion request's own `grammar` wins over them."""
    body = rec.request
    built = [k for k in ("json_schema", "response_format", "tools") if body.get(k)]
    fmt = body.get("response_format")
    if not (isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")):
        built = [k for k in built if k != "response_format"]  # "text" builds none; /completion ignores it
    if rec.endpoint != CHAT and body.get("grammar"):
        return []
    return built
