"""Recover the real probabilities of recorded transcripts (the main job). Data flows one way:

    file -> Records (transcripts/readers) -> immutable plan of generated tokens (transcripts/plan)
         -> target evaluation with the server's decode schedule (evaluate) -> Truths
         -> per-token comparison with what the server sent (compare, pure) -> TokenReports
         -> repaired copy of each record (repair, a separate pass) and the report (report)

`Recoverer` is the pipeline for one record after another; a run over a file starts at the front door
(run/recover.py: `recover`, the Python API, and the task the commands and workers run).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from replay.commands.recovering.assembly import kept_after, record_report
from replay.commands.recovering.one_token import Evaluated, OneToken
from replay.commands.recovering.options import RecoverOptions
from replay.commands.recovering.outcomes import outcomes_of
from replay.commands.recovering.schedule import ScheduleChoice
from replay.commands.trace import Drafts
from replay.comparison.judgement import judge_record, kernels_cause
from replay.errors import SpecReplayError, located
from replay.evaluation.walk import Truth
from replay.reading.identity import ModelFacts
from replay.reading.record import ReadRecord, read_record
from replay.report.recovery import RecordReport, RecoverResult
from replay.report.repair import Outcome, repair_record, serialise
from replay.runtime.backend import replay_backend, server_backend
from replay.runtime.engine import KernelChoice
from replay.runtime.gguf import windowed_or_recurrent
from replay.runtime.llama import Model, model_params
from replay.settings import BY_ATTR, resolve
from replay.settings.config import GIVEN_HERE
from replay.transcripts.readers import Record, shared_evidence

__all__ = ["RecoverOptions", "Recovered", "Recoverer", "result_of"]


@dataclass(frozen=True)
class Recovered:
    """One record's outcome: its report, and its repaired top-level object (None if not repaired)."""

    report: RecordReport
    container: Any


