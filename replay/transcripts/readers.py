"""Read every transcript layout users have into `Record`s.

A file holds one of:

    our transcript            {"format": "spec-replay-transcript", ...}     (JSON, or JSONL of them)
    a request/response pair   {"request": {...}, "response": <body | [chunks] | "data: ...">}
    a bare response           a body, a list of SSE chunk objects, or SSE text (`data:` lines),
                              with the request given separately (--request FILE)

and responses come from `/v1/chat/completions`, `/v1/completions` or `/completion`,
non-stream or stream, including OpenAI-SDK `model_dump_json()` dumps (which add
null-valued fields the server never sent). Detection looks at the structure,
never at the file name; whatever cannot be read raises TranscriptError naming
the file, the record and why.

Where the responses say when they were made (`created`, `timings`), `shared_evidence` tells which
records certainly ran at the same time, so shared their batches (the section "When records ran").

A Record holds the parsed objects as read; nothing downstream changes them. The repair pass
(report/repair.py) builds its output from copies, placed back into the file's own layout.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from replay.errors import TranscriptError, json_error
from replay.settings import check_props, idle_cells_kept, recorded_flags, resolve
from replay.transcripts.format import CHAT, CMPL, FORMAT, NATIVE, VERSION


@dataclass(frozen=True)
class Record:
    """One request and its response, normalised (read-only: see the module docstring)."""

    source: str
    index: int  # 1-based record number within the file
    endpoint: str
    request: dict
    stream: bool
    response: dict | None = None  # non-stream body (the very object inside `container`)
    events: list[Any] | None = None  # stream chunks: dicts, or "[DONE]" strings
    prompt_ids: list[int] | None = None
    build_info: str | None = None
    flags: dict | None = None  # the server's flags by llama-server's spelling (server.flags, from `record`)
    props: dict | None = None  # the server's GET /props when `record` sent the request
    snapshot_slots: list | None = None  # the server's GET /slots just before the request
    models_meta: dict | None = None  # the server's GET /v1/models data[0].meta (size, n_params), where recorded
    ran_with: int | None = None  # other generation requests the recorder had at the server while it ran (proxy)
    container: Any = None  # the record's top-level object: the transcript / pair / bare response
    events_as: str = "objects"  # how events are stored in the container: objects | strings | sse-text

    @property
    def where(self) -> str:
        return f"{self.source}, record {self.index}"

    def chunks(self) -> list[dict]:
        return [e for e in (self.events or []) if isinstance(e, dict)]

    def slots(self, n_parallel: int | None = None) -> int | None:
        """How many slots the server ran: /props total_slots, else `n_parallel` (our -np) or the
        recorded --parallel (b11434's default, -1, is 4), else None when nothing says."""
        total = (self.props or {}).get("total_slots")
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return total
        n = n_parallel if n_parallel is not None else (self.flags or {}).get("--parallel")
        if isinstance(n, int) and not isinstance(n, bool):
            return 4 if n < 1 else n
        return None

    @property
    def server_build(self) -> str | None:
        """The server's build_info: the recorded one (/props), else the OpenAI endpoints' system_fingerprint."""
        return self.build_info or fingerprint(self)

    def busy_when_sent(self) -> str | None:
        """What in the record itself shows that the server decoded it in batches shared with other
        requests, or None: another slot busy in the /slots snapshot taken before it, or other requests the
        proxy had at a server of several slots while it ran (`ran_with`). A slot count above
        one, or a response from slot 3, is no such evidence: a lone request on a fresh default-flag
        server (4 slots) runs alone, on whichever slot it gets (`overlapping`: records that overlap in
        time are the other evidence)."""
        if self.other_slot_busy():
            return "another slot was busy when it was sent (/slots)"
        if self.ran_with and self.slots() != 1:  # one slot runs one request at a time: the others queued
            n = self.ran_with
            return f"the proxy had {n} other request{'s' if n > 1 else ''} at the server while it ran"
        return None

    def other_slot_busy(self) -> bool:
        """Whether the /slots snapshot taken before the request shows a slot processing while the server
        has another: on a one-slot server (one slot listed, or the slot count says one) the busy slot is
        the one the request waits for, and it then runs alone (b11434 tools/server/server-context.cpp:2610-2612:
        with no slot free the task is deferred until one is)."""
        listed = [s for s in (self.snapshot_slots or []) if isinstance(s, dict)]
        if len(listed) == 1 or self.slots() == 1:
            return False
        return any(s.get("is_processing") for s in listed)

    def several_slots(self, n_parallel: int | None = None) -> str | None:
        """The server's slot count where it had several, as words (a possibility to name, not evidence of
        shared batches: busy_when_sent), or None."""
        n = self.slots(n_parallel)
        if n is None or n <= 1:
            return None
        where = ("/props total_slots" if isinstance((self.props or {}).get("total_slots"), int)
                 else "-np" if n_parallel is not None else "the recorded --parallel")
        return f"a {n}-slot server ({where})"

    def slot_id(self, n_parallel: int | None = None) -> int | None:
        """The server slot that served the request: the response's id_slot (native endpoints), 0 on a
        one-slot server, else None (unknown)."""
        for obj in [self.response] + self.chunks()[::-1]:
            sid = (obj or {}).get("id_slot")
            if isinstance(sid, int) and not isinstance(sid, bool) and sid >= 0:
                return sid
        return 0 if self.slots(n_parallel) == 1 else None

    def final(self) -> dict | None:
        """The object carrying usage/timings."""
        if not self.stream:
            return self.response
        for e in reversed(self.chunks()):
            if "usage" in e and e["usage"] or "timings" in e or "tokens_evaluated" in e:
                return e
        return None


# When records ran. Which records of a transcript the server certainly ran at the same time, from what
# their responses say: `created` (the OpenAI endpoints' Unix second at which the response was made,
# tools/server/server-task.cpp:394, 442) and `timings` (prompt_ms + predicted_ms: how long the slot
# worked on it, server-task.cpp timings). Pure.
#
# A response made in second `c` ended at some e in [c, c + 1); a request that took `d` seconds ran
# during [e - d, e]. Record j could have run wholly apart from record i (ended at e) only by ending
# before i began (possible iff c_j <= e - d_i) or by beginning after i ended (possible iff
# c_j + 1 - d_j > e). So j certainly ran with i for every e in [c_j + 1 - d_j, c_j + d_i); if those
# ranges, over all the other records, cover all of [c_i, c_i + 1), i certainly ran with one of them,
# whatever the true ends: its batches were shared (a server with one slot runs one request at a time,
# so overlapping records also show several slots). Short requests in different seconds show nothing:
# this is evidence only where it is certain, never a guess from closeness.

def run_time(rec: Record) -> tuple[int, float] | None:
    """(created, seconds): the Unix second the record's response was made in and how long the server's
    slot worked on it (prompt_ms + predicted_ms), or None where the response does not say.

    >>> r = Record("f", 1, "/v1/chat/completions", {}, False,
    ...            response={"created": 100, "timings": {"prompt_ms": 200.0, "predicted_ms": 1700.0}})
    >>> run_time(r)
    (100, 1.9)
    """
    final = rec.final() or {}
    created, timings = final.get("created"), final.get("timings")
    if not isinstance(created, int) or isinstance(created, bool) or not isinstance(timings, dict):
        return None
    parts = [timings.get("prompt_ms"), timings.get("predicted_ms")]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in parts):
        return None
    return created, round(sum(parts) / 1000.0, 6)


