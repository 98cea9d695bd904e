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
from typing import Any, Sequence

from replay.comparison.judgement import judgement_notes
from replay.comparison.values import (
    BATCH_BOUND,
    DEFAULT_TOLERANCE,
    TokenReport,
    compare,
    judge_numerics,
    numerics_cause,
    numerics_kind,
    server_values,
)
from replay.commands.looped import LoopValues
from replay.commands.trace import Drafts
from replay.errors import SpecReplayError, Unaligned, located
from replay.evaluation.threads import matching_threads
from replay.evaluation.walk import PieceIndex, Truth, truths
from replay.numerics.server_probs import pre_sampling
from replay.reading.identity import ModelFacts
from replay.reading.record import ReadRecord, read_record
from replay.report.recovery import RecordReport, RecoverResult
from replay.report.repair import Outcome, repair_record, serialise
from replay.runtime.backend import kernels_differ, replay_backend, server_backend
from replay.runtime.binding import library_in_use
from replay.runtime.engine import KernelChoice
from replay.runtime.gguf import windowed_or_recurrent
from replay.runtime.llama import Model, model_params
from replay.schedule.memory import SlotConfig, SlotMemory, schedule_of
from replay.schedule.prefix import FRESH, Prefix, plan_checkpointed, plan_prefix
from replay.schedule.prompt import NO_SPANS
from replay.schedule.exactness import approximate_from
from replay.schedule.rows import ALONE, row_counts, scored_by, split_kv, tiled_verify
from replay.settings import BY_ATTR, longest_draft, resolve
from replay.settings.config import GIVEN_HERE
from replay.tokens.prompt_ids import message_spans
from replay.transcripts.entries import drafted, n_generated, n_prompt_cached
from replay.transcripts.plan import Gap, Known, entry_at
from replay.transcripts.readers import Record, shared_evidence


@dataclass(frozen=True)
class RecoverOptions:
    """How recover evaluates, besides the server's own settings (settings.ContextConfig)."""

    tolerance: float = DEFAULT_TOLERANCE
    batch_bound: float = BATCH_BOUND  # comparison/values.py judge_numerics
    server_backend: str | None = None  # --server-backend: what the server computed on, when no flag says
    build: int | None = None  # --build N: the server's llama.cpp build, over the transcript's build_info
    build_why: str | None = None  # why `build` where the run chose it (run/build_choice.py), not --build
    build_decided: bool = True  # False: no evidence told the build (the default replayed; values approximate)
    source: Path | None = None  # --source DIR: the server's llama.cpp checkout (its loop shape)
    reuse_prefix: bool = True  # keep KV of a prompt prefix shared with the previous record, where exact
    shared_batches: bool = False  # --shared-batches: the user says the server batched these requests with others
    renamed_model: bool = False  # --renamed-model: -m is the server's file under another name (reading/identity.py)
    only_entries: int = 0  # evaluate the prompt and only this many generated tokens; 0: all (run/kernels/processes.py)


@dataclass(frozen=True)
class Evaluated:
    """What evaluating one record gave: its truths, where the text stopped aligning, how the prompt
    was laid on the slot's memory, the schedule replayed, and the KV length after."""

    truths: list[Truth]
    unaligned: Unaligned | None
    prefix: Prefix
    schedule: dict
    kv_after: int
    # the first token whose values are approximate (comparison/values.py APPROXIMATE_DRIFT), and why;
    # None: every value is computed as the server computed it
    approximate_from: int | None = None
    approximate_why: str = ""
    # the decode that computed each evaluated token's values on the server (schedule/rows.py), token by token
    kinds: tuple[str | None, ...] = ()
    notes: tuple[str, ...] = ()  # what the loop replay said of this record (loop/loop.py)


