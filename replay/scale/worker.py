"""One evaluator: the target model loaded once, records recovered (or traced) by their position in
the file.

The same object serves a local worker process (local.py) and a Ray actor (ray_pool.py). It parses the
transcript text itself (what travels is the text, once, not Python objects), chooses the driver's
libllama before loading anything, and recovers each unit's records in order in one context, so that
a record served from the server's cache follows the record that filled it (transcripts/chains.py). For
`trace --workers` (Job.trace set) it traces them instead, each unit from an empty server slot
(commands/trace_state.py says which records share one).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from replay.commands.recover import Recoverer, RecoverOptions
from replay.report.recovery import RecordReport
from replay.report.repair import jsonl_line
from replay.transcripts.chains import Unit


@dataclass(frozen=True)
class TraceOptions:
    """trace's loop choice (`--build`, `--source`): a Job with these traces instead of recovering."""

    build: int | None = None
    source: str | None = None
    renamed: bool = False  # --renamed-model (reading/identity.py)


@dataclass(frozen=True)
class TuneOptions:
    """tune's sweep (`--vary`, `--build`, `--renamed-model`, `--samples`): a Job with these replays one
    setting per unit (Unit.records holds its index in the sweep) instead of recovering."""

    varies: tuple[str, ...]
    build: int | None = None
    renamed: bool = False
    samples: int = 1


@dataclass(frozen=True)
class Job:
    """What every evaluator of one run needs (picklable)."""

    text: str  # the transcript file's text
    source: str  # its name, for messages
    request: dict | None  # --request, for a bare response
    model: str  # the target GGUF path (as seen by the evaluator)
    flags: dict = field(default_factory=dict)  # our server flags (settings table attrs)
    options: RecoverOptions = field(default_factory=RecoverOptions)
    threads: int | None = None  # -t per evaluator (values do not depend on it)
    libllama: str | None = None  # the driver's libllama file (None: the binding's own)
    trace: TraceOptions | None = None  # trace the records instead of recovering them
    tune: TuneOptions | None = None  # replay settings of a sweep instead

    @staticmethod
    def from_files(transcript: str, request_file: str | None, model: str, flags: dict, workers: int,
                   **kind: Any) -> "Job":
        """A job over the transcript file for `workers` local processes, computing with the driver's libllama,
        each with its share of this machine's cores unless -t was given; `kind`: trace= or tune= options."""
        from replay.runtime.binding import loaded_path
        from replay.transcripts.files import read_request
        from replay.transcripts.readers import read_source
        return Job(read_source(Path(transcript)), str(transcript), read_request(request_file) if request_file else None,
                   str(Path(model).resolve()), flags, threads=flags.get("threads") or default_threads(workers),
                   libllama=None if loaded_path() is None else str(loaded_path()), **kind)

    @property
    def verb(self) -> str:
        return "tuning" if self.tune is not None else "recovering" if self.trace is None else "tracing"


@dataclass(frozen=True)
class Done:
    """One recovered record: its 0-based position, its repaired JSONL line (None when it could not be
    repaired: its report says why) and its report."""

    index: int
    line: str | None
    report: RecordReport


@dataclass(frozen=True)
class Tuned:
    """One setting of a sweep over the whole file: its index in the sweep and its SettingRun."""

    index: int
    run: Any


@dataclass(frozen=True)
class Traced:
    """One traced record: its 0-based position and its TraceResult (lightened: comparison/trace.py)."""

    index: int
    result: Any


class Evaluator:
    def __init__(self, job: Job):
        from replay.runtime.binding import LibChoice, use_cpu_variant, use_libllama
        from replay.transcripts.readers import read_text
        use_libllama(LibChoice(None if job.libllama is None else Path(job.libllama), "the driver's choice"))
        cpu = job.options.cpu  # the driver's kernels (cli/kernels.py), also on a Ray node that runs them
        if cpu is not None and cpu.variant is not None:
            use_cpu_variant(cpu.variant)
        self.job = job
        self.records = read_text(job.text, job.source, job.request)
        flags = dict(job.flags)
        if job.threads:
            flags["threads"] = job.threads
        self.flags = flags
        self.recoverer: Recoverer | None = None
        self.target = self.drafts = None  # trace's target and draft models
        self.prepared = None  # tune's records, read once
        if job.trace is None and job.tune is None:
            self.recoverer = Recoverer(job.model, flags, job.options, records=self.records)
        else:
            from replay.commands.trace import Drafts
            from replay.runtime.llama import Model, model_params
            self.target, self.drafts = Model(job.model, **model_params(flags)), Drafts(model_params(flags))

    def forget(self) -> None:
        """Start the next unit from nothing: no KV kept (recover), an empty server slot (trace)."""
        if self.recoverer is not None:
            self.recoverer.forget()

    def run(self, unit: Unit, emit: Callable[[str, object], None]) -> None:
        """Recover (trace) `unit`'s records in order: emit("start", index) before each, emit("done",
        Done | Traced) after each one not already finished."""
        if self.job.tune is not None:
            self._tune(unit, emit)
            return
        if self.target is not None:
            self._trace(unit, emit)
            return
        for k in unit.records:
            emit("start", k)
            got = self.recoverer.recover(self.records[k])
            if k not in unit.finished:
                line = jsonl_line(got.container) if got.container is not None else None
                emit("done", Done(k, line, got.report))

    def _trace(self, unit: Unit, emit: Callable[[str, object], None]) -> None:
        from replay.commands.trace import trace_record
        from replay.commands.trace_state import ServerState
        from replay.transcripts.concurrency import shared_evidence
        opts = self.job.trace
        shared = shared_evidence(self.records, self.flags.get("n_parallel"), False)
        with ServerState(self.flags.get("n_parallel")) as state:  # a unit shares nothing with any other
            for k in unit.records:
                emit("start", k)
                rec = self.records[k]
                res = trace_record(rec, self.target, flags=self.flags, build=opts.build,
                                   source=opts.source and Path(opts.source), slot_state=state.slot(rec),
                                   drafts=self.drafts, renamed=opts.renamed, shared=shared.get(rec.index))
                emit("done", Traced(k, res.lighten()))

    def _tune(self, unit: Unit, emit: Callable[[str, object], None]) -> None:
        from replay.commands.tune import prepare, run_setting
        from replay.tuning.sweep import sweep
        opts = self.job.tune
        if self.prepared is None:
            self.prepared = prepare(self.records, self.target, self.flags, build=opts.build, renamed=opts.renamed)
        settings = sweep(opts.varies)
        for k in unit.records:
            emit("start", k)
            run = run_setting(self.prepared, settings[k], self.target, flags=self.flags, drafts=self.drafts,
                              renamed=opts.renamed, samples=opts.samples)
            emit("done", Tuned(k, run))

    def close(self) -> None:
        if self.recoverer is not None:
            self.recoverer.close()
        if self.target is not None:
            self.target.close()


def default_threads(workers: int) -> int:
    """Threads per evaluator when -t is not given: this machine's cores shared out."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))
