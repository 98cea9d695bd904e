"""The one-token schedule: a record's prompt in the server's batches on what the slot kept, then one decode
per generated token (evaluation/walk.py), on one slot kept from record to record.

Its values are the server's where each token's row was computed in the kind of decode the server
computed it in (schedule/rows.py); where the server's decodes cannot be told from the transcript they are
approximate from the first such token on (`approximate_of`, schedule/exactness.py), and the server's loop
may give them instead (recovering/schedule.py). The server's -t, where nothing says it and it matters, is
found from a record's values (`find_threads`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from replay.commands.recovering.options import RecoverOptions
from replay.comparison.values import compare, server_values
from replay.errors import Unaligned
from replay.evaluation.threads import matching_threads
from replay.evaluation.walk import PieceIndex, Truth, truths
from replay.numerics.server_probs import pre_sampling
from replay.reading.record import ReadRecord
from replay.report.repair import Outcome
from replay.runtime.llama import Model
from replay.schedule.exactness import approximate_from
from replay.schedule.memory import SlotConfig, SlotMemory, schedule_of
from replay.schedule.prefix import Prefix, plan_checkpointed, plan_prefix
from replay.schedule.prompt import NO_SPANS
from replay.schedule.rows import ALONE, row_counts, scored_by, split_kv, tiled_verify
from replay.settings import longest_draft
from replay.tokens.prompt_ids import message_spans
from replay.transcripts.entries import n_prompt_cached
from replay.transcripts.plan import Gap, entry_at
from replay.transcripts.readers import Record


@dataclass(frozen=True)
class Evaluated:
    """What evaluating one record gave: its truths, where the text stopped aligning, how the prompt
    was laid on the slot's memory, the schedule replayed, and the KV length after."""

    truths: list[Truth]
    unaligned: Unaligned | None
    prefix: Prefix
    schedule: dict
    kv_after: int
    # the first token whose values are approximate (comparison/bounds.py APPROXIMATE_DRIFT), and why;
    # None: every value is computed as the server computed it
    approximate_from: int | None = None
    approximate_why: str = ""
    # the decode that computed each evaluated token's values on the server (schedule/rows.py), token by token
    kinds: tuple[str | None, ...] = ()
    notes: tuple[str, ...] = ()  # what the loop replay said of this record (loop/loop.py)


def scored_kinds(read: ReadRecord) -> list[str | None]:
    """Which decode computed each plan item's values on the server (schedule/rows.py): from the
    transcript's own entries, real (one-token decodes) or placeholders (verify batches)."""
    rec = read.rec
    return scored_by(read.plan, lambda item: entry_at(rec, item.place) if item.place.entry is not None else None,
                     server_values, read.n_probs)


def continued_by_next(records: Sequence[Record], rec: Record, n_prompt: int) -> bool:
    """Whether the record after `rec` in the file took more of its prompt from the server's cache than
    `rec`'s prompt (`n_prompt` tokens): tokens `rec` generated, in the KV its verify batches wrote."""
    at = next((k for k, r in enumerate(records) if r is rec), None)
    if at is None or at + 1 >= len(records):
        return False
    kept = n_prompt_cached(records[at + 1].final())
    return kept is not None and kept > n_prompt


def approximate_of(read: ReadRecord, cfg: SlotConfig, slot: SlotMemory, kinds: Sequence[str | None],
                   records: Sequence[Record]) -> tuple[int | None, str]:
    """approximate_from for this record on this slot: its decode kinds, the slot's checkpoints, -fa,
    whether the server's drafts can make a tiled verify batch, and whether the next record continues
    this one's reply from the server's cache."""
    return approximate_from(kinds, len(read.prompt), checkpoints=slot.rules.enabled,
                            flash_attn_off=cfg.flash_attn == "off",
                            tiled=tiled_verify(longest_draft(read.spec), cfg.flash_attn, cfg.type_k, cfg.type_v,
                                               cfg.n_ubatch),
                            continued=continued_by_next(records, read.rec, len(read.prompt)),
                            speculative=read.speculative)