def ran_with(mine: tuple[int, float], others: Mapping[int, tuple[int, float]]) -> tuple[list[int], list[int]]:
    """(records that certainly ran with this one, records one of which certainly did): the first where
    a single record's range of ends covers all of this one's second, the second where only together they
    do (both empty where nothing is certain). `others`: {record index: run_time}.

    >>> ran_with((100, 1.5), {2: (100, 1.5), 3: (105, 4.0)})     # same second, both over a second
    ([2], [])
    >>> ran_with((100, 1.5), {2: (101, 1.5), 5: (99, 1.5)})      # neither alone; one of them whatever the ends
    ([], [2, 5])
    >>> ran_with((100, 1.5), {2: (101, 1.5)})                    # it may have ended before record 2 began
    ([], [])
    """
    c, d = mine
    cover = sorted((max(float(c), cj + 1 - dj), min(c + 1.0, cj + d), j)
                   for j, (cj, dj) in others.items())
    cover = [(lo, hi, j) for lo, hi, j in cover if lo < hi]
    whole = sorted(j for lo, hi, j in cover if lo <= c and hi >= c + 1)
    if whole:
        return whole, []
    reach = float(c)
    for lo, hi, _ in cover:
        if lo > reach:
            break
        reach = max(reach, hi)
    return [], (sorted(j for _, _, j in cover) if reach >= c + 1 else [])


