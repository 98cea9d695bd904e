"""The comparison stage of a record: each true value paired with the server's entry it owns, compared
(comparison/values.py compare)."""
from __future__ import annotations

from typing import Callable

from replay.comparison.values import compare
from replay.evaluation.walk import Truth
from replay.report.repair import Outcome
from replay.transcripts.plan import Gap, entry_at
from replay.transcripts.readers import Record


def outcomes_of(rec: Record, evaluated: list[Truth], *, post: bool, n_probs: int, speculative: bool,
                tolerance: float, piece: Callable[[int], str], approximate_from: int | None = None) -> list[Outcome]:
    """Pair every truth with the server's entry it owns and compare them. A Gap's tokens share its
    place: only its last token owns an entry there (an id-less entry), the others are inserted before."""
    last_of_item = {id(t.item): k for k, t in enumerate(evaluated)}
    outcomes = []
    for k, t in enumerate(evaluated):
        place = t.item.place
        owns = place.entry is not None and last_of_item[id(t.item)] == k
        entry = entry_at(rec, place) if owns else None
        reason = t.item.reason if isinstance(t.item, Gap) else (place.reason or "the server sent no entry for this token")
        report = compare(t, entry, post=post, n_probs=n_probs, tolerance=tolerance, speculative=speculative,
                         piece=piece, missing_reason=reason, approximate_from=approximate_from)
        outcomes.append(Outcome(t, place, owns, report))
    return outcomes
