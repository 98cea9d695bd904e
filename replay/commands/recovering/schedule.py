"""Which schedule computes a record's values: the one-token schedule (recovering/one_token.py), or the
server's loop replayed (commands/looped.py), which gives the values in the server's own batches.

    first   where the one-token schedule is bound to be approximate (known from the plan and the slot
            before any decode), or the record continues the cache of a looped one, the loop is tried
            first; where its values hold, they are the record's and the one-token evaluation is not run
    after   where the one-token values turned out approximate, the loop is tried then; else the
            approximate values stay, and the report's schedule.loop says why the loop did not hold

The loop's values hold (`held`) where the replay emitted the transcript's tokens with the server's draft
totals and every real entry agrees at the full tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from replay.commands.looped import LoopValues
from replay.commands.recovering.one_token import Evaluated, OneToken, scored_kinds
from replay.commands.trace import Drafts
from replay.evaluation.walk import Truth
from replay.reading.record import ReadRecord
from replay.report.repair import Outcome
from replay.runtime.llama import Model
from replay.schedule.memory import SlotConfig
from replay.schedule.prefix import Prefix
from replay.transcripts.plan import Known

Compare = Callable[[ReadRecord, list[Truth]], list[Outcome]]


@dataclass(frozen=True)
class LoopHeld:
    """The loop's values for a record, held against the transcript: its truths and their outcomes, the
    report's `schedule.loop`, and the prompt schedule, prefix and notes of the loop."""

    truths: list[Truth]
    outcomes: list[Outcome]
    info: dict
    schedule: dict | None
    prefix: Prefix
    notes: tuple[str, ...]


class ScheduleChoice:
    """The loop's side of the choice, over the one-token schedule's slot (module docstring). `compare`
    pairs a record's truths with its entries (recovering/outcomes.py)."""

    def __init__(self, model: Model, drafts: Drafts, one_token: OneToken, compare: Compare, *,
                 n_parallel: int | None, renamed: bool, only_entries: int):
        self.model, self.drafts, self.one_token, self.compare = model, drafts, one_token, compare
        self.n_parallel, self.renamed, self.only_entries = n_parallel, renamed, only_entries
        self.loop: LoopValues | None = None  # the server's loop, made when first asked

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()

    def forget(self) -> None:
        if self.loop is not None:
            self.loop.forget()

    def undo(self) -> None:
        """The loop ran on an assumed -t that the record's values then corrected: run it again."""
        if self.loop is not None:
            self.loop.undo()

    def values(self) -> LoopValues:
        if self.loop is None:
            self.loop = LoopValues(self.model, self.drafts, self.n_parallel, renamed=self.renamed)
        return self.loop

    def first(self, read: ReadRecord) -> tuple[Evaluated, list[Outcome]] | str | None:
        """The loop first where the one-token schedule is bound to be approximate (every token of a loopable
        record is one plan item). Returns (the run, its outcomes) where the loop's values hold; else why
        they did not (the one-token evaluation then runs, and keeps it), or None where it was not tried."""
        if self.only_entries or not all(isinstance(item, Known) for item in read.plan):
            return None
        cfg = SlotConfig.of(read.context, read.rec.flags, read.shape.build, read.spec)
        slot = self.one_token.context(cfg)
        kinds = tuple(scored_kinds(read))
        approx, _ = self.one_token.approximate(read, cfg, slot, kinds)
        if approx is None and not (read.cached and self.loop is not None and self.loop.live):
            return None  # (a record that continues the cache of a looped one is looped too: that KV is the loop's)
        looped = self.held(read)
        if isinstance(looped, str):
            return looped
        schedule = {**(looped.schedule or {}), **self.one_token.rows_and_threads(read, kinds, cfg.threads),
                    "loop": looped.info}
        slot.reset()  # its KV is an earlier record's: the next record keeps nothing of it (kv_after 0)
        self.one_token.after_loop = True
        return Evaluated(looped.truths, None, looped.prefix, schedule, 0, kinds=kinds,
                         notes=looped.notes), looped.outcomes

    def after(self, read: ReadRecord, run: Evaluated,
              tried: str | None = None) -> tuple[Evaluated, list[Outcome] | None]:
        """Where the one-token values are approximate (`approximate_from`), the loop's (`held`); else the
        approximate values stay, and the schedule's `loop` says why (`tried`: why the loop, tried first, did
        not hold). Returns the run and, when the loop's values are used, their outcomes."""
        loop = self.values()
        if run.approximate_from is None or self.only_entries:
            loop.skip()
            return run, None
        looped = tried if tried is not None else self.held(read)
        if isinstance(looped, str):
            return replace(run, schedule={**run.schedule, "loop": {"replayed": False, "why": looped}}), None
        schedule = {k: v for k, v in run.schedule.items() if k != "approximate_from"}
        schedule["loop"] = looped.info
        return replace(run, truths=looped.truths, approximate_from=None, approximate_why="", schedule=schedule,
                       notes=looped.notes), looped.outcomes

    def held(self, read: ReadRecord) -> LoopHeld | str:
        """The server's loop replayed for this record, where its values hold (module docstring); else why not."""
        loop = self.values()
        looped = loop.values(read)
        if looped.truths is None:
            return looped.why
        outcomes = self.compare(read, looped.truths)
        wrong = next((o for o in outcomes if o.report.status == "mismatch"), None)
        if wrong is not None:
            loop.skip()
            return (f"its value of token {wrong.report.index} disagrees with the server's real entry "
                    f"({wrong.report.note or 'beyond the tolerance'})")
        info = {"replayed": True, "draft_n": looped.draft_n, "draft_n_accepted": looped.draft_n_accepted,
                "totals_checked": looped.totals_checked}
        return LoopHeld(looped.truths, outcomes, info, looped.schedule, looped.prefix, looped.notes)