def overlapping(records: Sequence[Record]) -> dict[int, str]:
    """{record index: the evidence, naming the records it certainly ran with} for every record that
    certainly overlapped another (ran_with).

    >>> mk = lambda i, c: Record("f", i, "/v1/chat/completions", {}, False,
    ...                          response={"created": c, "timings": {"prompt_ms": 150.0, "predicted_ms": 1750.0}})
    >>> overlapping([mk(1, 213), mk(2, 213), mk(3, 215)])
    {1: 'it ran at the same time as record 2 (their created and timings overlap)', 2: 'it ran at the same time as record 1 (their created and timings overlap)'}
    """
    timed = {r.index: t for r in records if (t := run_time(r)) is not None}
    out: dict[int, str] = {}
    for i, mine in timed.items():
        whole, some = ran_with(mine, {j: t for j, t in timed.items() if j != i})
        with_ = whole or some
        if with_:
            names = ", ".join(map(str, with_[:4])) + (f" and {len(with_) - 4} more" if len(with_) > 4 else "")
            plural = "s" if len(with_) > 1 else ""
            which = f"record{plural} {names}" if whole else f"one of records {names}"
            out[i] = f"it ran at the same time as {which} (their created and timings overlap)"
    return out


def shared_evidence(records: Sequence[Record], flags: Mapping[str, Any] | None, option: bool, *,
                    cells: bool = True) -> dict[int, str]:
    """{record index: why its decodes may have seen other requests' rows or cells} for every record where
    something shows it: the record itself (Record.busy_when_sent: another slot busy in /slots), the
    records it overlapped in time, a server whose flags keep idle slots' cells in a unified cache
    (settings/config.py idle_cells_kept; `flags`: ours by attr, over the record's own), or the user's
    --shared-batches (`option`). A slot count or a slot id alone shows nothing: a lone request on a
    4-slot server runs alone, and by default the server clears idle slots when a task starts. `cells`
    False: only what shares batches (kept cells change values, not the batches, the drafts' timing or
    the server's speed)."""
    overlaps = overlapping(records)
    out = {}
    for rec in records:
        # --shared-batches says nothing of a record its server decoded alone by construction: one slot
        # (/props total_slots, -np 1) runs one request at a time
        alone = rec.slots((flags or {}).get("n_parallel")) == 1
        why = rec.busy_when_sent() or overlaps.get(rec.index) or (_cells_kept(rec, flags) if cells else None) or (
            "--shared-batches" if option and not alone else None)
        if why:
            out[rec.index] = why
    return out


def _cells_kept(rec: Record, flags: Mapping[str, Any] | None) -> str | None:
    try:
        return idle_cells_kept(resolve("context", flags=flags, recorded=rec.flags, props=rec.props), rec.flags)
    except ValueError:  # a value llama-server would not take: the record's own reading says so in one line
        return None


def fingerprint(rec: Record) -> str | None:
    """The OpenAI endpoints' system_fingerprint (the server's build_info), if the response has a text one."""
    v = (rec.final() or {}).get("system_fingerprint")
    return v if isinstance(v, str) else None


# --- file level ----------------------------------------------------------------

def read_source(path: Path | str) -> str:
    """A transcript file's text; unreadable or non-UTF-8 files are a TranscriptError naming the file."""
    src = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise TranscriptError(f"cannot read: {e.strerror}", source=src) from e
    return decode_text(raw, src)


