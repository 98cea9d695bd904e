"""Why a record's values are exact or approximate, and within what: the judgement of recover's values, pure.

recover computes a record's values (commands/recover.py) and compares each with what the server sent
(values.py compare: ok at the tolerance, or a mismatch). What the replay cannot reproduce is judged here:

    cause          numerics_cause / numerics_kind: batches shared with other requests (evidence in the
                   file, or --shared-batches), other slots' cells in the KV view, other kernels (another
                   backend, or no CPU variant here that reproduces the server's: kernels_cause)
    the entries    judge_numerics: with a cause, real entries that disagree are numerics when the
                   first entry's and the record's weighted disagreement are within the bound
                   (BATCH_BOUND); they are kept as sent
    the notes      judgement_notes: from which token the values are approximate and why (the one-token
                   schedule's decodes: schedule/exactness.py approximate_from), why the server's loop
                   did not give them, what the loop replay checked
    the record     judge_record: all of it for one record (a Judgement)
    the file       wrong_everywhere: every record's first entry beyond FIRST_ENTRY_BOUND

The bounds, with what each was measured on, are comparison/bounds.py, shared with trace's explanations
of a divergence (comparison/divergence.py). The report's one verdict (numerics.approximate,
numerics.bound) is report/recovery.py's approximation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from replay.comparison.bounds import APPROXIMATE_DRIFT, BATCH_BOUND, FIRST_ENTRY_BOUND, KEPT_CELLS, SHARED_ENTRY_DRIFT
from replay.comparison.values import TokenReport
from replay.runtime.backend import Backend, kernels_differ
from replay.runtime.engine import KernelChoice


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


def weighted_disagreement(reports: list[TokenReport]) -> float | None:
    """The mean |server - true| logprob over every real value of a record (each entry's token and the
    alternatives both top lists hold), weighted by the server's probability: None without real values.

    >>> weighted_disagreement([TokenReport(0, 1, "a", -0.1, -0.12, "ok", [], real_pairs=((-0.1, -0.12), (-2.4, -2.0)))])
    0.0546...
    """
    num = den = 0.0
    for r in reports:
        for s, t in r.real_pairs:
            if math.isfinite(s) and math.isfinite(t):
                w = math.exp(s)
                num += w * abs(s - t)
                den += w
    return num / den if den > 0 else None


def numerics_cause(shared: str | None, kernels: str | None) -> str | None:
    """Why the server's real values may differ from a one-request CPU evaluation of the same tokens,
    or None when nothing says they may: batches shared with other requests, where the record shows
    a server that may have run them (`shared`: transcripts/readers.py shared_evidence, or the user's --shared-batches;
    an unknown slot count is not such evidence), and/or other kernels (runtime/backend.py).

    >>> numerics_cause(None, None) is None
    True
    >>> numerics_cause("a 4-slot server (/props total_slots)", None)
    'batches shared with other requests on a 4-slot server (/props total_slots)'
    >>> numerics_cause("a 4-slot unified KV cache that keeps idle slots' cells (--cache-ram 0)", None)
    "other slots' cells in its KV view, on a 4-slot unified KV cache that keeps idle slots' cells (--cache-ram 0)"
    """
    causes = []
    if shared and KEPT_CELLS in shared:  # settings/config.py idle_cells_kept
        causes.append(f"other slots' cells in its KV view, on {shared}")
    elif shared:
        causes.append(f"batches shared with other requests on {shared}" if shared.startswith("a ")
                      else f"batches shared with other requests ({shared})")
    if kernels:
        causes.append(kernels)
    return "; ".join(causes) or None


def numerics_kind(shared: str | None, kernels: str | None) -> str | None:
    """The report's one-word-ish name of numerics_cause, from the same evidence (numerics.cause in the JSON).

    >>> numerics_kind("a 4-slot server", None), numerics_kind(None, "a GPU"), numerics_kind("x", "a GPU")
    ('batch composition', 'kernels', 'batch composition and kernels')
    >>> numerics_kind(None, None) is None
    True
    >>> numerics_kind("a 4-slot unified KV cache that keeps idle slots' cells (--cache-ram 0)", None)
    'KV layout'
    """
    kinds = (["KV layout" if KEPT_CELLS in shared else "batch composition"] if shared else []) + (
        ["kernels"] if kernels else [])
    return " and ".join(kinds) or None


@dataclass(frozen=True)
class Disagreement:
    """How far a record's real values are from the replay's, weighted by probability
    (weighted_disagreement): its first real entry (computed in the prompt batch: the one a wrong model
    file cannot hide in) and all of them. None: no real value."""

    first: float | None
    record: float | None

    @property
    def worst(self) -> float | None:
        """The larger of the two (None without real values).

        >>> Disagreement(0.02, 0.1).worst, Disagreement(None, None).worst
        (0.1, None)
        """
        known = [x for x in (self.first, self.record) if x is not None]
        return max(known) if known else None


def disagreement(reports: list[TokenReport]) -> Disagreement:
    """The Disagreement of one record's token reports."""
    real = [r for r in reports if r.real_pairs]
    return Disagreement(weighted_disagreement(real[:1]), weighted_disagreement(real))


