"""Write true probabilities back into a record, in the server's own field format.

Entries look like the server's (tools/server/server-task.cpp:264-300):

    pre-sampling   {"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token", "bytes", "logprob"}]}
    post-sampling  {"id", "token", "bytes", "prob",    "top_probs":    [{"id", "token", "bytes", "prob"}]}

`token` is the piece cut back to valid UTF-8 (validate_utf8), `bytes` the raw
piece. Values are float32 widened to double, which is how the server's JSON (nlohmann, double
numbers) prints its float fields: -1.9219577312469482, not -1.9219577.
Files are re-serialised in their own shape: a transcript stays a transcript
(events as strings), SSE text stays SSE text, JSONL stays JSONL.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import numpy as np

from .readers import Record


def f32(x: float) -> float:
    """The float32 value of x as the double the server's JSON holds (it prints that double's
    shortest round-trip decimal)."""
    return float(np.float32(x))


def _valid_utf8_prefix(b: bytes) -> str:
    for cut in range(len(b), max(len(b) - 4, -1), -1):
        try:
            return b[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return b.decode("utf-8", "ignore")


def _top(values: Sequence[tuple[int, float]], post: bool, piece: Callable[[int], bytes]) -> list[dict]:
    key = "prob" if post else "logprob"
    out = []
    for tid, v in values:
        b = piece(tid)
        out.append({"id": tid, "token": _valid_utf8_prefix(b), "bytes": list(b), key: f32(v)})
    return out


def fill_entry(entry: dict, values: tuple[float, Sequence[tuple[int, float]]], post: bool,
               piece: Callable[[int], bytes]) -> None:
    """Replace an entry's probability fields in place; every other field is kept."""
    value, top = values
    if post:
        entry["prob"] = f32(value)
        entry["top_probs"] = _top(top, True, piece)
    else:
        entry["logprob"] = f32(value)
        entry["top_logprobs"] = _top(top, False, piece)


def new_entry(tid: int, values: tuple[float, Sequence[tuple[int, float]]], post: bool,
              piece: Callable[[int], bytes]) -> dict:
    """An entry for a token the server sent none for."""
    b = piece(tid)
    e: dict[str, Any] = {"id": tid, "token": _valid_utf8_prefix(b), "bytes": list(b)}
    fill_entry(e, values, post, piece)
    return e


def _compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _events_out(rec: Record) -> list[Any]:
    return [e if isinstance(e, str) else _compact(e) for e in rec.events or []]


def record_container(rec: Record) -> Any:
    """The record's top-level object with repaired values, in its original structure."""
    c = rec.container
    if rec.stream and rec.events_as == "strings" and isinstance(c, dict):
        c["events"] = _events_out(rec)
    elif rec.stream and rec.events_as == "sse-text" and isinstance(c, dict) and "response" in c:
        c["response"] = sse_text(rec)
    return c


def sse_text(rec: Record) -> str:
    return "".join(f"data: {e}\n\n" for e in _events_out(rec))


def serialise(records: list[Record], original: str) -> str:
    """The repaired file text, in the original file's shape."""
    if len(records) == 1 and records[0].events_as == "sse-text" and not isinstance(records[0].container, dict):
        return sse_text(records[0])
    if len(records) == 1 and original.lstrip().startswith(("{", "[")) and _is_single_json(original):
        indent = 2 if "\n " in original or "\n\t" in original else None
        return json.dumps(record_container(records[0]), ensure_ascii=False, indent=indent, allow_nan=False) + "\n"
    return "".join(jsonl_line(r) for r in records)


def jsonl_line(rec: Record) -> str:
    """One record of a multi-record file as its repaired JSONL line (what `serialise` writes for it)."""
    return _compact(record_container(rec)) + "\n"


def _is_single_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