def rows_and_threads(read: ReadRecord, kinds: Sequence[str | None], threads: int,
                     found: tuple[int, ...] | None) -> dict:
    """The report's schedule.rows (how each token was scored) and schedule.threads (the -t used, whence;
    `found`: the counts that reproduced the values, evaluation/threads.py)."""
    out = {"value": threads, "source": read.context.sources.get("threads", "default")}
    if out["source"] == "identified":
        out["candidates"] = list(found or ())
    return {"rows": row_counts(list(kinds), len(read.prompt)), "threads": out}


class OneToken:
    """The one-token schedule over one slot, kept while the slot's configuration stays the same (module
    docstring). `exact_upto`: the KV positions the previous record left as the server computed them;
    `after_loop`: the previous record's values came from the loop (its KV is not in this slot);
    `on_remake` runs before a slot is made anew (the loop's contexts are freed then)."""

    def __init__(self, model: Model, options: RecoverOptions, records: Sequence[Record],
                 text: Callable[[int], str], on_remake: Callable[[], None] = lambda: None):
        self.model, self.options, self.records, self.text, self.on_remake = model, options, records, text, on_remake
        self.slot: SlotMemory | None = None
        self._cfg: SlotConfig | None = None
        self._pieces: PieceIndex | None = None
        self.exact_upto = 0
        self.after_loop = False
        # the server's -t found from a record's values (evaluation/threads.py), for the records after it: the
        # counts that reproduced it, the smallest used; None: not looked for or not found
        self.threads_found: tuple[int, ...] | None = None

    def close(self) -> None:
        if self.slot is not None:
            self.slot.close()
            self.slot = None

    def context(self, cfg: SlotConfig) -> SlotMemory:
        """The slot's memory (its context) made as the server made it (schedule/memory.py SlotConfig),
        made anew when the configuration changes."""
        if self.slot is None or self._cfg != cfg:
            self.close()
            self.on_remake()
            self.slot, self._cfg = cfg.open(self.model), cfg
            self.exact_upto = 0
        return self.slot

    def pieces(self) -> PieceIndex:
        if self._pieces is None:
            self._pieces = PieceIndex(self.model)
        return self._pieces

    def approximate(self, read: ReadRecord, cfg: SlotConfig, slot: SlotMemory,
                    kinds: Sequence[str | None]) -> tuple[int | None, str]:
        return approximate_of(read, cfg, slot, kinds, self.records)

    def rows_and_threads(self, read: ReadRecord, kinds: Sequence[str | None], threads: int) -> dict:
        return rows_and_threads(read, kinds, threads, self.threads_found)

    def prefix(self, read: ReadRecord, slot: SlotMemory) -> Prefix:
        """What this record keeps of the slot's memory (schedule/prefix.py): on a checkpointing target, its
        prompt cuts and the slot's checkpoints; else the prefix the previous record left exact."""
        ctx, prompt = slot.ctx, list(read.prompt)
        if slot.rules.enabled:
            prefix = plan_checkpointed(ctx.kv_tokens, self.exact_upto, prompt, read.cached,
                                       slot.checkpoints, pos_min=ctx.pos_min(), n_swa=slot.n_swa)
        else:
            prefix = plan_prefix(ctx.kv_tokens, self.exact_upto, prompt, read.cached, ctx.n_batch,
                                 ctx.n_ubatch, reuse=self.options.reuse_prefix)
        if self.after_loop and prefix.rebuild:
            prefix = replace(prefix, note=f"the server took {read.cached} prompt tokens from its cache, left by the "
                                          "previous record, whose KV this replay computed in the server's loop, not "
                                          "here: evaluated on their own, and the loop not replayed for this one")
        return prefix

    def evaluate(self, read: ReadRecord) -> Evaluated:
        """The truth of every generated token: the prompt in the server's batches on what the slot kept
        (the prefix), then one decode per token (evaluation/walk.py)."""
        rec, prompt = read.rec, list(read.prompt)
        cfg = SlotConfig.of(read.context, rec.flags, read.shape.build, read.spec)
        slot = self.context(cfg)
        spans = message_spans(rec, self.model, prompt) if slot.rules.user_breaks else NO_SPANS
        prefix = self.prefix(read, slot)
        self.after_loop = False
        self.exact_upto = 0  # until this record's evaluation completes
        evaluated: list[Truth] = []
        unaligned: Unaligned | None = None
        era = read.shape.era
        scored = scored_kinds(read)
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
        schedule = {**schedule_of(slot, spans), **self.rows_and_threads(read, token_kinds, slot.ctx.threads)}
        approx, why = self.approximate(read, cfg, slot, token_kinds)
        if approx is not None:
            schedule["approximate_from"] = approx
        return Evaluated(evaluated, unaligned, prefix, schedule, len(slot.ctx.kv_tokens), approx, why,
                         tuple(token_kinds))

    def find_threads(self, read: ReadRecord, run: Evaluated, outcomes: list[Outcome]) -> bool:
        """Find the server's -t from this record's values (evaluation/threads.py) where it matters and
        nothing says it: the count is the default, a real entry from a one-token decode past 256 positions
        disagrees, and every row before it is one whose values do not depend on the count. Right after
        evaluate, whose KV it reuses (one decode per candidate count). True: found (threads_found), the
        record is to be evaluated again; False: not looked for, or no count reproduces the entry (the
        report then asks for --threads)."""
        if (self.threads_found is not None or read.context.sources.get("threads", "default") != "default"
                or read.post or run.unaligned is not None or self.slot is None or self.slot.rules.enabled):
            return False  # post-sampling values need the chain's state
        first = _first_alone_entry(outcomes, run.kinds, len(read.prompt),
                                   prompt_row_alone=last_row_alone(run.schedule, self.slot.ctx.n_ubatch))
        if first is None or outcomes[first].report.status != "mismatch" or (
                run.approximate_from is not None and first >= run.approximate_from):
            return False  # approximate values tell no count
        target, entry = outcomes[first], entry_at(read.rec, outcomes[first].place)

        def agrees(row) -> bool:
            lp, top = pre_sampling(row, target.truth.id, read.n_probs)
            t = replace(target.truth, logprob=lp, top=top)
            return compare(t, entry, post=False, n_probs=read.n_probs, tolerance=self.options.tolerance,
                           speculative=read.speculative, piece=self.text, missing_reason="").status == "ok"
        pos = len(read.prompt) + first - 1
        self.slot.ctx.seq_rm(0, pos)
        token = read.prompt[-1] if first == 0 else run.truths[first - 1].id
        found = matching_threads(self.slot.ctx, token, pos, agrees)
        if found:
            self.threads_found = tuple(found)
        return bool(found)


