"""Which records of a transcript the server certainly ran at the same time, from what their responses
say: `created` (the OpenAI endpoints' Unix second at which the response was made,
tools/server/server-task.cpp:394, 442) and `timings` (prompt_ms + predicted_ms: how long the slot worked
on it, server-task.cpp timings). Pure.

A response made in second `c` ended in [c, c + 1); a request that took `d` seconds certainly ran
during [c + 1 - d, c] whatever its end within that second. Two records whose certain spans overlap ran
at the same time: their batches were shared (a server with one slot runs one request at a time, so
overlapping records also show several slots). Records shorter than a second show nothing: this is
evidence only where it is certain.
"""
from __future__ import annotations

from typing import Sequence

from replay.transcripts.readers import Record


def certain_span(rec: Record) -> tuple[float, float] | None:
    """(start, end) in Unix seconds during which the record's request certainly ran, or None.

    >>> from replay.transcripts.readers import Record
    >>> r = Record("f", 1, "/v1/chat/completions", {}, False,
    ...            response={"created": 100, "timings": {"prompt_ms": 200.0, "predicted_ms": 1700.0}})
    >>> certain_span(r)
    (99.1, 100)
    """
    final = rec.final() or {}
    created, timings = final.get("created"), final.get("timings")
    if not isinstance(created, int) or isinstance(created, bool) or not isinstance(timings, dict):
        return None
    parts = [timings.get("prompt_ms"), timings.get("predicted_ms")]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in parts):
        return None
    start = created + 1 - sum(parts) / 1000.0
    return (round(start, 6), created) if start < created else None


def overlapping(records: Sequence[Record]) -> dict[int, str]:
    """{record index: the evidence, naming the records it certainly ran with} for every record that
    certainly overlapped another.

    >>> from replay.transcripts.readers import Record
    >>> mk = lambda i, c: Record("f", i, "/v1/chat/completions", {}, False,
    ...                          response={"created": c, "timings": {"prompt_ms": 150.0, "predicted_ms": 1750.0}})
    >>> overlapping([mk(1, 213), mk(2, 213), mk(3, 215)])
    {1: 'it ran at the same time as record 2 (their created and timings overlap)', 2: 'it ran at the same time as record 1 (their created and timings overlap)'}
    """
    spans = [(r.index, certain_span(r)) for r in records]
    spans = [(i, s) for i, s in spans if s is not None]
    out: dict[int, str] = {}
    for i, (a0, a1) in spans:
        with_ = [j for j, (b0, b1) in spans if j != i and max(a0, b0) < min(a1, b1)]
        if with_:
            names = ", ".join(map(str, with_[:4])) + (f" and {len(with_) - 4} more" if len(with_) > 4 else "")
            out[i] = (f"it ran at the same time as record{'s' if len(with_) > 1 else ''} {names} (their created and "
                      "timings overlap)")
    return out


def shared_evidence(records: Sequence[Record], n_parallel: int | None, option: bool) -> dict[int, str]:
    """{record index: why its batches may have been shared with other requests} for every record where
    something shows it: the record itself (Record.busy_when_sent: another slot busy in /slots), the
    records it overlapped in time, or the user's --shared-batches (`option`). A slot count or a slot id
    alone shows nothing: a lone request on a 4-slot server runs alone. (`n_parallel`: kept for callers.)"""
    overlaps = overlapping(records)
    out = {}
    for rec in records:
        why = rec.busy_when_sent() or overlaps.get(rec.index) or ("--shared-batches" if option else None)
        if why:
            out[rec.index] = why
    return out
