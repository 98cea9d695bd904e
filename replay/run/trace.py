"""trace from the front door: the Python API, and the task the command and its workers run.

    trace(transcript, model, ...) -> [TraceResult]   inputs checked, engine chosen and applied, every
                                                      record through the server's loop in file order, as
                                                      requests to one server (commands/trace.py)

Records of one file are requests to one server, in order: within a unit they share its state across
requests (commands/trace_state.py ServerState: n-gram tables, a slot's draft sampler and memory); units
share nothing, which is how `trace --workers` splits a file (trace_units).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from replay.commands.recover import RecoverOptions
from replay.commands.trace import Drafts, trace_prompt, trace_record
from replay.commands.trace_state import ServerState
from replay.comparison.trace import TraceResult
from replay.report import schema as report_json
from replay.run.engine import Say, choose_engine
from replay.run.inputs import Inputs
from replay.run.task import Done, Emit, run_all
from replay.runtime.engine import EngineChoice, KernelChoice
from replay.runtime.llama import Model, model_params
from replay.settings.server_flags import from_mapping
from replay.transcripts.chains import Unit
from replay.transcripts.readers import shared_evidence


@dataclass(frozen=True)
class TraceTask:
    """Trace records with the server flags given here (settings attrs), in the loop shape of `source`
    (a llama.cpp checkout), else of `build`, else of each record's build_info. `light`: results drop
    what only explaining a divergence needs once explained (TraceResult.lighten: ~0.6 MB a token)."""

    flags: dict = field(default_factory=dict)
    build: int | None = None
    source: str | None = None
    renamed: bool = False
    light: bool = True
    shared_batches: bool = False  # --shared-batches: the user says the server ran these requests beside others
    verb = "tracing"

    def open(self, inputs: Inputs, engine: EngineChoice) -> "TraceSession":
        return TraceSession(self, inputs, engine)

    def item_name(self, index: int) -> str:
        return f"record {index + 1}"

    def options(self) -> RecoverOptions:
        """The options that choose the engine (the libllama of --build, --source)."""
        return RecoverOptions(build=self.build, source=self.source and Path(self.source),
                              shared_batches=self.shared_batches)


def trace_report(results: Sequence[tuple[int | None, TraceResult]], piece: Callable[[int], str],
                 kernels: KernelChoice | None) -> dict:
    """The report of a trace (`spec-replay trace --json`, docs/report-format.md): one record's fields at
    the top, several records under "records" with their numbers; the kernels replayed on, where chosen."""
    head = {"format": report_json.TRACE_FORMAT, "version": report_json.REPORT_VERSION}
    cpu = {} if kernels is None else {"kernels": kernels.to_json()}
    if len(results) == 1:
        return {**head, **results[0][1].to_json(piece), **cpu}
    return {**head, "records": [dict(r.to_json(piece), record=index) for index, r in results], **cpu}


class Traced(list):
    """The TraceResults of a run, in file order, with `report`: what `spec-replay trace --json` prints for
    them (trace_report)."""

    report: dict


class TraceSession:
    """The target and the draft models loaded once (the engine applied first)."""

    def __init__(self, task: TraceTask, inputs: Inputs, engine: EngineChoice):
        engine.apply()
        self.task = task
        self.records = inputs.records
        self.flags = engine.flags(task.flags)
        self.target = Model(inputs.model, **model_params(self.flags))
        self.drafts = Drafts(model_params(self.flags))
        self.shared = shared_evidence(self.records, self.flags, task.shared_batches, cells=False)
        # the build whose loop is traced: --build, else the one the engine chose by evidence (run/build_choice.py)
        self.build = task.build if task.build is not None or task.source else engine.build

    def run(self, unit: Unit, emit: Emit) -> None:
        """The unit's records in order on one fresh server (ServerState)."""
        t = self.task
        with ServerState(self.flags.get("n_parallel")) as state:
            for k in unit.records:
                emit("start", k)
                rec = self.records[k]
                res = trace_record(rec, self.target, flags=self.flags, build=self.build,
                                   source=t.source and Path(t.source), slot_state=state.slot(rec),
                                   drafts=self.drafts, renamed=t.renamed, shared=self.shared.get(rec.index))
                emit("done", Done(k, res.lighten() if t.light else res))

    def piece(self, tid: int) -> str:
        return self.target.piece(tid).decode("utf-8", "replace")

    def prompt(self, text: str) -> TraceResult:
        """The loop from scratch on a text prompt (trace --prompt: commands/trace.py trace_prompt)."""
        t = self.task
        return trace_prompt(self.target, text, flags=self.flags, build=self.build, source=t.source and Path(t.source),
                            drafts=self.drafts)

    def forget(self) -> None:
        pass  # every unit runs on a server of its own (run)

    def close(self) -> None:
        self.target.close()


def trace(transcript: str | Path | dict | list, model: str | Path, *, flags: Mapping[str, Any] | None = None,
          request: dict | None = None, build: int | None = None, source: Path | None = None,
          renamed: bool = False, libllama: str | None = None, server_cpu: str | None = None,
          say: Say | None = None) -> Traced:
    """Trace every record of a transcript (a path, or an already-parsed object), in order, as requests to
    one server, as `spec-replay trace` does. `flags` are the server's flags as llama-server spells them
    ({"-md": "draft.gguf", "--spec-type": "draft-simple", "--spec-draft-n-max": 8}; settings attrs too):
    set aside with a warning where they change nothing trace computes, SettingsError where trace cannot
    reproduce them or llama-server has no such flag (settings/server_flags.py). The libllama and CPU
    kernels are chosen as the command line chooses them (run/engine.py; `say` hears what it says), and
    the list's `report` is what the command line's --json prints.

        >>> from replay.paths import FIXTURES
        >>> [r.reproduced for r in trace(FIXTURES / "transcripts" / "tiny-draft-simple.json", FIXTURES / "tiny-target.gguf",
        ...                              flags={"-md": FIXTURES / "tiny-draft.gguf"})]
        [True]
    """
    attrs, notes = from_mapping({k: str(v) if isinstance(v, Path) else v for k, v in (flags or {}).items()}, "trace")
    for note in notes:
        warnings.warn(note, stacklevel=2)
    inputs = Inputs.of_object(transcript, model, request=request, renamed=renamed) \
        if isinstance(transcript, (dict, list)) else Inputs.read(transcript, model, request=request, renamed=renamed)
    task = TraceTask(attrs, build, str(source) if source else None, renamed, light=False)
    engine = choose_engine(inputs, flags=attrs, options=task.options(), libllama=libllama, server_cpu=server_cpu,
                           say=say)
    session = task.open(inputs, engine)
    try:
        done = run_all(session, len(inputs.records))
        out = Traced(d.result for d in done)
        out.report = trace_report([(inputs.records[d.index].index, d.result) for d in done], session.piece,
                                  engine.kernels)
        return out
    finally:
        session.close()
