"""What other speculative settings would have done on the user's own traffic (`spec-replay tune`).

For every setting of a sweep (tuning/sweep.py: the transcript's own, then each combination of the
`--vary` lists), the server's loop (commands/trace.py) is replayed over every record in file order on a
fresh server (trace_state.ServerState: ngram-mod's table and each slot's state live as long as the
server, as they did for the transcript), with each record's prompt and request (seed, sampling, stop).
Each run counts what the server would have done (tuning/runs.py): its target and draft-model decodes by
batch size, drafted and accepted tokens, acceptance by draft position, and the verifier's expected
acceptance along the run (loop/expectation.py).

What the counts are (the report says which, record by record):

* The transcript's own setting is the baseline: its replay must reproduce every token and the draft
  totals the server reported (timings.draft_n, draft_n_accepted), as trace does. Where it does not, the
  sweep is refused: nothing else could then be trusted.
* At temperature 0 sampling is an argmax: every setting emits the same tokens, and speculation changes
  only how many decodes produce them. The counts are exact for this traffic. The sweep checks that the
  tokens are the same; where a setting's verify batches move a near-tie (their numerics differ from
  another batch size's), the record is flagged, not hidden.
* At temperature > 0 each setting draws its own sample from the same distribution: the counts are one
  run with the request's seed, the expectation is exact over the verifier's draws given each draft, and
  `samples` > 1 adds runs with other seeds (tuning/stats.py gives their mean and interval).

A speed prediction prices each setting's generation work with a cost table (tuning/costs.py), measured on
this host (tuning/measure.py) and scaled to the transcript's timings where it has them, or fitted to those
timings alone (tuning/calibrate.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from replay.commands.trace import Drafts, draft_model_of, trace_read
from replay.commands.trace_state import ServerState
from replay.errors import SpecReplayError, TranscriptError, located
from replay.loop.expectation import not_expectable
from replay.loop.replayable import check_replayable, drafts_with_model
from replay.reading.record import ReadRecord, read_record
from replay.runtime.llama import Model
from replay.schedule.memory import SlotConfig
from replay.schedule.prompt import MessageSpans
from replay.settings import draft_thread_count, resolve
from replay.tokens.prompt_ids import message_spans
from replay.transcripts.readers import Record, shared_evidence
from replay.tuning import calibrate
from replay.tuning.costs import CostTable
from replay.tuning.measure import measure
from replay.tuning.runs import Counts, Expected, RecordRun, SettingRun, positions, sample_seeds
from replay.tuning.sweep import BASELINE, Setting

Progress = Callable[[int], None]  # called with 1 after each record run
RECORDED = "the recorded tokens"
# a setting whose tokens differ from the recorded ones (at t > 0: a rejection verifier, whose draft and target
# draws are coupled; following the recorded tokens instead would bias where its drafts start)
THIS_RUN = "this run's tokens"


@dataclass(frozen=True)
class Prepared:
    """A record read once (reading/record.py) with its prompt's message spans: every setting replaces only
    its speculative flags."""

    rec: Record
    read: ReadRecord
    spans: MessageSpans


def prepare(records: Sequence[Record], target: Model, flags: Mapping[str, Any], *, build: int | None = None,
            renamed: bool = False) -> list[Prepared]:
    shared = shared_evidence(records, flags, False, cells=False)
    out = []
    for rec in records:
        with located(rec.source, rec.index):
            read = read_record(rec, target, flags, command="trace", build=build, renamed=renamed,
                               shared=shared.get(rec.index))
            out.append(Prepared(rec, read, message_spans(rec, target, list(read.prompt))))
    return out


def _with_seed(read: ReadRecord, seed: int) -> ReadRecord:
    return replace(read, settings=replace(read.settings, params=replace(read.settings.params, seed=seed)))


def _refuse(rec: Record, res) -> TranscriptError:
    what = (f"token {res.first_divergence} differs" if res.first_divergence is not None else
            f"its draft totals differ (replayed {res.draft_n}/{res.draft_n_accepted}, the server "
            f"{res.server_draft_n}/{res.server_draft_n_accepted})" if res.server_draft_n is not None
            else "it carries no draft totals to check")
    return TranscriptError(f"the transcript's own settings do not reproduce it ({what}): a sweep against it would "
                           "mean nothing; `spec-replay trace` shows why", source=rec.source, record=rec.index)


def spec_of(p: Prepared, setting: Setting, flags: Mapping[str, Any]):
    """The record's speculative flags under `setting` (the baseline: as read). The draft model is never
    varied (tuning/sweep.py NOT_VARIED): it stays the one read found (-md, or the transcript's found here)."""
    if setting is BASELINE:
        return p.read.spec
    with located(p.rec.source, p.rec.index):
        spec = resolve("speculative", flags={**flags, **setting.flags}, recorded=p.rec.flags, props=p.rec.props)
    drafted = p.read.spec
    return replace(spec, draft_model=drafted.draft_model,
                   sources={**spec.sources, "draft_model": drafted.sources.get("draft_model", "default")})


def check_settings(prepared: Sequence[Prepared], settings: Sequence[Setting], flags: Mapping[str, Any],
                   drafts: Drafts) -> None:
    """Refuse, before anything is replayed, a setting the loop cannot run on some record (a type it does not
    replay, draft-simple with no draft model file), in one line naming the setting."""
    for setting in settings:
        for p in prepared:
            spec = spec_of(p, setting, flags)
            era = p.read.shape.era
            needs = drafts_with_model(spec, era)
            try:
                with located(p.rec.source, p.rec.index):
                    if needs and spec.draft_model:
                        draft_model_of(drafts, spec)
                    check_replayable(spec, era, has_draft_model=bool(spec.draft_model))
            except SpecReplayError as e:
                e.args = (f"setting {setting.spelled!r}: {e}",)
                raise


def run_setting(prepared: Sequence[Prepared], setting: Setting, target: Model, *, flags: Mapping[str, Any],
                drafts: Drafts, renamed: bool = False, samples: int = 1, progress: Progress | None = None) -> SettingRun:
    """Every record under one setting, on a fresh server per pass: the request's seeds, then (samples > 1)
    one pass per further seed. Compared with the baseline afterwards (against_baseline)."""
    flags = dict(flags)
    reads = [p.read if setting is BASELINE else replace(p.read, spec=spec_of(p, setting, flags)) for p in prepared]
    out: list[RecordRun] = []
    with ServerState(flags.get("n_parallel")) as state:
        for p, read in zip(prepared, reads):
            with located(p.rec.source, p.rec.index):
                res = trace_read(read, target, slot_state=state.slot(p.rec), drafts=drafts, renamed=renamed,
                                 spans=p.spans, expect=True, explain=False)  # why it parts: `trace` says
            if setting is BASELINE and res.reproduced is not True:
                raise _refuse(p.rec, res)
            ids = tuple(e.id for e in res.emitted)
            why = not_expectable(res.settings.params, res.settings.grammar is not None)
            tried, kept = positions(res.steps)
            out.append(RecordRun(p.rec.index, ids, res.settings.params.temp, len(res.steps) - 1, res.draft_n,
                                 res.draft_n_accepted, res.decodes.get("target", (0, 0)),
                                 res.decodes.get("draft", (0, 0)), res.work, tried, kept,
                                 expected=None if why else Expected.of(res.steps, THIS_RUN), no_expectation=why))
            if progress:
                progress(1)
    for seed_k in range(1, samples):
        with ServerState(flags.get("n_parallel")) as state:
            for p, read, run in zip(prepared, reads, out):
                seed = sample_seeds(read.settings.params.seed, seed_k + 1)[-1]
                with located(p.rec.source, p.rec.index):
                    res = trace_read(_with_seed(read, seed), target, slot_state=state.slot(p.rec), drafts=drafts,
                                     renamed=renamed, spans=p.spans, explain=False)
                run.samples.append(Counts(seed, res.draft_n, res.draft_n_accepted, res.work))
                if progress:
                    progress(1)
    return SettingRun(setting, out)


def against_baseline(runs: list[SettingRun]) -> list[SettingRun]:
    """Each record's tokens under every setting against the baseline's (which are the recorded ones: the
    baseline reproduced them), and so the path each expectation was taken along. Returns `runs`."""
    base = runs[0].records
    for run in runs:
        for r, b in zip(run.records, base):
            same = r.emitted == b.emitted
            r.same_tokens = None if run is runs[0] else same
            if r.expected is not None and same:
                r.expected = replace(r.expected, along=RECORDED)
    return runs


def timed_records(prepared: Sequence[Prepared], baseline: SettingRun) -> list[calibrate.Timed]:
    """The baseline's records whose timings can calibrate a cost table (tuning/calibrate.py usable)."""
    out = []
    for p, run in zip(prepared, baseline.records):
        t = calibrate.usable(run.work, p.read.timings, p.read.shared)
        if t is not None:
            out.append(t)
    return out


def measure_here(prepared: Sequence[Prepared], runs: Sequence[SettingRun], target: Model, *, flags: Mapping[str, Any],
                 drafts: Drafts) -> CostTable:
    """The cost table measured on this host (tuning/measure.py) for every batch size the sweep decodes, at
    the records' mean KV depth during generation, in a slot made as the first record's server made it."""
    first = prepared[0].read
    drafting = next((run for run in runs if any(r.draft[0] for r in run.records)), None)
    spec = spec_of(prepared[0], drafting.setting, flags) if drafting is not None else first.spec
    mtp = drafting is not None and "draft-mtp" in spec.spec_types
    draft = draft_model_of(drafts, spec) if drafting is not None and spec.draft_model else None
    t_sizes = {b for run in runs for r in run.records for b in r.work.target_batches} | {1}
    d_sizes = {b for run in runs for r in run.records for b in r.work.draft_batches}
    depth = round(sum(len(p.read.prompt) + len(r.emitted) / 2 for p, r in zip(prepared, runs[0].records))
                  / len(prepared))
    slot = SlotConfig.of(first.context, prepared[0].rec.flags, first.shape.build, spec)
    return measure(target, draft, slot, first.settings.params, target_sizes=sorted(t_sizes),
                   draft_sizes=sorted(d_sizes), depth=depth, tokens=list(first.prompt),
                   draft_types=(spec.draft_cache_type_k, spec.draft_cache_type_v),
                   draft_threads=draft_thread_count(spec) if draft is not None else None, mtp=mtp)


def cost_table(prepared: Sequence[Prepared], runs: Sequence[SettingRun], target: Model, *, how: str,
               flags: Mapping[str, Any], drafts: Drafts) -> tuple[CostTable, list[str]]:
    """The table a speed prediction uses and notes on it. `how`: "measure" (this host, scaled to the
    timings where the transcript has usable ones) or "timings" (fitted to them alone)."""
    timed = timed_records(prepared, runs[0])
    notes = []
    left_out = len(prepared) - len(timed)
    if left_out:
        notes.append(f"{left_out} of {len(prepared)} records carry no timings usable for calibration (none sent, "
                     "other tokens counted, or batches shared with other requests)")
    if how == "timings":
        return calibrate.fit(timed), notes
    table = measure_here(prepared, runs, target, flags=flags, drafts=drafts)
    if timed:
        table = calibrate.scale(table, timed)
    else:
        notes.append("no usable timings: the speed is this host's, not the server's")
    return table, notes