def judge_numerics(reports: list[TokenReport], cause: str | None, bound: float = BATCH_BOUND) -> tuple[
        list[TokenReport], Disagreement, bool]:
    """Where the server's numerics may differ from the replay's (`cause`, numerics_cause), real values
    that disagree are numerics when the weighted disagreement of the first real entry, and of the record,
    are within `bound` (BATCH_BOUND): they become ok, kept as sent, with the cause in their note.
    Returns (reports, their Disagreement, judged numerics). The transcript's evidence as a whole is
    judged after every record (wrong_everywhere, in report/recovery.py)."""
    d = disagreement(reports)
    w = d.worst
    if cause is None or w is None or w > bound or not any(r.status == "mismatch" for r in reports):
        return reports, d, False
    out = [replace(r, status="ok", note=f"|diff| {abs(r.server_logprob - r.true_logprob):.2e}: {cause} (kept as sent)")
           if r.status == "mismatch" and r.server_logprob is not None and r.true_logprob is not None else r
           for r in reports]
    return out, d, True


def wrong_everywhere(firsts: list[float]) -> str | None:
    """The transcript-wide verdict on the model where options or evidence let numerics explain
    disagreement: one line when every record's first real entry (its weighted disagreement) is beyond
    FIRST_ENTRY_BOUND, else None. Judged on all of them, not one number.

    >>> wrong_everywhere([0.02, 0.31]) is None
    True
    >>> print(wrong_everywhere([0.38, 0.92]))
    every record's first entry is 0.380 nats or more from this model's (2 records), beyond the 0.2 that shared batches and other kernels move one (0.152 at most measured): the model file is not the server's
    """
    if not firsts or min(firsts) <= FIRST_ENTRY_BOUND:
        return None
    n = len(firsts)
    return (f"every record's first entry is {min(firsts):.3f} nats or more from this model's ({n} record"
            f"{'s' if n != 1 else ''}), beyond the {FIRST_ENTRY_BOUND} that shared batches and other kernels move "
            "one (0.152 at most measured): the model file is not the server's")


def kernels_cause(server: str, replay: Backend, cpu: KernelChoice | None) -> str | None:
    """Why the server's kernels are not the replay's (runtime/backend.py kernels_differ): another backend,
    or on the CPU no variant here that reproduces the server's (runtime/engine.py KernelChoice); None
    when the replay computes with the server's kernels."""
    kernels = kernels_differ(server, replay)
    if cpu is not None and not cpu.reproduces and kernels is None:
        kernels = f"no CPU variant here reproduces the server's kernels ({cpu.describe()})"
    return kernels


@dataclass(frozen=True)
class Judgement:
    """One record's judged values: its token reports (real entries that numerics explain kept as sent),
    the cause and its name, how far the real values are (Disagreement), whether numerics were judged
    (`batched`) or the batches shared, who said so (`judged_by`: "option", "evidence", None) and the
    notes, in the report's order."""

    reports: list[TokenReport]
    kernels: str | None
    cause: str | None
    cause_kind: str | None
    apart: Disagreement
    batched: bool
    shared: bool
    judged_by: str | None
    notes: list[str]


def judge_record(reports: list[TokenReport], *, shared: str | None, kernels: str | None, by_option: bool,
                 approximate_from: int | None, approximate_why: str, loop: dict | None, backend: str,
                 batch_bound: float) -> Judgement:
    """Judge one record's compared values (module docstring). `shared`: why its batches may have been
    shared (transcripts/readers.py shared_evidence, --shared-batches), `kernels`: kernels_cause;
    `by_option`: the cause came from our options (--shared-batches, a flag given here, --server-backend),
    not the transcript's evidence."""
    cause = numerics_cause(shared, kernels)
    judged, apart, batched = judge_numerics(reports, cause, batch_bound)
    shared_ = bool(shared)  # evidence or --shared-batches: approximate whatever its real entries say
    notes = judgement_notes(approximate_from=approximate_from, approximate_why=approximate_why, loop=loop,
                            cause=cause, shared=shared_, batched=batched, tokens=judged, weighted=apart.worst,
                            backend=backend, batch_bound=batch_bound)
    judged_by = None if not (batched or shared_) else "option" if by_option else "evidence"
    return Judgement(judged, kernels, cause, numerics_kind(shared, kernels), apart, batched, shared_, judged_by,
                     notes)
