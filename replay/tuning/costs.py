"""A cost table for llama-server's generation phase, and the speed it predicts for some work.

The server's generation phase (loop/work.py) is, per step: one target decode of 1 + n rows (the last
token and a draft of n), the draft model's decodes (one per drafted position, and the draft context's
copy of the verify batch), one pass of the target's sampler chain per verified row and one of the draft's
per drafted position. A cost table prices each:

    time = sum_b  N_target(b) * target(b)  +  sum_b  N_draft(b) * draft(b)
         + S_target * target_sample  +  S_draft * draft_sample

with target(b) and draft(b) the milliseconds of a decode of b rows. What the server spends per token
beyond that (HTTP, detokenizing, the probabilities it computes for tokens sampled outside the loop) is
not priced; a table scaled to the transcript's timings (tuning/calibrate.py) spreads it over the rest.
A size the table lacks is interpolated linearly between its neighbours (extrapolated from the last two).
The server's own speed is timings.predicted_per_second: (predicted_n - 1) tokens over predicted_ms
(server-common.h:437-478), so a prediction counts the tokens the same way.

Without speculation every token after the first is one decode of one row and one sample (`plain`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from replay.loop.work import Work


def at_size(table: Mapping[int, float], rows: int) -> float:
    """The cost of a decode of `rows` rows: the table's, or linear between the nearest sizes it has.

    >>> at_size({1: 10.0, 4: 16.0}, 2), at_size({1: 10.0, 4: 16.0}, 6), at_size({3: 5.0}, 1)
    (12.0, 20.0, 5.0)
    """
    if rows in table:
        return float(table[rows])
    sizes = sorted(table)
    if not sizes:
        raise ValueError("an empty cost table")
    if len(sizes) == 1:
        return float(table[sizes[0]])
    lo = max((s for s in sizes if s < rows), default=None)
    hi = min((s for s in sizes if s > rows), default=None)
    if lo is None:
        lo, hi = sizes[0], sizes[1]
    elif hi is None:
        lo, hi = sizes[-2], sizes[-1]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return float(table[lo] + slope * (rows - lo))


@dataclass(frozen=True)
class CostTable:
    """Milliseconds per operation of the generation phase (module docstring), and where they come from."""

    target: Mapping[int, float]
    draft: Mapping[int, float] = field(default_factory=dict)
    target_sample: float = 0.0
    draft_sample: float = 0.0
    source: str = ""
    scale: float = 1.0  # a factor on everything (measured here, scaled to the server's timings)

    def time_ms(self, work: Work) -> float:
        """The predicted generation time of `work` (module docstring).

        >>> t = CostTable({1: 10.0, 4: 16.0}, {1: 2.0}, target_sample=1.0, draft_sample=0.5)
        >>> t.time_ms(Work({4: 2}, {1: 6}, target_samples=5, draft_samples=6, tokens=7))
        52.0
        """
        ms = sum(n * at_size(self.target, b) for b, n in work.target_batches.items())
        if work.draft_batches:
            if not self.draft:
                raise ValueError("the cost table prices no draft-model decodes")
            ms += sum(n * at_size(self.draft, b) for b, n in work.draft_batches.items())
        ms += work.target_samples * self.target_sample + work.draft_samples * self.draft_sample
        return ms * self.scale

    def prices(self, work: Work) -> bool:
        """Whether the table has what `work` needs: a fit to timings that saw no draft model has no draft cost.

        >>> CostTable({1: 1.0}).prices(Work({2: 1}, {1: 2}, 1, 2, 3)), CostTable({1: 1.0}).prices(Work({2: 1}))
        (False, True)
        """
        return bool(self.target) and (not work.draft_batches or bool(self.draft))

    def scaled(self, factor: float, source: str) -> "CostTable":
        return replace(self, scale=self.scale * factor, source=source)

    def to_json(self) -> dict:
        return {"source": self.source, "scale": self.scale,
                "target_decode_ms": {str(k): v for k, v in sorted(self.target.items())},
                "draft_decode_ms": {str(k): v for k, v in sorted(self.draft.items())},
                "target_sample_ms": self.target_sample, "draft_sample_ms": self.draft_sample}


def plain(work: Work) -> Work:
    """The same tokens without speculation: one decode of one row and one sample per token after the first.

    >>> plain(Work({3: 2}, {1: 4}, 6, 4, 5))
    Work(target_batches={1: 4}, draft_batches={}, target_samples=4, draft_samples=0, tokens=5)
    """
    n = max(work.tokens - 1, 0)
    return Work({1: n} if n else {}, {}, n, 0, work.tokens)


def tokens_per_second(works: list[Work], table: CostTable) -> float | None:
    """(tokens - 1) per request over the predicted time, summed over requests, as the server counts its own
    predicted_per_second.

    >>> tokens_per_second([Work({1: 4}, {}, 4, 0, 5)], CostTable({1: 9.0}, target_sample=1.0))
    100.0
    """
    ms = sum(table.time_ms(w) for w in works)
    n = sum(max(w.tokens - 1, 0) for w in works)
    return 1000.0 * n / ms if ms > 0 else None
