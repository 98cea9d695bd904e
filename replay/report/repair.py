"""The repair pass: a repaired copy of each record, built from the record as read and the
comparison, in the server's own field format and the file's own layout. The input is never
changed: the response (or the stream's events) is copied, values are filled and inserted in the
copy, and the copy is placed into a new top-level object.

Entries look like the server's (tools/server/server-task.cpp:264-300):

    pre-sampling   {"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token", "bytes", "logprob"}]}
    post-sampling  {"id", "token", "bytes", "prob",    "top_probs":    [{"id", "token", "bytes", "prob"}]}

`token` is the piece cut back to valid UTF-8 (validate_utf8), `bytes` the raw piece. Values are
float32 widened to double, which is how the server's JSON (nlohmann, double numbers) prints its
float fields: -1.9219577312469482, not -1.9219577.

What is written where (one `Outcome` per evaluated token):

    placeholder          the server's entry gets the true values (every other field kept)
    missing              a new entry, inserted at the token's place (after earlier new ones there)
    ok, mismatch         the server's real values stay exactly as sent
    place.write false     nothing (a stop word's trimmed entries stay trimmed)
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from replay.comparison.values import TokenReport
from replay.evaluation.walk import Truth
from replay.numerics.floats import widened
from replay.transcripts.plan import EntryPlace
from replay.transcripts.readers import NATIVE, Record, entries_of
from replay.transcripts.utf8 import sent_text

Piece = Callable[[int], bytes]


@dataclass(frozen=True)
class Outcome:
    """One evaluated token as the repair pass needs it: where it goes, whether it owns the server's
    entry at its place, its true values and what the comparison said."""

    truth: Truth
    place: EntryPlace
    owns_entry: bool
    report: TokenReport


def _top(values: Sequence[tuple[int, float]], post: bool, piece: Piece) -> list[dict]:
    key = "prob" if post else "logprob"
    return [{"id": tid, "token": sent_text(piece(tid)), "bytes": list(piece(tid)), key: widened(v)}
            for tid, v in values]


def filled(entry: dict, t: Truth, post: bool, piece: Piece) -> dict:
    """A copy of `entry` with the true values in its probability fields; every other field kept."""
    e = dict(entry)
    if post:
        e["prob"], e["top_probs"] = widened(t.post_prob or 0.0), _top(t.post_top or [], True, piece)
    else:
        e["logprob"], e["top_logprobs"] = widened(t.logprob), _top(t.top, False, piece)
    return e


def new_entry(t: Truth, post: bool, piece: Piece) -> dict:
    """An entry for a token the server sent none for."""
    b = piece(t.id)
    return filled({"id": t.id, "token": sent_text(b), "bytes": list(b)}, t, post, piece)


def _entry_list(endpoint: str, obj: dict, *, body: bool) -> list:
    """The entry list of a (copied) body or chunk, created where the server would put it."""
    if endpoint == NATIVE:
        if not isinstance(obj.get("completion_probabilities"), list):
            obj["completion_probabilities"] = []
        return obj["completion_probabilities"]
    ch = obj["choices"][0]
    if body and entries_of(endpoint, obj) is None:
        ch["logprobs"] = {"content": []}
    if not isinstance(ch.get("logprobs"), dict):
        ch["logprobs"] = {"content": []}
    if not isinstance(ch["logprobs"].get("content"), list):
        ch["logprobs"]["content"] = []
    return ch["logprobs"]["content"]


def _edit(endpoint: str, obj: dict, outcomes: list[Outcome], post: bool, piece: Piece, *, body: bool) -> None:
    """Apply one list's outcomes to `obj` (a copy): fill owned placeholders, insert missing entries
    at their places in token order."""
    lst = _entry_list(endpoint, obj, body=body)
    old = list(lst)
    fills: dict[int, dict] = {}
    inserts: dict[int, list[dict]] = {}
    for o in outcomes:
        if o.report.status == "placeholder" and o.owns_entry:
            fills[o.place.entry] = filled(old[o.place.entry], o.truth, post, piece)
        elif o.report.status == "missing":
            inserts.setdefault(o.place.insert_at, []).append(new_entry(o.truth, post, piece))
    new: list[dict] = []
    for k, e in enumerate(old):
        new += inserts.get(k, [])
        new.append(fills.get(k, e))
    new += [e for at, es in sorted(inserts.items()) if at >= len(old) for e in es]
    lst[:] = new


def repair_record(rec: Record, outcomes: Sequence[Outcome], post: bool, piece: Piece) -> Any:
    """The record's top-level object with the true values in place (module docstring); the record
    itself is left as it was read."""
    todo = [o for o in outcomes if o.place.write and o.report.status in ("placeholder", "missing")]
    if not rec.stream:
        response = copy.deepcopy(rec.response)
        if todo:
            _edit(rec.endpoint, response, todo, post, piece, body=True)
        return _with_response(rec, response)
    events = copy.deepcopy(rec.events)
    by_chunk: dict[int, list[Outcome]] = {}
    for o in todo:
        by_chunk.setdefault(o.place.chunk, []).append(o)
    for k, group in by_chunk.items():
        _edit(rec.endpoint, events[k], group, post, piece, body=False)
    return _with_events(rec, events)


def _with_response(rec: Record, response: Any) -> Any:
    c = rec.container
    if c is rec.response:
        return response
    return {**c, "response": response}


def _with_events(rec: Record, events: list) -> Any:
    c = rec.container
    if not isinstance(c, dict):
        return events  # a bare chunk list (or SSE text: serialise writes it as SSE)
    if rec.events_as == "strings":
        return {**c, "events": _event_strings(events)}
    if rec.events_as == "sse-text":
        return {**c, "response": sse_text(events)}
    return {**c, "response": events}


# --- serialising -----------------------------------------------------------------------

def _compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _event_strings(events: list) -> list:
    return [e if isinstance(e, str) else _compact(e) for e in events]


def sse_text(events: list) -> str:
    return "".join(f"data: {e}\n\n" for e in _event_strings(events))


def serialise(records: Sequence[Record], containers: Sequence[Any], original: str) -> str:
    """The repaired file text, in the original file's layout."""
    if len(records) == 1:
        rec, c = records[0], containers[0]
        if rec.events_as == "sse-text" and not isinstance(rec.container, dict):
            return sse_text(c)
        if original.lstrip().startswith(("{", "[")) and _is_single_json(original):
            indent = 2 if "\n " in original or "\n\t" in original else None
            return json.dumps(c, ensure_ascii=False, indent=indent, allow_nan=False) + "\n"
    return "".join(jsonl_line(c) for c in containers)


def jsonl_line(container: Any) -> str:
    """One record of a multi-record file as its repaired JSONL line (what `serialise` writes for it)."""
    return _compact(container) + "\n"


def _is_single_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