def decode_text(raw: bytes, source: str) -> str:
    """A file's bytes as text; anything but UTF-8 is a TranscriptError naming the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TranscriptError(f"not UTF-8 text (byte {e.start})", source=source) from e


def read_file(path: Path | str, request: dict | None = None) -> list[Record]:
    """Every record in a file; `request` pairs with a bare response."""
    return read_text(read_source(path), str(path), request)


def read_text(text: str, source: str, request: dict | None = None) -> list[Record]:
    stripped = text.lstrip()
    if not stripped:
        raise TranscriptError("the file is empty", source=source)
    if stripped.startswith("data:") or stripped.startswith(":"):
        return [_record(parse_sse_text(text, source), source, 1, request, events_as="sse-text")]
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise TranscriptError("invalid JSON (nested too deeply)", source=source) from None
    except ValueError as whole:
        lines = [l for l in text.splitlines() if l.strip()]
        if len(lines) <= 1 or not _parses(lines[0]):
            # not JSONL: report where the whole document breaks
            raise TranscriptError(f"invalid JSON ({_why(whole)})", source=source) from whole
        out = []
        for n, line in enumerate(lines, start=1):
            try:
                item = json.loads(line, parse_constant=_reject_constant)
            except (ValueError, RecursionError) as e:
                raise TranscriptError(f"line {n}: invalid JSON ({_why(e)})", source=source) from e
            out.append(_record(item, source, n, request))
        return out
    return [_record(obj, source, 1, request)]


def _parses(line: str) -> bool:
    try:
        json.loads(line, parse_constant=_reject_constant)
        return True
    except (ValueError, RecursionError):
        return False


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _why(e: ValueError) -> str:
    return json_error(e)


def parse_sse_text(text: str, source: str) -> list[Any]:
    """The `data:` payloads of SSE text, decoded; `[DONE]` kept as a string."""
    events: list[Any] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(json.loads(payload, parse_constant=_reject_constant))
        except ValueError as e:
            raise TranscriptError(f"SSE line {n}: invalid JSON in data: ({_why(e)})", source=source) from e
    if not events:
        raise TranscriptError("no SSE data: lines", source=source)
    return events


# --- record level --------------------------------------------------------------

def _record(obj: Any, source: str, index: int, request: dict | None, events_as: str = "objects") -> Record:
    def fail(msg: str) -> TranscriptError:
        return TranscriptError(msg, source=source, record=index)

    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return _from_transcript(obj, source, index, fail)
    if isinstance(obj, dict) and "request" in obj and "response" in obj:
        req = obj["request"]
        if not isinstance(req, dict):
            raise fail("\"request\" must be a JSON object")
        resp = obj["response"]
        ev_as = "objects"
        if isinstance(resp, str):
            resp, ev_as = parse_sse_text(resp, source), "sse-text"
        rec = _from_response(resp, req, obj.get("endpoint"), source, index, fail)
        return replace(rec, container=obj, events_as=ev_as, prompt_ids=_ids(obj.get("prompt_tokens"), fail,
                                                                             "prompt_tokens"))
    if request is None:
        if isinstance(obj, (dict, list)) and _looks_like_response(obj):
            raise fail("a bare response: give the request that produced it with --request FILE")
        raise fail("unknown shape: not a spec-replay transcript, a {\"request\", \"response\"} pair, "
                   "or a chat/completions response")
    rec = _from_response(obj, request, None, source, index, fail)
    return replace(rec, container=obj, events_as=events_as)


def _from_transcript(t: dict, source: str, index: int, fail) -> Record:
    if t.get("version") != VERSION:
        raise fail(f"transcript version {t.get('version')!r} is not supported (this spec-replay reads {VERSION})")
    req = t.get("request")
    if not isinstance(req, dict):
        raise fail("transcript has no \"request\" object")
    if t.get("stream"):
        evs = t.get("events")
        if not isinstance(evs, list) or not all(isinstance(e, str) for e in evs):
            raise fail("stream transcript has no \"events\" list of strings")
        decoded: list[Any] = []
        for k, e in enumerate(evs):
            if e.strip() == "[DONE]":
                decoded.append("[DONE]")
                continue
            try:
                decoded.append(json.loads(e, parse_constant=_reject_constant))
            except ValueError as err:
                raise fail(f"event {k}: invalid JSON ({_why(err)})") from err
        resp: Any = decoded
    else:
        resp = t.get("response")
    rec = _from_response(resp, req, t.get("endpoint"), source, index, fail)
    server = t.get("server") or {}
    if not isinstance(server, dict):
        raise fail("\"server\" must be an object")
    props = server.get("props")
    if props is not None and not (isinstance(props, dict) and isinstance(props.get("default_generation_settings", {}), dict)):
        raise fail("\"server.props\" must be the server's /props object")
    flags, legacy = server.get("flags"), server.get("speculative")
    for name, block in (("flags", flags), ("speculative", legacy)):
        if block is not None and not isinstance(block, dict):
            raise fail(f"\"server.{name}\" must be an object")
    try:
        check_props(props)
        recorded = recorded_flags(flags, legacy)
    except ValueError as e:
        raise fail(str(e)) from e
    ran_with = t.get("ran_with")
    if ran_with is not None and not (isinstance(ran_with, int) and not isinstance(ran_with, bool) and ran_with >= 0):
        raise fail("\"ran_with\" must be a count of requests")
    return replace(rec, container=t, events_as="strings" if rec.stream else "objects", ran_with=ran_with,
                   prompt_ids=_ids(t.get("prompt_tokens"), fail, "prompt_tokens"),
                   build_info=server.get("build_info") if isinstance(server.get("build_info"), str) else None,
                   flags=recorded, props=props,
                   snapshot_slots=server.get("slots") if isinstance(server.get("slots"), list) else None,
                   models_meta=server.get("models_meta") if isinstance(server.get("models_meta"), dict) else None)


def _ids(v: Any, fail, name: str) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(_is_id(x) for x in v):
        raise fail(f"\"{name}\" must be a list of non-negative token ids")
    return list(v)


def _looks_like_response(obj: Any) -> bool:
    if isinstance(obj, list):
        return bool(obj) and all(isinstance(e, (dict, str)) for e in obj)
    return any(k in obj for k in ("choices", "completion_probabilities", "content", "tokens_predicted"))


def detect_endpoint(resp: Any, request: dict, hint: str | None) -> str | None:
    if hint in (CHAT, CMPL, NATIVE):
        return hint
    first = resp if isinstance(resp, dict) else next((e for e in resp if isinstance(e, dict)), {}) if isinstance(resp, list) else {}
    obj = first.get("object") if isinstance(first, dict) else None
    if obj in ("chat.completion", "chat.completion.chunk"):
        return CHAT
    if obj == "text_completion":
        return CMPL
    if isinstance(first, dict) and any(k in first for k in ("completion_probabilities", "tokens_predicted", "content", "stop")):
        return NATIVE
    if "messages" in request:
        return CHAT
    return None


def _from_response(resp: Any, request: dict, hint: str | None, source: str, index: int, fail) -> Record:
    if resp is None:
        raise fail("the response is missing (null)")
    if not isinstance(resp, (dict, list)):
        raise fail(f"the response must be a JSON object or a list of stream chunks, got {type(resp).__name__}")
    endpoint = detect_endpoint(resp, request, hint)
    if endpoint is None:
        raise fail("unknown response shape: not from /v1/chat/completions, /v1/completions or /completion")
    if isinstance(resp, dict) and "error" in resp and not resp.get("choices") and "content" not in resp:
        raise fail(f"the server answered an error: {str(resp['error'])[:200]}")
    if isinstance(resp, list):
        for k, e in enumerate(resp):
            if not (isinstance(e, dict) or e == "[DONE]"):
                raise fail(f"stream chunk {k} is not a JSON object")
            if isinstance(e, dict) and "error" in e:
                raise fail(f"stream chunk {k} is an error: {str(e['error'])[:200]}")
        rec = Record(source, index, endpoint, request, True, events=resp)
        _check_stream_complete(rec, fail)
    else:
        rec = Record(source, index, endpoint, request, False, response=resp)
        _check_body(rec, fail)
    return rec


def _check_counts(obj: dict, fail, where: str) -> None:
    """usage / timings / token counts, where present, must be the server's types."""
    for k in ("tokens_evaluated", "tokens_predicted"):
        if obj.get(k) is not None and not _is_id(obj[k]):
            raise fail(f"{where}: \"{k}\" must be a non-negative integer")
    for k in ("usage", "timings"):
        v = obj.get(k)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise fail(f"{where}: \"{k}\" must be an object")
        for f in ("prompt_tokens", "completion_tokens", "prompt_n", "predicted_n", "cache_n", "draft_n",
                  "draft_n_accepted"):
            if v.get(f) is not None and not _is_id(v[f]):
                raise fail(f"{where}: \"{k}.{f}\" must be a non-negative integer")