class Recoverer:
    """Holds the target model and one context; recovers records one after another.

    `flags` are server flags given on our command line (settings table attrs); each record's
    context settings resolve from them, its transcript and /props (settings/config.py). `kernels`: the
    CPU kernels the run computes with (runtime/engine.py), for the report and the judgement of values
    the server computed on kernels none of this host's reproduce.

    A record goes read -> schedule (recovering/schedule.py: the one-token schedule or the server's loop)
    -> computation (recovering/one_token.py, commands/looped.py) -> comparison (recovering/outcomes.py)
    -> judgement (comparison/judgement.py) -> report (recovering/assembly.py)."""

    def __init__(self, model: Model | str | Path, flags: dict | None = None,
                 options: RecoverOptions | None = None, *, records: Sequence[Record] = (),
                 kernels: KernelChoice | None = None, drafts: Drafts | None = None):
        self.flags = dict(flags or {})
        self.options = options or RecoverOptions()
        self.kernels = kernels
        # why each record's batches may have been shared, judged over the whole file (records that ran
        # at the same time show each other): transcripts/readers.py shared_evidence
        self.shared = shared_evidence(records, self.flags, self.options.shared_batches)
        self._records = list(records)
        self.backend = replay_backend(self.flags.get("n_gpu_layers"))
        # the loop's draft models (commands/looped.py); `drafts` given: those an earlier Recoverer loaded
        drafts = drafts if drafts is not None else Drafts(model_params(self.flags))
        if not isinstance(model, Model) and not self.options.only_entries:
            for path in _loop_drafts(model, self._records, self.flags):
                drafts.prefetch(path)  # loads beside the target
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=self.backend.n_gpu_layers,
                                                                  **model_params(self.flags))
        self._piece_cache: dict[int, bytes] = {}
        self._facts: ModelFacts | None = None
        self.one_token = OneToken(self.model, self.options, self._records, self.text,
                                  on_remake=lambda: self.schedule.close())
        self.schedule = ScheduleChoice(self.model, drafts, self.one_token, self._compare,
                                       n_parallel=self.flags.get("n_parallel"), renamed=self.options.renamed_model,
                                       only_entries=self.options.only_entries)

    def close(self) -> None:
        self.one_token.close()
        self.schedule.close()

    def take(self, records: Sequence[Record], *, after_gap: bool = False) -> None:
        """The next records of the same server's run, where they arrive one response at a time (the proxy):
        what the server kept from the records before them (the loop's slots, n-gram tables, the draft
        samplers: commands/looped.py) stays, and their shared batches are judged over them. `after_gap`:
        the server ran requests this replay did not see since the last one, so a record that continues
        what they left is not looped (commands/looped.py LoopValues.skip)."""
        self.shared = shared_evidence(records, self.flags, self.options.shared_batches)
        self._records[:] = records  # OneToken reads the same list
        if after_gap:
            self.forget()
            self.schedule.values().skip()

    def forget(self) -> None:
        """Keep no KV positions for the next record (a new unit of work: transcripts/chains.py), so that what
        an evaluator did before cannot change what it computes next."""
        self.one_token.after_loop = False
        self.one_token.exact_upto = 0
        self.schedule.forget()

    def _flags_as_spelled(self, rec: Record) -> dict[str, Any]:
        """The record's server flags by flag name, ours (given on the command line) over the recorded ones."""
        return {**(rec.flags or {}), **{BY_ATTR[a].flag: v for a, v in self.flags.items() if a in BY_ATTR}}

    # --- the model ----------------------------------------------------------------------

    def facts(self) -> ModelFacts:
        if self._facts is None:
            self._facts = ModelFacts.of(self.model)
        return self._facts

    def piece(self, tid: int) -> bytes:
        b = self._piece_cache.get(tid)
        if b is None:
            b = self._piece_cache[tid] = self.model.piece(tid, special=True)  # refuses ids outside the vocabulary
        return b

    def sent_piece(self, flags: dict[str, Any]) -> Callable[[int], bytes]:
        """The piece the server sends for a token in an entry: control tokens' as text only with --special
        (common_token_to_piece's `special`: tools/server/server-context.cpp:2124, 2147, params_base.special)."""
        if flags.get("--special"):
            return self.piece
        return lambda tid: self.model.piece(tid, special=False)

    def text(self, tid: int) -> str:
        return self.piece(tid).decode("utf-8", "replace")

    # --- one record -----------------------------------------------------------------------

    def recover(self, rec: Record) -> Recovered:
        """Recover one record; every error names the file and record."""
        with located(rec.source, rec.index):  # a bad field, a wrong model, a decode failure: say which record
            return self._recover(rec)

    def _recover(self, rec: Record) -> Recovered:
        """transcript -> tokens -> evaluation -> comparison -> judgement -> report, each stage taking what
        the one before it made; the report is built once, at the end."""
        read = self._read(rec)
        read, run, outcomes = self._compute(read)
        flags = self._flags_as_spelled(rec)
        backend = server_backend(flags, self.options.server_backend)
        by_option = (read.shared == "--shared-batches" or (read.shared or "").endswith(GIVEN_HERE + ")")
                     or (self.options.server_backend is not None and server_backend(flags, None) == "CPU"))
        judged = judge_record([o.report for o in outcomes], shared=read.shared,
                              kernels=kernels_cause(backend, self.backend, self.kernels), by_option=by_option,
                              approximate_from=run.approximate_from, approximate_why=run.approximate_why,
                              loop=run.schedule.get("loop"), backend=self.backend.name,
                              batch_bound=self.options.batch_bound)
        outcomes = [replace(o, report=r) for o, r in zip(outcomes, judged.reports)]
        self.one_token.exact_upto = kept_after(read, run, self.one_token.slot)
        rep = record_report(read, run, judged, options=self.options, server_backend=backend,
                            replay_backend=self.backend.name, cpu=self.kernels, model_file=self.model.path.name)
        return Recovered(rep, repair_record(rec, outcomes, read.post, self.sent_piece(flags)) if rep.recovered else None)

    def _compute(self, read: ReadRecord) -> tuple[ReadRecord, Evaluated, list[Outcome]]:
        """The record's values by the schedule that computes them (recovering/schedule.py): the loop first
        where the one-token schedule is bound to be approximate; else the one-token schedule (again once the
        server's -t is found from its values), then the loop where its values turned out approximate."""
        first = self.schedule.first(read)
        if isinstance(first, tuple):  # the server's batches, from its loop: no one-token evaluation needed
            return read, *first
        run = self.one_token.evaluate(read)
        outcomes = self._compare(read, run.truths, run.approximate_from)
        if self.one_token.find_threads(read, run, outcomes):  # the server's -t, unrecorded, found: again
            read = self._read(read.rec)
            if isinstance(first, str):
                self.schedule.undo()  # the loop ran on the assumed count: again on the found one
            first = self.schedule.first(read)
            if isinstance(first, tuple):
                return read, *first
            run = self.one_token.evaluate(read)
            outcomes = self._compare(read, run.truths, run.approximate_from)
        elif self.one_token.slot is not None and len(self.one_token.slot.ctx.kv_tokens) < run.kv_after:
            run = replace(run, kv_after=len(self.one_token.slot.ctx.kv_tokens))  # searched, not found
        run, looped = self.schedule.after(read, run, tried=first)
        return read, run, looped if looped is not None else outcomes

    def _read(self, rec: Record) -> ReadRecord:
        """Everything later stages need from the record, read once (reading/record.py); the server's -t
        where neither the transcript nor the command line gives it and an earlier record's values told it."""
        read = read_record(rec, self.model, self.flags, build=self.options.build, build_why=self.options.build_why,
                           source=self.options.source,
                           renamed=self.options.renamed_model, facts=self.facts(), piece=self.piece,
                           shared=self.shared.get(rec.index) or rec.busy_when_sent() or (
                               "--shared-batches" if self.options.shared_batches and rec.slots(self.flags.get("n_parallel")) != 1 else None))
        found = self.one_token.threads_found
        if found and read.context.sources.get("threads", "default") == "default":
            context = replace(read.context, threads=found[0], sources={**read.context.sources, "threads": "identified"})
            read = replace(read, context=context)
        return read

    def _compare(self, read: ReadRecord, evaluated: list[Truth], approximate_from: int | None = None) -> list[Outcome]:
        return outcomes_of(read.rec, evaluated, post=read.post, n_probs=read.n_probs, speculative=read.speculative,
                           tolerance=self.options.tolerance, piece=self.text, approximate_from=approximate_from)