@dataclass(frozen=True)
class LoopHeld:
    """The loop's values for a record, held against the transcript (Recoverer._looped): its truths and
    their outcomes, the report's `schedule.loop`, and the prompt schedule, prefix and notes of the loop."""

    truths: list[Truth]
    outcomes: list[Outcome]
    info: dict
    schedule: dict | None
    prefix: Prefix
    notes: tuple[str, ...]


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
    the server computed on kernels none of this host's reproduce."""

    def __init__(self, model: Model | str | Path, flags: dict | None = None,
                 options: RecoverOptions | None = None, *, records: Sequence[Record] = (),
                 kernels: KernelChoice | None = None):
        self.flags = dict(flags or {})
        self.options = options or RecoverOptions()
        self.kernels = kernels
        # why each record's batches may have been shared, judged over the whole file (records that ran
        # at the same time show each other): transcripts/readers.py shared_evidence
        self.shared = shared_evidence(records, self.flags, self.options.shared_batches)
        self._records = list(records)
        self.backend = replay_backend(self.flags.get("n_gpu_layers"))
        self._drafts = Drafts(model_params(self.flags))  # the loop's draft models (commands/looped.py)
        if not isinstance(model, Model) and not self.options.only_entries:
            for path in _loop_drafts(model, self._records, self.flags):
                self._drafts.prefetch(path)  # loads beside the target
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=self.backend.n_gpu_layers,
                                                                  **model_params(self.flags))
        self._slot: SlotMemory | None = None
        self._slot_cfg: SlotConfig | None = None
        self._pieces: PieceIndex | None = None
        self._exact_upto = 0  # KV positions the previous record left as the server computed them
        self._piece_cache: dict[int, bytes] = {}
        self._facts: ModelFacts | None = None
        # the server's -t found from a record's values (evaluation/threads.py), for the records after it: the
        # counts that reproduced it, the smallest used; None: not looked for or not found
        self._threads_found: tuple[int, ...] | None = None
        self._loop: LoopValues | None = None  # the server's loop, where the one-token schedule cannot give its batches
        self._after_loop = False  # the previous record's values came from the loop (its KV is not in this slot)

    def close(self) -> None:
        if self._slot is not None:
            self._slot.close()
            self._slot = None
        if self._loop is not None:
            self._loop.close()

    def forget(self) -> None:
        """Keep no KV positions for the next record (a new unit of work: transcripts/chains.py), so that what
        an evaluator did before cannot change what it computes next."""
        self._after_loop = False
        self._exact_upto = 0
        if self._loop is not None:
            self._loop.forget()

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

    def text(self, tid: int) -> str:
        return self.piece(tid).decode("utf-8", "replace")

    def pieces(self) -> PieceIndex:
        if self._pieces is None:
            self._pieces = PieceIndex(self.model)
        return self._pieces

    def context(self, cfg: SlotConfig) -> SlotMemory:
        """The slot's memory (its context) made as the server made it (schedule/memory.py SlotConfig),
        made anew when the configuration changes."""
        if self._slot is None or self._slot_cfg != cfg:
            self.close()
            self._slot, self._slot_cfg = cfg.open(self.model), cfg
            self._exact_upto = 0
        return self._slot

    # --- one record -----------------------------------------------------------------------

    def recover(self, rec: Record) -> Recovered:
        """Recover one record; every error names the file and record."""
        with located(rec.source, rec.index):  # a bad field, a wrong model, a decode failure: say which record
            return self._recover(rec)

    def _recover(self, rec: Record) -> Recovered:
        """transcript -> tokens -> evaluation -> comparison -> report, each stage taking what the one
        before it made; the report is built once, at the end."""
        read = self._read(rec)
        first = self._loop_first(read)
        if not isinstance(first, tuple):
            run = self._evaluate(read)
            outcomes = self._compare(rec, run.truths, read.post, read.n_probs, read.speculative, run.approximate_from)
            if self._find_threads(read, run, outcomes):  # the server's -t, unrecorded, found from its values: again
                read = self._read(rec)
                if isinstance(first, str) and self._loop is not None:
                    self._loop.undo()  # the loop ran on the assumed count: again on the found one
                first = self._loop_first(read)
                if not isinstance(first, tuple):
                    run = self._evaluate(read)
                    outcomes = self._compare(rec, run.truths, read.post, read.n_probs, read.speculative,
                                             run.approximate_from)
            elif self._slot is not None and len(self._slot.ctx.kv_tokens) < run.kv_after:  # searched, not found
                run = replace(run, kv_after=len(self._slot.ctx.kv_tokens))
        if isinstance(first, tuple):  # the server's batches, from its loop: no one-token evaluation needed
            run, outcomes = first
        else:
            run, looped = self._through_loop(read, run, tried=first)
            if looped is not None:
                outcomes = looped
        backend = server_backend(self._flags_as_spelled(rec), self.options.server_backend)
        kernels = kernels_differ(backend, self.backend)
        cpu = self.kernels
        if cpu is not None and not cpu.reproduces and kernels is None:
            kernels = f"no CPU variant here reproduces the server's kernels ({cpu.describe()})"
        cause = numerics_cause(read.shared, kernels)
        judged, apart, batched = judge_numerics([o.report for o in outcomes], cause, self.options.batch_bound)
        weighted = apart.worst
        outcomes = [replace(o, report=r) for o, r in zip(outcomes, judged)]
        tokens = [o.report for o in outcomes]
        notes = list(read.notes) + ([run.prefix.note] if run.prefix.note else []) + list(run.notes)
        shared = bool(read.shared)  # evidence or --shared-batches: approximate whatever its real entries say
        notes += judgement_notes(approximate_from=run.approximate_from, approximate_why=run.approximate_why,
                                 loop=run.schedule.get("loop"), cause=cause, shared=shared, batched=batched,
                                 tokens=tokens, weighted=weighted, backend=self.backend.name,
                                 batch_bound=self.options.batch_bound)
        error = None
        if run.unaligned is not None:
            error = str(run.unaligned)
            tokens.append(TokenReport(run.unaligned.index, None, "", None, None, "unaligned", [], note=error))
        generated = n_generated(rec.endpoint, read.final)
        if error is None and generated is not None and generated > len(tokens):
            notes.append(f"the server generated {generated} tokens but its response shows {len(tokens)}: "
                         f"the last {generated - len(tokens)} were never sent (a trimmed stop word, or "
                         "text ending in incomplete UTF-8) and cannot be recovered")
        # what the next record may keep (the server's prompt cache on a multi-turn chat): the prompt, and the
        # generated tokens too where every row of the reply was computed in the kind of decode the server
        # computed it in: one per decode on an unspeculating server, or each read from the transcript
        # (schedule/rows.py, no row of unknown kind) on a target that can drop a suffix (a checkpointing
        # target's reply KV came from batches the transcript does not show)
        rows_known = not run.schedule.get("rows", {}).get("unknown", 1) and "approximate_from" not in run.schedule \
            and "loop" not in run.schedule and self._slot is not None and not self._slot.rules.enabled
        self._exact_upto = 0 if run.kv_after == 0 else run.kv_after if error is None and (
            drafted(read.final) is False or rows_known) else len(read.prompt)
        rep = RecordReport(
            rec.source, rec.index, rec.endpoint, rec.stream, "prob" if read.post else "logprob", read.n_probs,
            tokens=tokens, error=error, notes=notes, prompt_tokens=len(read.prompt),
            reused_prompt_tokens=run.prefix.keep, prefix=run.prefix.how, prefix_note=run.prefix.note,
            settings=read.settings.describe(), slots=read.slots, shape=read.shape, replay_backend=self.backend.name,
            libllama=library_in_use(), server_backend=backend,
            kernels=kernels, cpu=cpu.to_json() if cpu is not None else None, cause=cause,
            cause_kind=numerics_kind(read.shared, kernels), weighted_diff=weighted,
            first_diff=apart.first, bound=self.options.batch_bound,
            build_undecided=None if self.options.build_decided else self.options.build_why,
            judged_by=None if not (batched or shared) else "option" if (
                read.shared == "--shared-batches" or (read.shared or "").endswith(GIVEN_HERE + ")")
                or (self.options.server_backend is not None
                    and server_backend(self._flags_as_spelled(rec), None) == "CPU")
            ) else "evidence", identity=[c.to_json() for c in read.identity],
            model_file=self.model.path.name,
            drafting_known=any(t != "none" for t in read.spec.spec_types) or bool(read.spec.draft_model),
            batched=batched, shared=shared, schedule=run.schedule)
        return Recovered(rep, repair_record(rec, outcomes, read.post, self.piece) if rep.recovered else None)

    def _read(self, rec: Record) -> ReadRecord:
        """Everything later stages need from the record, read once (reading/record.py); the server's -t
        where neither the transcript nor the command line gives it and an earlier record's values told it."""
        read = read_record(rec, self.model, self.flags, build=self.options.build, build_why=self.options.build_why,
                           source=self.options.source,
                           renamed=self.options.renamed_model, facts=self.facts(), piece=self.piece,
                           shared=self.shared.get(rec.index) or rec.busy_when_sent() or (
                               "--shared-batches" if self.options.shared_batches and rec.slots(self.flags.get("n_parallel")) != 1 else None))
        if self._threads_found and read.context.sources.get("threads", "default") == "default":
            context = replace(read.context, threads=self._threads_found[0],
                              sources={**read.context.sources, "threads": "identified"})
            read = replace(read, context=context)
        return read

    def _find_threads(self, read: ReadRecord, run: "Evaluated", outcomes: list["Outcome"]) -> bool:
        """Find the server's -t from this record's values (evaluation/threads.py) where it matters and
        nothing says it: the count is the default, a real entry from a one-token decode past 256 positions
        disagrees, and every row before it is one whose values do not depend on the count. Right after
        _evaluate, whose KV it reuses (one decode per candidate count). True: found (self._threads_found),
        the record is to be evaluated again; False: not looked for, or no count reproduces the entry (the
        report then asks for --threads)."""
        if (self._threads_found is not None or read.context.sources.get("threads", "default") != "default"
                or read.post or run.unaligned is not None or self._slot is None or self._slot.rules.enabled):
            return False  # post-sampling values need the chain's state
        n_prompt = len(read.prompt)
        first = None
        for k, (o, kind) in enumerate(zip(outcomes, run.kinds)):
            if k == 0 or not split_kv(n_prompt + k - 1):
                continue
            if kind == ALONE and o.owns_entry:
                first = k
                break
            if kind is None:  # a row decoded on the assumed count before it: the KV depends on it
                return False
        if first is None or outcomes[first].report.status != "mismatch" or (
                run.approximate_from is not None and first >= run.approximate_from):
            return False  # approximate values tell no count
        target, entry = outcomes[first], entry_at(read.rec, outcomes[first].place)
        ctx = self._slot.ctx

        def agrees(row) -> bool:
            lp, top = pre_sampling(row, target.truth.id, read.n_probs)
            t = replace(target.truth, logprob=lp, top=top)
            return compare(t, entry, post=False, n_probs=read.n_probs, tolerance=self.options.tolerance,
                           speculative=read.speculative, piece=self.text, missing_reason="").status == "ok"
        pos = n_prompt + first - 1
        ctx.seq_rm(0, pos)
        found = matching_threads(ctx, run.truths[first - 1].id, pos, agrees)
        if found:
            self._threads_found = tuple(found)
        return bool(found)

    def _evaluate(self, read: ReadRecord) -> "Evaluated":
        """The truth of every generated token: the prompt in the server's batches on what the slot kept
        (the prefix), then one decode per token (evaluation/walk.py)."""
        rec, prompt = read.rec, list(read.prompt)
        cfg = SlotConfig.of(read.context, rec.flags, read.shape.build, read.spec)
        slot = self.context(cfg)
        ctx = slot.ctx
        spans = message_spans(rec, self.model, prompt) if slot.rules.user_breaks else NO_SPANS
        if slot.rules.enabled:  # a target that checkpoints: its prompt cuts and the slot's checkpoints
            prefix = plan_checkpointed(ctx.kv_tokens, self._exact_upto, prompt, read.cached,
                                       slot.checkpoints, pos_min=ctx.pos_min(), n_swa=slot.n_swa)
        else:
            prefix = plan_prefix(ctx.kv_tokens, self._exact_upto, prompt, read.cached, ctx.n_batch,
                                 ctx.n_ubatch, reuse=self.options.reuse_prefix)
        if self._after_loop and prefix.rebuild:
            prefix = replace(prefix, note=f"the server took {read.cached} prompt tokens from its cache, left by the "
                                          "previous record, whose KV this replay computed in the server's loop, not "
                                          "here: evaluated on their own, and the loop not replayed for this one")
        self._after_loop = False
        self._exact_upto = 0  # until this record's evaluation completes
        evaluated: list[Truth] = []
        unaligned: Unaligned | None = None
        era = read.shape.era
        scored = self._scored(rec, read)
        try:
            for truth in truths(self.model, slot, prompt, read.plan, read.settings, read.n_probs, post=read.post,
                                prefix=prefix, spans=spans, suppress_tokens=era.suppress_tokens,
                                single_draw=era.single_draw, scored=scored,
                                pieces=self.pieces() if any(isinstance(i, Gap) for i in read.plan) else None):
                evaluated.append(truth)
                if self.options.only_entries and len(evaluated) >= self.options.only_entries:
                    break
        except Unaligned as e:
            unaligned = e
            # the tokens of a gap that owns an entry are compared once the gap is complete: it is not
            while evaluated and isinstance(evaluated[-1].item, Gap) and evaluated[-1].item.place.entry is not None:
                evaluated.pop()
        kinds = {id(item): kind for item, kind in zip(read.plan, scored)}
        token_kinds = [kinds.get(id(t.item)) for t in evaluated]
        schedule = {**schedule_of(slot, spans), **self._rows_and_threads(read, token_kinds, ctx.threads)}
        approx, why = self._approximate(read, cfg, slot, token_kinds)
        if approx is not None:
            schedule["approximate_from"] = approx
        return Evaluated(evaluated, unaligned, prefix, schedule, len(ctx.kv_tokens), approx, why, tuple(token_kinds))

    def _loop_first(self, read: ReadRecord) -> tuple["Evaluated", list[Outcome]] | str | None:
        """Where the one-token schedule is bound to be approximate (approximate_from, known from the plan and
        the slot before any decode: every token of a loopable record is one plan item), the loop is replayed
        first, and where its values hold (_looped) they are the record's: the one-token evaluation, which
        would be set aside, is not run. Returns (the run, its outcomes); else why the loop did not hold
        (the one-token evaluation then runs, and keeps it), or None where it was not tried."""
        if self.options.only_entries or not all(isinstance(item, Known) for item in read.plan):
            return None
        cfg = SlotConfig.of(read.context, read.rec.flags, read.shape.build, read.spec)
        slot = self.context(cfg)
        kinds = tuple(self._scored(read.rec, read))
        approx, _ = self._approximate(read, cfg, slot, kinds)
        if approx is None and not (read.cached and self._loop is not None and self._loop.live):
            return None  # (a record that continues the cache of a looped one is looped too: that KV is the loop's)
        looped = self._looped(read)
        if isinstance(looped, str):
            return looped
        schedule = {**(looped.schedule or {}), **self._rows_and_threads(read, kinds, cfg.threads),
                    "loop": looped.info}
        slot.reset()  # its KV is an earlier record's: the next record keeps nothing of it (kv_after 0)
        self._after_loop = True
        return Evaluated(looped.truths, None, looped.prefix, schedule, 0, kinds=kinds,
                         notes=looped.notes), looped.outcomes

    def _rows_and_threads(self, read: ReadRecord, kinds: Sequence[str | None], threads: int) -> dict:
        """The report's schedule.rows (how each token was scored) and schedule.threads (the -t used, whence)."""
        out = {"value": threads, "source": read.context.sources.get("threads", "default")}
        if out["source"] == "identified":  # the counts that reproduced the values (evaluation/threads.py)
            out["candidates"] = list(self._threads_found or ())
        return {"rows": row_counts(list(kinds), len(read.prompt)), "threads": out}

    def _approximate(self, read: ReadRecord, cfg: SlotConfig, slot: SlotMemory,
                     kinds: Sequence[str | None]) -> tuple[int | None, str]:
        """approximate_from for this record on this slot: its decode kinds, the slot's checkpoints, -fa,
        whether the server's drafts can make a tiled verify batch, and whether the next record continues
        this one's reply from the server's cache."""
        return approximate_from(kinds, len(read.prompt), checkpoints=slot.rules.enabled,
                                flash_attn_off=cfg.flash_attn == "off",
                                tiled=tiled_verify(longest_draft(read.spec), cfg.flash_attn, cfg.type_k, cfg.type_v,
                                                   cfg.n_ubatch),
                                continued=self._continued(read), speculative=read.speculative)

    def _continued(self, read: ReadRecord) -> bool:
        """Whether the record after this one in the file took more of its prompt from the server's cache
        than this record's prompt: tokens this record generated, in the KV its verify batches wrote."""
        at = next((k for k, r in enumerate(self._records) if r is read.rec), None)
        if at is None or at + 1 >= len(self._records):
            return False
        kept = n_prompt_cached(self._records[at + 1].final())
        return kept is not None and kept > len(read.prompt)

    def _looped(self, read: ReadRecord) -> "LoopHeld | str":
        """The server's loop replayed (commands/looped.py) for this record, where the replay emitted the
        transcript's tokens with the server's draft totals and every real entry agrees at the full
        tolerance; else why not."""
        loop = self._loop_values()
        looped = loop.values(read)
        if looped.truths is None:
            return looped.why
        outcomes = self._compare(read.rec, looped.truths, read.post, read.n_probs, read.speculative)
        wrong = next((o for o in outcomes if o.report.status == "mismatch"), None)
        if wrong is not None:
            loop.skip()
            return (f"its value of token {wrong.report.index} disagrees with the server's real entry "
                    f"({wrong.report.note or 'beyond the tolerance'})")
        info = {"replayed": True, "draft_n": looped.draft_n, "draft_n_accepted": looped.draft_n_accepted,
                "totals_checked": looped.totals_checked}
        return LoopHeld(looped.truths, outcomes, info, looped.schedule, looped.prefix, looped.notes)

    def _through_loop(self, read: ReadRecord, run: "Evaluated",
                      tried: str | None = None) -> tuple["Evaluated", list[Outcome] | None]:
        """Where this replay's values are approximate (`approximate_from`), the server's loop replayed
        gives them in the server's batches (_looped); else the approximate values stay, and the schedule's
        `loop` says why (`tried`: why the loop, replayed before the evaluation, did not hold). Returns the
        run and, when the loop's values are used, their outcomes."""
        loop = self._loop_values()
        if run.approximate_from is None or self.options.only_entries:
            loop.skip()
            return run, None
        looped = tried if tried is not None else self._looped(read)
        if isinstance(looped, str):
            return replace(run, schedule={**run.schedule, "loop": {"replayed": False, "why": looped}}), None
        schedule = {k: v for k, v in run.schedule.items() if k != "approximate_from"}
        schedule["loop"] = looped.info
        return replace(run, truths=looped.truths, approximate_from=None, approximate_why="", schedule=schedule,
                       notes=looped.notes), looped.outcomes

    def _loop_values(self) -> LoopValues:
        if self._loop is None:
            self._loop = LoopValues(self.model, self._drafts, self.flags.get("n_parallel"),
                                    renamed=self.options.renamed_model)
        return self._loop

    def _scored(self, rec: Record, read: ReadRecord) -> list[str | None]:
        """Which decode computed each plan item's values on the server (schedule/rows.py): from the
        transcript's own entries, real (one-token decodes) or placeholders (verify batches)."""
        return scored_by(read.plan, lambda item: entry_at(rec, item.place) if item.place.entry is not None else None,
                         server_values, read.n_probs)

    def _compare(self, rec: Record, evaluated: list[Truth], post: bool, n_probs: int,
                 speculative: bool, approximate_from: int | None = None) -> list[Outcome]:
        """Pair every truth with the server's entry it owns and compare them. A Gap's tokens share its
        place: only its last token owns an entry there (an id-less entry), the others are inserted before."""
        last_of_item = {id(t.item): k for k, t in enumerate(evaluated)}
        outcomes = []
        for k, t in enumerate(evaluated):
            place = t.item.place
            owns = place.entry is not None and last_of_item[id(t.item)] == k
            entry = entry_at(rec, place) if owns else None
            reason = t.item.reason if isinstance(t.item, Gap) else (place.reason or "the server sent no entry for this token")
            report = compare(t, entry, post=post, n_probs=n_probs, tolerance=self.options.tolerance,
                             speculative=speculative, piece=self.text, missing_reason=reason,
                             approximate_from=approximate_from)
            outcomes.append(Outcome(t, place, owns, report))
        return outcomes


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
