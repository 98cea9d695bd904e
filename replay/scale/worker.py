"""One evaluator: a run's task opened once on its inputs and engine, items run by their position.

The same object serves a local worker process (pool.py), a Ray actor (ray_pool.py) and the driver's
own process (pool.py run_in_process). What travels is one Job: the inputs as their text (each
evaluator reads the records again), the engine the driver chose (applied before anything loads), and
the task (run/recover.py, run/trace.py, run/tune.py), which says what an item is and runs the units.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from replay.run.inputs import Inputs
from replay.run.task import Session, Task
from replay.runtime.engine import EngineChoice
from replay.transcripts.chains import Unit


@dataclass(frozen=True)
class Job:
    """What every evaluator of one run needs (picklable)."""

    inputs: Inputs
    engine: EngineChoice
    task: Task

    @property
    def verb(self) -> str:
        return self.task.verb

    def item_name(self, index: int | None) -> str:
        """The item an evaluator was on, as messages name it."""
        if index is None:
            return f"{self.inputs.source} (loading the model)"
        return f"{self.inputs.source}, {self.task.item_name(index)}"

    def on_node(self, model: str) -> "Job":
        """This job with the model at its path on another machine (a Ray node)."""
        return replace(self, inputs=replace(self.inputs, model=model))


class Evaluator:
    """The job's session, opened once: the models loaded once; one unit after another."""

    def __init__(self, job: Job):
        self.job = job
        self.session: Session = job.task.open(job.inputs, job.engine)

    def forget(self) -> None:
        """Start the next unit from nothing: no KV kept (recover), an empty server slot (trace)."""
        self.session.forget()

    def run(self, unit: Unit, emit: Callable[[str, object], None]) -> None:
        self.session.run(unit, emit)

    def close(self) -> None:
        self.session.close()