def result_of(records: list[Record], done: list[Recovered], original: str) -> RecoverResult:
    """The report of `done`, with the repaired file text when every record of the file was recovered."""
    complete = len(done) == len(records) and all(d.container is not None for d in done)
    res = RecoverResult([d.report for d in done], "")
    if complete and res.failure() is None:  # nothing is written for a transcript judged wrong as a whole
        res.repaired = serialise(records, [d.container for d in done], original)
    return res


def _loop_drafts(model: Path | str, records: Sequence[Record], flags: dict) -> list[str]:
    """The draft model files the loop will likely need, to start loading them beside the target: those of
    records that draft with one (draft-simple, -md or the recorded --spec-draft-model, a file here) on a
    target whose memory cannot drop a suffix (runtime/gguf.py windowed_or_recurrent: the loop runs past 256
    positions). A hint: a file it misses loads when the loop asks, one it names is only loaded early."""
    try:
        if not windowed_or_recurrent(model):
            return []
    except SpecReplayError:
        return []  # the target's own load says what is wrong with it
    out = []
    for rec in records:
        try:
            spec = resolve("speculative", flags=flags, recorded=rec.flags, props=rec.props)
        except SpecReplayError:
            continue
        if spec.draft_model and "draft-simple" in spec.spec_types and Path(spec.draft_model).is_file():
            out.append(str(spec.draft_model))
    return list(dict.fromkeys(out))
