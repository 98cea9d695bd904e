"""Which records of a file must be recovered by the same evaluator, and in which units.

Rule: record k depends on record k-1 when the server took prompt tokens from its slot's cache
(timings.cache_n > 0): those KV cells were computed while serving k-1, and the replay reproduces them
bit for bit only by evaluating k-1 first in the same context (schedule/prefix.py: plan_prefix, "server
cache"); and every record depends on the one before it when the server's drafter keeps state across
requests (`keeps_state`: ngram-mod's table, a slot's n-gram maps, a probabilistic draft sampler:
commands/trace_state.py), which the server's loop replayed over the file in order continues. Records
that merely share a prompt prefix are independent (keeping the prefix is a speed-up, exact either
way), but are kept together too when they share at least SHARED_CHARS of prompt text, so the speed-up
survives sharding. A chain is a maximal run of records joined by these rules; a unit is
a chain, or, when resuming, what is left of one, warmed up by evaluating its finished head again
without writing it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from replay.transcripts.entries import n_prompt_cached
from replay.transcripts.readers import Record

SHARED_CHARS = 2048  # ~ one 512-token ubatch of prompt text: less cannot be kept exactly (prefix.reuse_points)


@dataclass(frozen=True)
class Unit:
    """Records one evaluator recovers in this order (0-based positions in the file's record list);
    those in `finished` are evaluated only to rebuild the context a later record depends on: their
    results exist already and are not sent again."""

    records: tuple[int, ...]
    finished: frozenset[int] = frozenset()

    @property
    def size(self) -> int:
        return len(self.records)

    @property
    def work(self) -> tuple[int, ...]:
        return tuple(k for k in self.records if k not in self.finished)


def _prompt_text(rec: Record) -> str:
    req = rec.request or {}
    for key in ("prompt", "messages", "input"):
        if key in req:
            v = req[key]
            return v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return ""


def _shared(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def depends_on_previous(prev: Record, rec: Record) -> bool:
    """`rec` must be evaluated right after `prev` in one context: the server served it from the KV
    cells `prev` left (cache_n > 0)."""
    del prev
    cached = n_prompt_cached(rec.final())
    return bool(cached)


def chains(records: Sequence[Record], keeps_state: bool = False) -> list[tuple[int, int]]:
    """[start, end) index ranges of the file's chains, in order, covering every record; with
    `keeps_state` (the server's drafter keeps state across requests), one chain."""
    out: list[tuple[int, int]] = []
    start = 0
    texts = [_prompt_text(r) for r in records]
    for k in range(1, len(records)):
        joined = keeps_state or depends_on_previous(records[k - 1], records[k]) or \
            _shared(texts[k - 1], texts[k]) >= SHARED_CHARS
        if not joined:
            out.append((start, k))
            start = k
    if records:
        out.append((start, len(records)))
    return out


def plan_units(records: Sequence[Record], finished: set[int] | frozenset[int] = frozenset(),
               keeps_state: bool = False) -> list[Unit]:
    """The units left when the records in `finished` are done: each chain's unfinished records, with
    the finished ones a later unfinished record depends on (transitively) evaluated again before it.
    Largest first, so that N evaluators finish together as nearly as the chains allow.

    >>> from replay.transcripts.readers import read_text
    >>> recs = read_text("\\n".join('{"endpoint": "/completion", "request": {"prompt": "%s"}, '
    ...                               '"response": {"content": "x"}}' % p for p in "abc"), "t.jsonl")
    >>> [u.records for u in plan_units(recs)], [u.records for u in plan_units(recs, keeps_state=True)]
    ([(0,), (1,), (2,)], [(0, 1, 2)])
    >>> u = plan_units(recs, {0, 1}, keeps_state=True)[0]   # resumed: the table is rebuilt, not resent
    >>> u.records, sorted(u.finished)
    ((0, 1, 2), [0, 1])
    """
    units = []
    for a, b in chains(records, keeps_state):
        if all(k in finished for k in range(a, b)):
            continue
        needed = [False] * (b - a)  # finished record k is re-evaluated for a later one
        for k in range(b - 2, a - 1, -1):
            nxt = k + 1
            needed[k - a] = (keeps_state or depends_on_previous(records[k], records[nxt])) and \
                (nxt not in finished or needed[nxt - a])
        order = tuple(k for k in range(a, b) if k not in finished or needed[k - a])
        units.append(Unit(order, frozenset(k for k in order if k in finished)))
    return sorted(units, key=lambda u: (-u.size, u.records[0]))
