"""The driver's side of a sharded run: units out to evaluators, results back in file order.

(journaled.py is recover's run over a JSONL through its journal, on top of this.)

Whatever order records finish in, the journal receives them in file order (transcripts/journal.py:
the next record's line goes to OUT.partial, one that finishes early is kept in OUT.partial.ahead until
its turn), so the output is the same bytes as one process's and an interrupted run resumes with any
number of evaluators.
"""
from __future__ import annotations

from typing import Callable, Sequence

from replay.run.task import Done
from replay.scale.worker import Evaluator, Job
from replay.transcripts.chains import Unit
from replay.transcripts.journal import Journal


class InOrder:
    """Lines into `journal` in file order, starting at record `done` (0-based), with the records an
    earlier run finished ahead already known."""

    def __init__(self, journal: Journal, done: int):
        self.journal = journal
        self.next = done
        self.pending = dict(journal.ahead)
        self._flush()

    def add(self, index: int, line: str) -> None:
        if index == self.next:
            self.journal.append(line)
            self.next += 1
            self._flush()
        else:
            self.pending[index] = line
            self.journal.append_ahead(index, line)

    def _flush(self) -> None:
        while self.next in self.pending:
            self.journal.append(self.pending.pop(self.next))
            self.next += 1


class Stop(Exception):
    """A record could not be recovered: stop handing out work (the driver reports it)."""


def run_in_process(job: Job, units: Sequence[Unit], on_event: Callable[[str, object], None]) -> None:
    """The units one after another in this process, in file order."""
    ev = Evaluator(job)
    try:
        for unit in sorted(units, key=lambda u: u.records[0]):
            ev.forget()
            ev.run(unit, on_event)
    finally:
        ev.close()


def run_units(job: Job, units: Sequence[Unit], *, workers: int = 1, ray_address: str | None = None,
              on_done: Callable[[Done], bool | None], on_note: Callable[[str], None] | None = None,
              on_progress: Callable[[int], None] | None = None) -> None:
    """Run `units` in this process, on `workers` local processes, or on Ray (`ray_address`);
    `on_done(done)` for every finished item, in the order they finish; it returns False to stop
    the run (a record that could not be repaired). Errors: the failing item's SpecReplayError,
    errors.WorkerDied."""
    def on_event(kind: str, what) -> None:
        if kind == "done" and on_done(what) is False:
            raise Stop()
        elif kind == "note" and on_note is not None:
            on_note(what)
        elif kind == "progress" and on_progress is not None:
            on_progress(what)

    try:
        if ray_address is not None:
            from replay.scale.ray_pool import run_ray
            run_ray(job, units, workers, ray_address, on_event)
        elif workers > 1 and len(units) > 1:
            from replay.scale.local import run_local
            run_local(job, units, workers, on_event)
        else:
            run_in_process(job, units, on_event)
    except Stop:
        return
