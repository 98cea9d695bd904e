"""Intervals over sampled runs (`tune --samples N`).

At temperature > 0 every run of a setting draws its own text, so a statistic of the whole file (its
acceptance, its target decodes per token, its predicted speed) differs from run to run. Over N runs
the report gives the mean and a 95% percentile bootstrap interval of that mean: the runs resampled with
replacement (numpy's Generator, a fixed seed so a report is reproducible), the mean of each resample, the
2.5th and 97.5th percentiles of those means. A percentile bootstrap covers less than it says with few
runs (with 5 runs there are 126 distinct resamples): below MIN_RUNS no interval is given, and the report
names the run count beside every interval.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 2000
SEED = 20261203
MIN_RUNS = 5  # fewer runs give no interval worth printing


@dataclass(frozen=True)
class Estimate:
    """A mean over runs and its 95% interval (None with fewer than MIN_RUNS runs)."""

    mean: float
    low: float | None
    high: float | None
    runs: int

    def to_json(self) -> dict:
        return {"mean": self.mean, "interval_95": None if self.low is None else [self.low, self.high],
                "runs": self.runs, "interval": "percentile bootstrap of the mean over runs"}

    def describe(self, fmt: str = "{:.3f}") -> str:
        """'0.812 [0.790, 0.834]' or '0.812' without an interval.

        >>> Estimate(0.5, 0.4, 0.6, 5).describe("{:.2f}")
        '0.50 [0.40, 0.60]'
        """
        if self.low is None:
            return fmt.format(self.mean)
        return f"{fmt.format(self.mean)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


def estimate(values: Sequence[float]) -> Estimate:
    """The mean of per-run values with a 95% percentile bootstrap interval (module docstring).

    >>> e = estimate([1.0, 2.0, 3.0, 4.0, 5.0])
    >>> e.mean, 1.0 <= e.low < e.mean < e.high <= 5.0
    (3.0, True)
    >>> estimate([0.7] * 5).describe()
    '0.700 [0.700, 0.700]'
    >>> estimate([0.7, 0.8, 0.9]).low is None
    True
    """
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if len(x) < MIN_RUNS:
        return Estimate(mean, None, None, len(x))
    rng = np.random.default_rng(SEED)
    means = x[rng.integers(0, len(x), size=(RESAMPLES, len(x)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Estimate(mean, float(low), float(high), len(x))
