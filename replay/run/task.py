"""What a run does with its inputs on its engine, in one shape for every command, so that one process,
local worker processes (scale/pool.py) and Ray actors (scale/ray_pool.py) run it alike:

    task.open(inputs, engine) -> Session     applies the engine (once per process), loads the models once
    session.run(unit, emit)                  the command's one loop: the unit's items in order, emitting
                                             ("start", index) before each and ("done", Done) after each
                                             one not already finished (Unit.finished)
    session.forget()                         start the next unit from nothing (no state from this one)
    session.close()

An item is a record of the file (recover, trace) or a setting of a sweep (tune); a session may also
emit ("progress", n) as it goes. Tasks and their results are picklable: they travel to workers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from replay.run.inputs import Inputs
from replay.runtime.engine import EngineChoice
from replay.transcripts.chains import Unit

Emit = Callable[[str, object], None]


@dataclass(frozen=True)
class Done:
    """One item finished: its 0-based position (in the file; tune: in the sweep) and its result
    (commands/recover.py Recovered, a lightened comparison/trace.py TraceResult, a tuning/runs.py
    SettingRun)."""

    index: int
    result: Any


class Session(Protocol):
    def run(self, unit: Unit, emit: Emit) -> None: ...

    def forget(self) -> None: ...

    def close(self) -> None: ...


class Task(Protocol):
    verb: str  # what a worker is doing, in messages: "recovering", "tracing", "tuning"

    def open(self, inputs: Inputs, engine: EngineChoice) -> Session: ...

    def item_name(self, index: int) -> str: ...


def run_all(session: Session, n: int, on_done: Callable[[Done], None] | None = None) -> list[Done]:
    """Every item of a run of `n` in this process, as one unit, in order; `on_done` after each."""
    out: list[Done] = []

    def emit(kind: str, what: object) -> None:
        if kind == "done":
            out.append(what)  # type: ignore[arg-type]
            if on_done is not None:
                on_done(what)  # type: ignore[arg-type]
    session.run(Unit(tuple(range(n))), emit)
    return out