def _check_body(rec: Record, fail) -> None:
    r = rec.response
    assert r is not None
    _check_counts(r, fail, "the response")
    if rec.endpoint == NATIVE and r.get("tokens") is not None and not (
            isinstance(r["tokens"], list) and all(_is_id(t) for t in r["tokens"])):
        raise fail("\"tokens\" must be a list of token ids")
    if rec.endpoint == NATIVE:
        if not isinstance(r.get("content", ""), str):
            raise fail("\"content\" must be a string")
        entries = r.get("completion_probabilities")
    else:
        ch = r.get("choices")
        if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
            raise fail("the response has no choices")
        if len(ch) > 1:
            raise fail(f"{len(ch)} choices in one response: record them as separate requests (n=1)")
        lp = ch[0].get("logprobs")
        if lp is not None and not isinstance(lp, dict):
            raise fail("choices[0].logprobs must be an object (the server's chat-style logprobs)")
        entries = (lp or {}).get("content")
    if entries is not None:
        if not isinstance(entries, list):
            raise fail("the probability list must be a list")
        for k, e in enumerate(entries):
            _check_entry(e, fail, f"token {k}")


def _check_stream_complete(rec: Record, fail) -> None:
    chunks = rec.chunks()
    if not chunks:
        raise fail("the stream has no chunks")
    for k, c in enumerate(chunks):
        if rec.endpoint != NATIVE and "choices" in c and not (
                isinstance(c["choices"], list) and all(isinstance(x, dict) for x in c["choices"])):
            raise fail(f"stream chunk {k}: \"choices\" must be a list of objects")
        if rec.endpoint == CHAT:
            for x in c.get("choices") or []:
                if x.get("delta") is not None and not isinstance(x["delta"], dict):
                    raise fail(f"stream chunk {k}: \"delta\" must be an object")
        if rec.endpoint == NATIVE and c.get("tokens") is not None and not (
                isinstance(c["tokens"], list) and all(_is_id(t) for t in c["tokens"])):
            raise fail(f"stream chunk {k}: \"tokens\" must be a list of token ids")
        _check_counts(c, fail, f"stream chunk {k}")
        for e in _chunk_entries(rec.endpoint, c):
            _check_entry(e, fail, f"chunk {k}")
    last = chunks[-1]
    if rec.endpoint == NATIVE:
        ended = last.get("stop") is True
    else:
        choices = last.get("choices") or []
        ended = any(isinstance(c, dict) and c.get("finish_reason") for c in choices) or \
            any(isinstance(c, dict) and any(isinstance(x, dict) and x.get("finish_reason") for x in c.get("choices") or []) for c in chunks[-2:])
    if not ended:
        raise fail("the stream is truncated: its last chunk does not finish the response")


