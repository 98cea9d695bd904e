"""The report of one record (report/recovery.py RecordReport), assembled from what the stages before it
made: the record as read, its computed values (Evaluated) and their judgement (comparison/judgement.py).
Also what the next record may keep of this one's KV (`kept_after`)."""
from __future__ import annotations

from replay.commands.recovering.one_token import Evaluated
from replay.commands.recovering.options import RecoverOptions
from replay.comparison.judgement import Judgement
from replay.comparison.values import TokenReport
from replay.reading.record import ReadRecord
from replay.report.recovery import RecordReport
from replay.runtime.binding import library_in_use
from replay.runtime.engine import KernelChoice
from replay.schedule.memory import SlotMemory
from replay.transcripts.entries import drafted, n_generated


def record_report(read: ReadRecord, run: Evaluated, judged: Judgement, *, options: RecoverOptions,
                  server_backend: str, replay_backend: str, cpu: KernelChoice | None, model_file: str) -> RecordReport:
    """The record's report: its judged tokens (and the token the text stopped aligning at), the notes of
    the reading, the prefix, the loop and the judgement, and what the server's response did not show."""
    rec = read.rec
    tokens = list(judged.reports)
    notes = list(read.notes) + ([run.prefix.note] if run.prefix.note else []) + list(run.notes) + judged.notes
    error = None
    if run.unaligned is not None:
        error = str(run.unaligned)
        tokens.append(TokenReport(run.unaligned.index, None, "", None, None, "unaligned", [], note=error))
    generated = n_generated(rec.endpoint, read.final)
    if error is None and generated is not None and generated > len(tokens):
        notes.append(f"the server generated {generated} tokens but its response shows {len(tokens)}: "
                     f"the last {generated - len(tokens)} were never sent (a trimmed stop word, or "
                     "text ending in incomplete UTF-8) and cannot be recovered")
    return RecordReport(
        rec.source, rec.index, rec.endpoint, rec.stream, "prob" if read.post else "logprob", read.n_probs,
        tokens=tokens, error=error, notes=notes, prompt_tokens=len(read.prompt),
        reused_prompt_tokens=run.prefix.keep, prefix=run.prefix.how, prefix_note=run.prefix.note,
        settings=read.settings.describe(), slots=read.slots, shape=read.shape, replay_backend=replay_backend,
        libllama=library_in_use(), server_backend=server_backend,
        kernels=judged.kernels, cpu=cpu.to_json() if cpu is not None else None, cause=judged.cause,
        cause_kind=judged.cause_kind, weighted_diff=judged.apart.worst,
        first_diff=judged.apart.first, bound=options.batch_bound,
        build_undecided=None if options.build_decided else options.build_why,
        judged_by=judged.judged_by, identity=[c.to_json() for c in read.identity], model_file=model_file,
        drafting_known=any(t != "none" for t in read.spec.spec_types) or bool(read.spec.draft_model),
        batched=judged.batched, shared=judged.shared, schedule=run.schedule)


def kept_after(read: ReadRecord, run: Evaluated, slot: SlotMemory | None) -> int:
    """The KV positions the next record may keep as the server computed them (the server's prompt cache on a
    multi-turn chat): the prompt, and the generated tokens too where every row of the reply was computed in
    the kind of decode the server computed it in: one per decode on an unspeculating server, or each read
    from the transcript (schedule/rows.py, no row of unknown kind) on a target that can drop a suffix (a
    checkpointing target's reply KV came from batches the transcript does not show)."""
    rows_known = not run.schedule.get("rows", {}).get("unknown", 1) and "approximate_from" not in run.schedule \
        and "loop" not in run.schedule and slot is not None and not slot.rules.enabled
    if run.kv_after == 0:
        return 0
    return run.kv_after if run.unaligned is None and (drafted(read.final) is False or rows_known) else len(read.prompt)
