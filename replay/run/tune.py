"""tune from the front door: the Python API, and the task the command and its workers run.

    tune(transcript, model, varies, ...) -> [SettingRun]   inputs checked, engine chosen and applied, the
                                                           records read once, every setting of the sweep
                                                           checked, then replayed (commands/tune.py)

An item of this task is a setting of the sweep (tuning/sweep.py), not a record: each replays the whole
file on a fresh server, so `tune --workers` gives settings to processes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from replay.commands.recover import RecoverOptions
from replay.commands.trace import Drafts
from replay.commands.tune import Prepared, against_baseline, check_settings, prepare, run_setting
from replay.run.engine import Say, choose_engine
from replay.run.inputs import Inputs
from replay.run.task import Done, Emit
from replay.runtime.engine import EngineChoice
from replay.runtime.llama import Model, model_params
from replay.settings.server_flags import from_mapping
from replay.transcripts.chains import Unit
from replay.tuning.runs import SettingRun
from replay.tuning.sweep import Setting, sweep


@dataclass(frozen=True)
class TuneTask:
    """Replay the settings of the sweep `varies` (the transcript's own first) with the server flags given
    here (settings attrs), in the loop shape of `build` (else each record's build_info), `samples` passes
    each."""

    flags: dict = field(default_factory=dict)
    varies: tuple[str, ...] = ()
    build: int | None = None
    renamed: bool = False
    samples: int = 1
    verb = "tuning"

    def open(self, inputs: Inputs, engine: EngineChoice) -> "TuneSession":
        return TuneSession(self, inputs, engine)

    def item_name(self, index: int) -> str:
        return f"setting {index + 1} of the sweep"

    def settings(self) -> list[Setting]:
        return sweep(self.varies)

    def options(self) -> RecoverOptions:
        """The options that choose the engine (the libllama of --build)."""
        return RecoverOptions(build=self.build)


class TuneSession:
    """The target and draft models loaded and the records read once (the engine applied first)."""

    def __init__(self, task: TuneTask, inputs: Inputs, engine: EngineChoice):
        engine.apply()
        self.task = task
        self.records = inputs.records
        self.flags = engine.flags(task.flags)
        self.target = Model(inputs.model, **model_params(self.flags))
        self.drafts = Drafts(model_params(self.flags))
        self._prepared: list[Prepared] | None = None

    @property
    def prepared(self) -> list[Prepared]:
        if self._prepared is None:
            self._prepared = prepare(self.records, self.target, self.flags, build=self.task.build,
                                     renamed=self.task.renamed)
        return self._prepared

    @property
    def samples(self) -> int:
        """--samples, or 1 where every record samples at temperature 0 (more passes would draw nothing new)."""
        return self.task.samples if any(p.read.settings.params.temp > 0 for p in self.prepared) else 1

    def check(self) -> None:
        """Refuse, before anything is replayed, a setting the loop cannot run (commands/tune.py check_settings)."""
        check_settings(self.prepared, self.task.settings(), self.flags, self.drafts)

    def run(self, unit: Unit, emit: Emit) -> None:
        settings = self.task.settings()
        for k in unit.records:
            emit("start", k)
            run = run_setting(self.prepared, settings[k], self.target, flags=self.flags, drafts=self.drafts,
                              renamed=self.task.renamed, samples=self.samples,
                              progress=lambda n: emit("progress", n))
            emit("done", Done(k, run))

    def forget(self) -> None:
        pass  # every setting runs on a server of its own (commands/tune.py run_setting)

    def close(self) -> None:
        self.target.close()


def run_sweep(session: TuneSession, progress: Callable[[int], None] | None = None) -> list[SettingRun]:
    """Every setting in this process (checked first: TuneSession.check), compared with the baseline's tokens."""
    n = len(session.task.settings())
    out: list[SettingRun] = []

    def emit(kind: str, what: Any) -> None:
        if kind == "done":
            out.append(what.result)
        elif kind == "progress" and progress is not None:
            progress(what)
    session.run(Unit(tuple(range(n))), emit)
    return against_baseline(out)


def tune(transcript: str | Path | dict | list, model: str | Path, varies: Sequence[str], *,
         flags: Mapping[str, Any] | None = None, request: dict | None = None, build: int | None = None,
         renamed: bool = False, samples: int = 1, libllama: str | None = None, server_cpu: str | None = None,
         progress: Callable[[int], None] | None = None, say: Say | None = None) -> list[SettingRun]:
    """Replay every record of a transcript under every setting of the sweep `varies` (spelled as
    llama-server spells them: "--spec-draft-n-max=2,4"), the transcript's own setting first, as
    `spec-replay tune` does (commands/tune.py says what the counts are). `flags` as llama-server spells
    them (settings attrs too); the engine is chosen as the command line chooses it (run/engine.py)."""
    attrs, notes = from_mapping({k: str(v) if isinstance(v, Path) else v for k, v in (flags or {}).items()}, "trace")
    for note in notes:
        warnings.warn(note, stacklevel=2)
    inputs = Inputs.of_object(transcript, model, request=request, renamed=renamed) \
        if isinstance(transcript, (dict, list)) else Inputs.read(transcript, model, request=request, renamed=renamed)
    task = TuneTask(attrs, tuple(varies), build, renamed, samples)
    task.settings()  # a bad --vary before anything loads
    engine = choose_engine(inputs, flags=attrs, options=RecoverOptions(build=build), libllama=libllama,
                           server_cpu=server_cpu, say=say)
    session = task.open(inputs, engine)
    try:
        session.check()
        return run_sweep(session, progress)
    finally:
        session.close()

