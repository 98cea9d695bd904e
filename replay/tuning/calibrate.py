"""The cost table from the transcript's own timings: the server's hardware, not this host's.

Every record the server timed says how long its generation phase took (timings.predicted_ms, from the
first token to the last: server-common.h:437-446), and the baseline's replay says what work that phase
did (loop/work.py). Two uses:

* `scale`: a table measured here (tuning/measure.py) scaled by one factor so that it predicts the
  transcript's total generation time: sum(predicted_ms) / sum(the table's time for the baseline's work).
  The shape (how cost grows with batch size) is this host's; the level is the server's.
* `fit`: with nothing measured, a table fitted to the timings alone by least squares with non-negative
  coefficients, per record: predicted_ms = a * target decodes + r * (target rows beyond the first of each
  decode) + c * draft-model decodes. A target decode of b rows then costs a + r (b - 1); a draft decode
  costs c. It needs records whose work differs in kind (traffic of several settings, or acceptance that
  varies a lot), refuses in words when it does not (SEPARABLE), and says how well it fits.

A record's timings are usable when the server counted the tokens the replay emitted (predicted_n) and its
batches were its own: a record that ran beside others (transcripts/readers.py shared_evidence) shared its decodes
and its time, and is left out.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from replay.errors import TranscriptError
from replay.loop.work import Work
from replay.tuning.costs import CostTable

MIN_RECORDS = 4  # a fit of three coefficients needs more records than that
# the smallest singular value of the (column-normalised) work over the largest: below this the records did
# work too alike for their timings to tell a decode's cost from a row's or a draft decode's. Traffic of one
# setting is usually there: eight SmolLM2 records of a self-drafting server gave 8e-17 (every step drafted
# the same number of tokens, so the three counts are proportional)
SEPARABLE = 0.05


@dataclass(frozen=True)
class Timed:
    """One record's generation work (the baseline's replay) and the server's time for it."""

    work: Work
    ms: float


def usable(work: Work, timings: dict | None, shared: str | None) -> Timed | None:
    """The record's timing, if it can calibrate (module docstring).

    >>> usable(Work({1: 4}, {}, 4, 0, 5), {"predicted_n": 5, "predicted_ms": 40.0}, None).ms
    40.0
    >>> usable(Work({1: 4}, {}, 4, 0, 5), {"predicted_n": 6, "predicted_ms": 40.0}, None) is None
    True
    """
    if shared or not isinstance(timings, dict):
        return None
    ms, n = timings.get("predicted_ms"), timings.get("predicted_n")
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or ms <= 0 or n != work.tokens or work.tokens < 2:
        return None
    return Timed(work, float(ms))


def scale(table: CostTable, timed: Sequence[Timed]) -> CostTable:
    """`table` scaled so that it predicts the timed records' total (module docstring).

    >>> t = scale(CostTable({1: 10.0}, target_sample=0.0, source="m"), [Timed(Work({1: 4}, {}, 4, 0, 5), 60.0)])
    >>> round(t.scale, 3), t.time_ms(Work({1: 4}, {}, 4, 0, 5))
    (1.5, 60.0)
    """
    if not timed:
        raise TranscriptError("no record carries timings the server measured on its own batches (predicted_ms "
                              "for the tokens replayed): nothing to scale to")
    here = sum(table.time_ms(t.work) for t in timed)
    there = sum(t.ms for t in timed)
    factor = there / here
    return table.scaled(factor, f"{table.source}, scaled x{factor:.3f} to the transcript's timings "
                                f"({len(timed)} records)")


def _features(w: Work) -> list[float]:
    return [float(w.steps), float(sum((b - 1) * n for b, n in w.target_batches.items())),
            float(sum(w.draft_batches.values()))]


def fit(timed: Sequence[Timed]) -> CostTable:
    """A table fitted to the timings alone (module docstring): the non-negative least-squares solution,
    found as the best of the exact solutions on every subset of the coefficients that comes out
    non-negative."""
    if len(timed) < MIN_RECORDS:
        raise TranscriptError(f"{len(timed)} record(s) carry usable timings; a speed model fitted to timings needs "
                              f"at least {MIN_RECORDS} (or measure this host: --measure)")
    x = np.array([_features(t.work) for t in timed])
    y = np.array([t.ms for t in timed])
    best = None
    cols = [k for k in range(3) if x[:, k].any()]
    if cols:
        sv = np.linalg.svd(x[:, cols] / np.linalg.norm(x[:, cols], axis=0), compute_uv=False)
        if sv[-1] / sv[0] < SEPARABLE:
            raise TranscriptError(f"the {len(timed)} timed records did work too alike (their decodes, rows and draft "
                                  "decodes rise together) for their timings to tell those costs apart: measure them "
                                  "on this host (--measure), which the timings then scale")
    for n in range(1, len(cols) + 1):
        for sub in itertools.combinations(cols, n):
            coef, *_ = np.linalg.lstsq(x[:, sub], y, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(sub)] = coef
            err = float(np.sum((x @ full - y) ** 2))
            if best is None or err < best[0] - 1e-12:
                best = (err, full)
    if best is None or best[1][0] <= 0:
        raise TranscriptError("the transcript's timings fit no cost per target decode (its records' work is too "
                              "alike to tell the costs apart): measure this host instead (--measure)")
    err, (a, r, c) = best
    rel = float(np.sqrt(err / len(y)) / np.mean(y))
    sizes = sorted({b for t in timed for b in t.work.target_batches} | {1})
    return CostTable({b: a + r * (b - 1) for b in sizes} | {sizes[-1] + 1: a + r * sizes[-1]},
                     {1: c} if c > 0 or any(t.work.draft_batches for t in timed) else {},
                     source=f"fitted to the transcript's timings ({len(timed)} records: {a:.3f} ms a target decode, "
                            f"{r:.3f} ms a row beyond the first, {c:.3f} ms a draft decode; rms error "
                            f"{100 * rel:.1f}% of a record's time)")
