"""The prompt and grammar the server built for a request it did not echo, from its own code.

A record needs this when its chat prompt must be rebuilt from the messages (no recorded prompt ids),
or when the server built a grammar from the request's JSON schema, `response_format` or tools and
the response does not carry it. llamacpp/server_request.py runs the server's request parsing
(spec-replay-request, built in the transcript's llama.cpp tree); this module decides which of its
renderings is the server's:

- A template that does not read the date renders the same prompt on any day: it is rendered at the
  response's `created` time and 45 days later, and the two must agree.
- A template that does read it (strftime_now: common/jinja/value.cpp:422-431, in the server's local
  time zone, with the clock read when the request was parsed, common/chat.h:262) is rendered in every
  time zone from UTC-12 to UTC+14 (15-minute steps) at the start and the end of the request
  (`created` less the response's own timings). The distinct prompts are then judged by the prompt
  length the server reported: exactly one consistent prompt is the server's; more than one is
  refused by name (the day is ambiguous), never guessed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from replay.errors import TranscriptError
from replay.llamacpp.server_request import Helper, Rendered, find_helper, render_request
from replay.transcripts.entries import n_prompt
from replay.transcripts.readers import CHAT, Record
from replay.transcripts.request import Asked

LATER_S = 45 * 86400
TZ_STEP_MIN = 15
SLACK_S = 5.0


@dataclass(frozen=True)
class ServerView:
    """The server's own rendering of one request: `llama_params` (its prompt for a chat request)
    and the `generation_settings` it would have echoed; `how` says how the rendering was chosen."""

    rendered: Rendered
    helper: Helper
    how: str

    @property
    def prompt(self) -> str | None:
        return self.rendered.prompt

    @property
    def echo(self) -> dict | None:
        return self.rendered.generation_settings

    @property
    def source(self) -> str:
        return f"{self.helper.build}'s own request parsing ({self.how})"

    @property
    def rebuilt(self) -> tuple[dict, str]:
        """What request_settings takes as `rebuilt`: the echo and where it came from."""
        return self.echo or {}, self.source


def needs_view(rec: Record, asked: Asked) -> bool:
    """Whether the record's prompt or grammar must come from the server's code: a chat request without
    recorded prompt ids, or a request whose grammar the server built and did not echo."""
    if rec.endpoint == CHAT and rec.prompt_ids is None:
        return True
    return asked.echo is None and bool(asked.grammar_from)


def time_zones(step_min: int = TZ_STEP_MIN) -> list[str]:
    """POSIX TZ strings for every offset from UTC-12:00 to UTC+14:00 (POSIX counts west as positive).

    >>> z = time_zones(60); len(z), z[0], z[12], z[-1]
    (27, 'SRT+12:00', 'SRT+00:00', 'SRT-14:00')
    """
    out = []
    for m in range(-12 * 60, 14 * 60 + 1, step_min):
        west = -m
        sign = "+" if west >= 0 else "-"
        out.append(f"SRT{sign}{abs(west) // 60:02d}:{abs(west) % 60:02d}")
    return out


def request_window(rec: Record) -> tuple[float, float] | None:
    """When the server parsed the request: from the response's `created` (seconds, set when it
    answered) back over its own timings (prompt_ms + predicted_ms), with a few seconds' slack; None
    when the response carries no `created`."""
    final = rec.final() or {}
    created = final.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        return None
    t = final.get("timings") if isinstance(final.get("timings"), dict) else {}
    ms = sum(v for v in (t.get("prompt_ms"), t.get("predicted_ms")) if isinstance(v, (int, float)))
    return float(created) - ms / 1000.0 - SLACK_S, float(created) + 1.0


def helper_flags(rec: Record, flags: Mapping | None, model_template: str | None) -> dict:
    """The server's flags for the helper: the recorded ones under the user's, and, when they name no
    template but the server's /props reported one other than the model file's (a server started with
    a template the transcript did not record), that template, as `--chat-template` would give it.

    >>> from replay.transcripts.readers import Record
    >>> r = Record(source="t", index=0, endpoint="/v1/chat/completions", request={}, response={}, stream=False,
    ...            props={"chat_template": "{{ messages }}"})
    >>> helper_flags(r, None, None)
    {'--chat-template': '{{ messages }}'}
    >>> helper_flags(r, None, "{{ messages }}")
    {}
    """
    out = {**(rec.flags or {}), **(flags or {})}
    reported = (rec.props or {}).get("chat_template")
    named = any(f in out for f in ("--chat-template", "--chat-template-file"))
    if isinstance(reported, str) and reported and not named and reported != (model_template or ""):
        out["--chat-template"] = reported
    return out


def server_view(rec: Record, asked: Asked, model: Path | str, flags: Mapping | None,
                tokenize: Callable[[str], Sequence[int]], model_template: str | None = None,
                helper: Helper | None = None) -> ServerView | None:
    """The server's rendering of `rec` (module docstring), or None when the record needs none or no
    helper is built for its build. `tokenize` turns a prompt into the ids the server evaluated
    (add_special and parse_special, server-context.cpp:4650); `model_template` is the model file's
    own chat template (helper_flags)."""
    if not needs_view(rec, asked):
        return None
    flags = helper_flags(rec, flags, model_template)
    window = request_window(rec)
    if helper is None:
        helper = find_helper(asked.build)
        if helper is None:
            return None
    start = window[0] if window else time.time()
    first = render_request(helper, model, flags, rec.endpoint, rec.request, [(start, "UTC"), (start + LATER_S, "UTC")])
    if first[0].error is not None:
        raise TranscriptError(f"the server's own request parsing ({helper.build}) refuses this request: "
                              f"{first[0].error}")
    if first[0].prompt == first[1].prompt and first[0].echo_grammar == first[1].echo_grammar:
        return ServerView(first[0], helper, "the template does not read the date")
    if window is None:
        raise TranscriptError("the chat template reads the date and the response carries no \"created\" time to "
                              "tell the day the server ran: record with `spec-replay record` to keep the prompt's ids")
    zones = time_zones()
    renders = [(t, z) for z in zones for t in window]
    got = [r for r in render_request(helper, model, flags, rec.endpoint, rec.request, renders) if r.error is None]
    distinct: dict[str, Rendered] = {}
    for r in got:
        distinct.setdefault(r.prompt or "", r)
    reported = n_prompt(rec.endpoint, rec.final())
    fits = [r for r in distinct.values() if reported is None or len(tokenize(r.prompt or "")) == reported]
    if len(fits) == 1:
        return ServerView(fits[0], helper, f"the template reads the date; of the {len(distinct)} days it could "
                                           "have been in any time zone, one gives the prompt length the server reported")
    if not fits:
        raise TranscriptError(f"the chat template reads the date, and none of the {len(distinct)} prompts it renders "
                              f"on the days the server could have run has the {reported} tokens the server reported")
    raise TranscriptError(f"the chat template reads the date, and the server's time zone is not known: {len(fits)} "
                          "days it could have run give prompts of the length it reported; record with "
                          "`spec-replay record` to keep the prompt's ids")