def entries_of(endpoint: str, obj: dict) -> list | None:
    """The probability entry list of a body or chunk (the very list object), or None if it has none.

        /completion            obj["completion_probabilities"]
        /v1/*                  obj["choices"][0]["logprobs"]["content"]
    """
    if endpoint == NATIVE:
        v = obj.get("completion_probabilities")
        return v if isinstance(v, list) else None
    ch = obj.get("choices")
    if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
        return None
    lp = ch[0].get("logprobs")
    if not isinstance(lp, dict):
        return None
    v = lp.get("content")
    return v if isinstance(v, list) else None


def _chunk_entries(endpoint: str, c: dict) -> list:
    return entries_of(endpoint, c) or []


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31


def _is_number(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _check_entry(e: Any, fail, where: str, top_level: bool = True) -> None:
    if not isinstance(e, dict):
        raise fail(f"{where}: a probability entry must be an object")
    tid = e.get("id")
    if tid is not None and not _is_id(tid):
        raise fail(f"{where}: token id {tid!r} is not a non-negative integer")
    b = e.get("bytes")
    if b is not None and not (isinstance(b, list) and all(_is_id(x) and x < 256 for x in b)):
        raise fail(f"{where}: \"bytes\" must be a list of byte values")
    if e.get("token") is not None and not isinstance(e.get("token"), str):
        raise fail(f"{where}: \"token\" must be a string")
    for key in ("logprob", "prob"):
        if key in e:
            v = e[key]
            if v is None and key == "logprob":
                continue  # SDK dumps can carry nulls
            if not _is_number(v):
                raise fail(f"{where}: {key} {v!r} is not a finite number")
            if (key == "logprob" and v > 1e-3) or (key == "prob" and not -1e-3 <= v <= 1 + 1e-3):
                raise fail(f"{where}: {key} {v!r} is not a probability")
    if "logprob" not in e and "prob" not in e:
        raise fail(f"{where}: a probability entry has neither logprob nor prob")
    if top_level:
        for key in ("top_logprobs", "top_probs"):
            top = e.get(key)
            if top is None:
                continue
            if not isinstance(top, list):
                raise fail(f"{where}: \"{key}\" must be a list")
            for k, t in enumerate(top):
                _check_entry(t, fail, f"{where}, {key}[{k}]", top_level=False)
