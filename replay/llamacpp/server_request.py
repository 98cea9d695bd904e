"""What the server made of a request, asked of the server's own code (spec-replay-request).

A chat request's prompt, and the grammar a JSON schema, `response_format` or tool list becomes, are
built by llama-server's request parsing (tools/server/server-common.cpp:1265-1497
oaicompat_chat_params_parse, server-schema.cpp:251-285, common/chat.cpp, common/json-schema-to-grammar.cpp).
The response carries them only when it was recorded with the server's echo (`generation_settings`:
every /completion response, the OpenAI endpoints with "verbose": true). For the others, the helper
program our CMakeLists.txt builds in the llama.cpp tree (replay/llamacpp/native/server_request.cpp)
runs those functions, linked from that tree, on the recorded request and the server's recorded flags,
and prints the `llama_params` and the `generation_settings` the server would have produced.

Thin I/O: it finds the helper of the transcript's build and runs it; what its output means is judged
by the callers (reading/settings.py for the grammar, tokens/prompt_ids.py for the prompt).
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from replay.errors import TranscriptError
from replay.llamacpp.build import DEFAULT_PROFILE, REQUEST_HELPER, BuildSpec, find_built
from replay.settings.table import CHAT_TEMPLATE_FLAGS

# the recorded flags that change what the server makes of a request's prompt, grammar and stops
# (common/arg.cpp); the sampling values are not taken from the helper (it cannot read the model
# file's general.sampling.* defaults: common/common.cpp:1088 is static), so no sampling flag is passed
REQUEST_FLAGS = ("--grammar", "--grammar-file", "--json-schema", "--json-schema-file", "--reverse-prompt",
                 *CHAT_TEMPLATE_FLAGS)
PATH_FLAGS = ("--grammar-file", "--json-schema-file", "--chat-template-file")
TIMEOUT_S = 120


@dataclass(frozen=True)
class Helper:
    """A built spec-replay-request and the tree (build) it was linked from."""

    path: Path
    build: str  # "b11434", the tree's build label


@dataclass(frozen=True)
class Rendered:
    """One evaluation of the request: at a given clock and time zone (both None: the helper's own)."""

    now: float | None
    tz: str | None
    llama_params: dict | None
    generation_settings: dict | None
    error: str | None

    @property
    def prompt(self) -> str | None:
        p = (self.llama_params or {}).get("prompt")
        return p if isinstance(p, str) else None

    @property
    def echo_grammar(self) -> str | None:
        g = (self.generation_settings or {}).get("grammar")
        return g if isinstance(g, str) else None


def find_helper(build: int | None) -> Helper | None:
    """The helper of build `build` (its release-style tree, else its native one) if it is built
    here; with no build named, the default profile's (the version users report against)."""
    profile = f"b{build}" if build is not None else DEFAULT_PROFILE
    for spec in (BuildSpec(profile), BuildSpec(profile, cpu="native")):
        try:
            bins = find_built(spec)
        except (OSError, ValueError):
            bins = None
        if bins is not None and bins.request_helper is not None:
            return Helper(bins.request_helper, profile)
    return None


def helper_argv(helper: Helper, model: Path | str, flags: Mapping[str, Any] | None) -> list[str]:
    """The helper's command line: the model, then the recorded flags that shape a request
    (REQUEST_FLAGS), spelled as llama-server spells them. A flag naming a file on the server's
    machine that is not here is a TranscriptError.

    >>> helper_argv(Helper(Path("/h"), "b1"), "m.gguf", {"--reverse-prompt": ["A:", "B:"], "--jinja": True,
    ...             "--temp": 0.3})
    ['/h', '-m', 'm.gguf', '--reverse-prompt', 'A:', '--reverse-prompt', 'B:', '--jinja']
    """
    argv = [str(helper.path), "-m", str(model)]
    for flag, value in (flags or {}).items():
        if flag not in REQUEST_FLAGS or value is None or value is False:
            continue
        if flag in PATH_FLAGS and not Path(str(value)).is_file():
            raise TranscriptError(f"the server was started with {flag} {value}, which is not on this machine; "
                                  "give it at the same path, or record with `spec-replay record`")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def render_request(helper: Helper, model: Path | str, flags: Mapping[str, Any] | None, endpoint: str,
                   body: Mapping[str, Any], renders: Sequence[tuple[float | None, str | None]] = ((None, None),)
                   ) -> list[Rendered]:
    """Run the server's request parsing on `body` once per (now, tz) in `renders`. A request the
    server refuses comes back with `error` set (what the server would have answered); a helper that
    cannot run is a TranscriptError."""
    argv = helper_argv(helper, model, flags)
    req = {"endpoint": endpoint, "body": body,
           "renders": [{k: v for k, v in (("now", now), ("tz", tz)) if v is not None} for now, tz in renders]}
    env = {**os.environ, "LLAMA_LOG_VERBOSITY": "-1"}
    try:
        p = subprocess.run(argv, input=json.dumps(req), capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TranscriptError(f"{REQUEST_HELPER} ({helper.build}) did not run: {e}") from e
    if p.returncode != 0:
        last = next((ln for ln in reversed(p.stderr.splitlines()) if ln.strip()), f"exit {p.returncode}")
        raise TranscriptError(f"{REQUEST_HELPER} ({helper.build}) failed: {last}")
    try:
        results = json.loads(p.stdout.strip().splitlines()[-1])["results"]
    except (ValueError, KeyError, IndexError) as e:
        raise TranscriptError(f"{REQUEST_HELPER} ({helper.build}) printed no results") from e
    return [Rendered(r.get("now"), r.get("tz"), r.get("llama_params"), r.get("generation_settings"), r.get("error"))
            for r in results]
