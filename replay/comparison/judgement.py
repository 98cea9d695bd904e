"""What a record's report says of how its values were judged: the notes on approximate values, shared
batches, the loop replay and other numerics (pure).

recover computes a record's values (commands/recover.py), compares them with what the server sent
(values.py compare) and judges the real entries that disagree (values.py judge_numerics); these notes
say, in the report's words, which values are exact, which approximate and within what, and why. The
report's one verdict (numerics.approximate, numerics.bound) is report/recovery.py's approximation.
"""
from __future__ import annotations

from typing import Sequence

from replay.comparison.values import APPROXIMATE_DRIFT, SHARED_ENTRY_DRIFT, TokenReport


def judgement_notes(*, approximate_from: int | None, approximate_why: str, loop: dict | None, cause: str | None,
                    shared: bool, batched: bool, tokens: Sequence[TokenReport], weighted: float | None,
                    backend: str, batch_bound: float) -> list[str]:
    """The notes on a record's values, in the report's order: from which token they are approximate and
    why (and why the server's loop did not give them: `loop["why"]`); approximate after the first entry
    where batches were `shared` and the real entries agreed; the loop replay that gave them (`loop`, the
    report's schedule.loop); the server's real values kept as sent where other numerics (`cause`) explain
    them (`batched`).

    >>> judgement_notes(approximate_from=None, approximate_why="", loop={"replayed": True, "draft_n": 9,
    ...     "draft_n_accepted": 7, "totals_checked": True}, cause=None, shared=False, batched=False, tokens=[],
    ...     weighted=None, backend="CPU", batch_bound=0.25)[0].split(": ")[1]
    "its draft totals (9 drafted, 7 accepted) equal the server's"
    """
    loop = loop or {}
    notes: list[str] = []
    if approximate_from is not None:
        notes.append(f"values from token {approximate_from} on are approximate (real entries judged within "
                     f"{APPROXIMATE_DRIFT} nats, as measured): {approximate_why}" + (
                         "; not replayed through the server's loop, which computes them in its batches: "
                         + loop["why"] if loop else ""))
    if shared and not batched:  # (where they disagreed, the judgement's note below says so)
        notes.append(f"values after the first entry are approximate: {cause}, which this replay (one request at "
                     "a time) does not reproduce; its real entries agreed with this replay's, which says little "
                     f"of the rows between them (single entries measured up to {SHARED_ENTRY_DRIFT} nats off on "
                     "4-slot servers)")
    if approximate_from is not None or not loop.get("replayed"):
        pass  # (said above, or nothing replayed)
    elif shared:
        notes.append("the server's loop was replayed for this request alone (its drafts and verify batches, "
                     "without the other requests' rows)")
    else:
        notes.append("values computed in the server's batches by replaying its loop (drafts, verify batches, "
                     "checkpoint restores): " + (
                         f"its draft totals ({loop['draft_n']} drafted, {loop['draft_n_accepted']} accepted) equal "
                         "the server's" if loop["totals_checked"] else
                         "the server sent no draft totals, so its real entries alone confirm the batches"))
    if batched:
        worst = max((abs(t.server_logprob - t.true_logprob) for t in tokens
                     if t.real_pairs and t.server_logprob is not None and t.true_logprob is not None),
                    default=weighted)
        notes.append(f"the server's real values differ from this replay's ({backend}, one request) "
                     f"by up to {worst:.3g} nats ({weighted:.3g} weighted by probability, first "
                     f"entry and record): {cause}; within the {batch_bound} nats other "
                     "numerics explain (a requantised model file measured 0.38 or more, first entries 0.17 "
                     "or more), so they are kept as "
                     f"sent and the rest gets {backend} one-request values, which are approximate")
    return notes