def last_row_alone(schedule: dict, n_ubatch: int) -> bool:
    """Whether the prompt's last row was decoded alone: the last of its batches (schedule/memory.py
    schedule_of) ends in a ubatch of one row, as a request that takes all but its last prompt token from
    the server's cache does. libllama decodes a one-row ubatch on -t threads, a larger one on -tb
    (src/llama-context.cpp:2612, graph_compute), and past 256 positions the count changes its values.

    >>> last_row_alone({"prompt_batches": [1]}, 512), last_row_alone({"prompt_batches": [513]}, 512)
    (True, True)
    >>> last_row_alone({"prompt_batches": [512, 49]}, 512), last_row_alone({}, 512)
    (False, False)
    """
    sizes = schedule.get("prompt_batches") or []
    return bool(sizes) and sizes[-1] % n_ubatch == 1 % n_ubatch


def _first_alone_entry(outcomes: list[Outcome], kinds: Sequence[str | None], n_prompt: int, *,
                       prompt_row_alone: bool = False) -> int | None:
    """The first token past 256 positions whose real entry a one-token decode computed, where every row
    before it was decoded in a kind the transcript shows (None: none, or a row of unknown kind first).
    The first token's entry counts where the prompt's last row was decoded alone (`prompt_row_alone`)."""
    for k, (o, kind) in enumerate(zip(outcomes, kinds)):
        if (k == 0 and not prompt_row_alone) or not split_kv(n_prompt + k - 1):
            continue
        if kind == ALONE and o.owns_entry:
            return k
        if kind is None:  # a row decoded on the assumed count before it: the KV depends on it
            return None
    return None
