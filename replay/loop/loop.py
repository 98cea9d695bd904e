"""llama-server's speculative loop for one request, step by step, reproduced in-process.

One request on a fresh single-slot server (`-np 1`), as tools/server/server-context.cpp runs it
(docs/server-loop.md). The phases, in the order `SpeculativeLoop` runs them:

    prefill    target and draft decode the prompt in n_batch batches (logits at the last
               token); the first token is sampled normally (real probabilities)     :3781-3874
    each step
      draft    n_max = min(n_ctx - n_past - 2, n_remaining - 1)                       :517-536
               the first drafter (priority order) that returns a draft wins   speculative.cpp:2868-2956
      decode   the target decodes [sampled, d0 .. d(n-1)] with outputs on every row; the draft
               context mirrors the batch (its unread output left out)                 :4072-4084
      verify   rejection if the draft is probabilistic and temp > 0 (b11434), else
               sample-and-match; then the bonus token if every draft was kept (verify.py)
      trim     KV of the positions after the accepted drafts goes, on both contexts    :4342-4348
      emit     the step's tokens through the stop rules (stop strings, the context, n_predict,
               EOG); the rest of a step's tokens are dropped once one stops generation :4350-4368
    no draft   a normal step: [sampled] alone, one sample (real probabilities)

The parts, each with one job and its own tests:

    request.py     Request (what the request brings), Step (what a step did)
    drafting.py    which drafter drafts a step and how long its draft may be
    verifiers.py   sample-and-match, rejection and a restored step's replay, over the verify batch's rows
    schedule/step_memory.py   the slot's memory through a step: checkpoint, trim, restore
    emission.py    the emitted tokens with their values, and the stop rules

Every emitted token carries its verify-row values, the ones a fixed server would report: the
pre-sampling softmax of the verify row that scored it, and the post-sampling candidates of the
target chain there: recover's truth (docs/architecture.md, "The truth"). recover computes most rows
one at a time in their kind (evaluation/walk.py, schedule/rows.py) and takes them from this loop where
the transcript does not show the server's batches (commands/looped.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Iterator


from replay.builds.loop_shapes import Era
from replay.errors import TranscriptError
from replay.loop.draft_model import DraftContext, DraftSimple, mirror
from replay.loop.draft_mtp import MtpHeads, check_mtp
from replay.loop.drafters import Drafter, make_drafters
from replay.loop.drafting import NO_DRAFT, Draft, draft_limit, first_draft, server_types
from replay.loop.emission import Emission, Emitted, Limits
from replay.loop.expectation import acceptances, not_expectable
from replay.loop.replayable import check_replayable
from replay.loop.request import Request, Step, check_seed, draft_q_of, drafts_counted
from replay.loop.state import SlotState
from replay.loop.verifiers import ChainRows, Verified, by_match, by_rejection, by_replay
from replay.numerics.rng import MT19937, REJECTION_SEED_XOR, canonical_float
from replay.runtime.llama import Model
from replay.runtime.sampler import SamplerChain
from replay.schedule.memory import SlotConfig, SlotMemory
from replay.schedule.prefix import FRESH, Prefix, plan_checkpointed, plan_prefix
from replay.schedule.step_memory import StepMemory
from replay.settings import draft_thread_count

__all__ = ["Emitted", "Request", "SpeculativeLoop", "Step"]


@dataclass
class SamplerState:
    """The target chain and the rejection RNG as they were before a checkpointed step verified, so a
    restored step draws the same numbers again (common_sampler_clone, :4282-4311)."""

    chain: tuple  # SamplerChain.snapshot()
    rng: MT19937


@dataclass(frozen=True)
class PendingReplay:
    """A restored step's kept tokens (its accepted drafts and the verifier's last token), verified
    again by the next step instead of a draft (:3215-3220, :4282-4311)."""

    ids: list[int]
    drafter: Drafter | None


def open_memory(target: Model, spec, state: SlotState, slot_config: SlotConfig, draft_model: Model | None,
                mtp: bool) -> tuple[SlotMemory, bool]:
    """(the slot's memory, whether it continues the slot's earlier requests): the draft context copies
    the target's -c/-b/-ub/-fa/--swa-full but has its own KV types, -ctkd/-ctvd, and threads, -td."""
    draft_types = (spec.draft_cache_type_k, spec.draft_cache_type_v)
    draft_threads = draft_thread_count(spec) if draft_model is not None else None  # -td needs a draft model
    key = (str(target.path), slot_config, str(draft_model.path) if draft_model is not None else None, draft_types,
           draft_threads, mtp)
    return state.memory_for(key, lambda: slot_config.open(target, draft_model, draft_types, draft_threads, mtp=mtp))


class SpeculativeLoop:
    """Iterate the server's steps for one request; `emitted` grows as steps run. Built from three typed
    values and the models: the request (`Request`), how the server made its slot (`SlotConfig`) and the
    loop shape of its build (`Era`).

    `slot_state` is what the request's slot kept from earlier requests (loop/state.py: its drafters' tables,
    its draft sampler's last retune, its memory), which a request that reused the prompt cache
    continues from (`Request.cached`). Pass the same SlotState for consecutive
    requests to one slot (commands/trace_state.py gives each slot its own and frees their memory);
    without one the loop runs on a fresh slot and frees what it made.
    """

    def __init__(self, target: Model, request: Request, *, era: Era, slot_config: SlotConfig,
                 draft_model: Model | None = None, slot_state: SlotState | None = None):
        settings, spec = request.settings, request.spec
        check_replayable(spec, era, has_draft_model=draft_model is not None)
        check_seed(settings.params)
        self.target, self.era, self.params = target, era, settings.params
        self.prompt = list(request.prompt)
        self.record = Emission(target, Limits(n_ctx=slot_config.n_ctx, n_predict=settings.n_predict,
                                              stop=settings.stop), len(self.prompt), request.n_probs,
                               evidence=request.evidence)
        self.prefix: Prefix = FRESH  # what the request kept of the slot's memory (reuse), once prefilled
        self.spans, self.cached = request.spans, request.cached
        self.expect = request.expect and not_expectable(self.params, settings.grammar is not None) is None
        self.pending: PendingReplay | None = None
        # a replayed step re-accepts its tokens at temp > 0 from b11368 (server_accept_replay, :4263)
        self.rejection_mode = era.rejection and self.params.temp > 0
        self.chain = SamplerChain(target, self.params, settings.grammar, suppress_tokens=era.suppress_tokens,
                                  single_draw=era.single_draw)
        self.rng = MT19937((self.params.seed ^ REJECTION_SEED_XOR) & 0xFFFFFFFF)  # common/sampling.cpp:440
        types, draft_model, self.notes = server_types(spec, era, target, draft_model)
        self.owns_memory = slot_state is None
        self.state = slot_state if slot_state is not None else SlotState()
        mtp = "draft-mtp" in types
        if mtp:
            check_mtp(target)
        self.memory, self.continued = open_memory(target, spec, self.state, slot_config, draft_model, mtp)
        self.ctx = self.memory.ctx
        if mtp and self.memory.mtp is None:
            self.memory.mtp = MtpHeads(self.ctx, self.memory.draft, suppress_tokens=era.suppress_tokens)
        # recurrent and hybrid targets cannot drop rejected drafts: the server checkpoints them
        # ("speculative decoding will use checkpoints", server-context.cpp:1373-1380); with recurrent-state
        # snapshots (n_rs_seq > 0) they drop up to n_rs_seq (schedule/step_memory.py)
        self.slot = StepMemory(self.memory)
        self.draft_ctx = (DraftContext(draft_model, self.memory.draft, era, self.params.temp, self.params.seed,
                                       self.state) if draft_model is not None else None)
        self.drafters: list[Drafter] = make_drafters(
            replace(spec, spec_types=tuple(types)), draft_model=self.draft_ctx,
            mtp=(self.memory.mtp, self.params.temp, self.params.seed) if mtp else None, state=self.state,
            map_cleanup=era.map_cleanup)
        self.kv: list[int] = []  # tokens in the target KV (prompt + accepted, without `sampled`)
        self.sampled = -1
        self.alive = True
        self.n_draft = 0
        self.n_accepted = 0

    @property
    def emitted(self) -> list[Emitted]:
        """The tokens emitted so far, with their verify-row values (emission.py)."""
        return self.record.emitted

    def draft_samples(self) -> int:
        """The draft chains' passes so far (one per drafted position)."""
        return sum(getattr(d, "passes", 0) for d in self.drafters)

    def close(self) -> None:
        """Free the request's samplers; the slot's memory stays with its SlotState (freed here if the loop made it)."""
        self.chain.close()
        for d in self.drafters:
            if isinstance(d, DraftSimple):
                d.close()
        if self.owns_memory:
            self.state.close()

    def steps(self) -> Iterator[Step]:
        yield self.prefill()
        index = 0
        while self.alive:
            index += 1
            yield self.step(index)

    # --- phases ----------------------------------------------------------------------------

    def prefill(self) -> Step:
        """The prompt on both contexts in the server's batches (cut for checkpoints on a target that
        takes them: schedule/prompt.py), then the first token sampled normally (:3322-3912, :4114-4232)."""
        n_prompt = len(self.prompt)
        if n_prompt >= self.record.limits.n_ctx:  # the server answers 400 exceed_context_size_error (:3417-3425)
            raise TranscriptError(f"the prompt has {n_prompt} tokens but the context holds {self.record.limits.n_ctx}")
        self.prefix = self.reuse()
        self.memory.start(self.prompt, self.prefix, spans=self.spans)
        self.chain.accept_prompt(self.prompt)
        for d in self.drafters:
            d.begin(self.prompt)
        logits = self.ctx.logits(-1)
        cands, sel = self.chain.sample(logits)
        tok = int(cands["id"][sel])
        draw = self.chain.n_applies
        self.chain.accept(tok)
        self.kv = list(self.prompt)
        self.sampled = tok
        self.alive = self.record.add(tok, 0, logits, cands, n_before=0, n_step=1, chosen=(draw, "drawn"))
        return Step(index=0, pos0=n_prompt, sampled=tok, rule="normal", emitted=[tok])

    def reuse(self) -> Prefix:
        """What the request keeps of the slot's memory: what the server kept (`cached`), when this slot's
        memory continues the earlier requests the trace reproduced (every cell as the server computed
        it, verify batches included); a fresh evaluation otherwise."""
        mem, kv = self.memory, self.ctx.kv_tokens
        if not self.continued:
            if self.cached:
                self.notes.append(f"the server took {self.cached} prompt tokens from its cache (cache_prompt), "
                                  "left by requests this trace did not run (earlier records on another "
                                  "configuration, or none): evaluated from scratch, its values differ slightly and "
                                  "a near-tie may sample differently")
            return FRESH
        if mem.rules.enabled:
            prefix = plan_checkpointed(kv, len(kv), self.prompt, self.cached, mem.checkpoints,
                                       pos_min=self.ctx.pos_min(), n_swa=mem.n_swa)
        else:
            prefix = plan_prefix(kv, len(kv), self.prompt, self.cached, self.ctx.n_batch, self.ctx.n_ubatch,
                                 reuse=False)
        if prefix.rebuild:
            self.notes.append(f"the server took {self.cached} prompt tokens from its cache, which the slot's memory "
                              "as traced does not hold (an earlier record diverged, or came from another slot): "
                              "evaluated on their own, its values differ slightly")
        return prefix

    def step(self, index: int) -> Step:
        """One speculative step: draft, decode, verify, trim, emit. On a target whose memory cannot drop
        a suffix (recurrent and hybrid models), a partly accepted draft instead restores the checkpoint
        taken before the step and is replayed whole by the next step (server-context.cpp:4272-4330)."""
        pos0, sampled = len(self.kv), self.sampled
        pending, self.pending = self.pending, None
        # the kept tokens of a restored step are verified again, with no drafting (:3215-3220)
        d = Draft(pending.ids, pending.drafter) if pending is not None else self.draft(pos0)
        before = SamplerState(self.chain.snapshot(), copy.deepcopy(self.rng)) \
            if self.slot.checkpointed and d.tokens else None
        self.decode([sampled] + d.tokens, pos0)
        accept_p = (acceptances(d.tokens, d.q, self.ctx, self.chain, is_eog=self.target.is_eog,
                                eog_rule=self.era.eog_rule) if self.expect and d.tokens and pending is None else None)
        rule, v = self.verify(d.tokens, d.q, replay=pending is not None)
        step = Step(index=index, pos0=pos0, sampled=sampled, rule=rule, drafter=d.drafter.name if d.drafter else None,
                    draft=list(d.tokens), draft_q=draft_q_of(d.tokens, d.q), target_p=v.target_p,
                    uniforms=v.uniforms, accept_p=accept_p, accepted=len(v.ids) - 1, resampled=v.resampled,
                    bonus=v.bonus)
        if before is not None and self.slot.rolls_back(len(d.tokens) + 1 - len(v.ids)):
            self.slot.restore(pos0)  # nothing is emitted; the chain and the RNG go back too (:4282-4311)
            self.chain.restore(before.chain)
            self.rng = before.rng
            self.pending = PendingReplay(list(v.ids), d.drafter)
            return replace(step, rule=rule + ", checkpoint restored")
        if before is not None:
            self.chain.close_snapshot(before.chain)
        self.n_accepted += drafts_counted(step.accepted, replay=pending is not None)
        if d.drafter is not None:  # every drafter hears what was accepted (common_speculative_accept, :2958-2992)
            for other in self.drafters:
                if other is d.drafter or getattr(other, "accepts_others", False):
                    other.accept(step.accepted)
        self.slot.trim(pos0 + 1 + step.accepted)
        self.kv += [sampled] + v.ids[:-1]
        self.sampled = v.ids[-1]
        self.emit(step, v)
        return step

    def draft(self, pos0: int) -> Draft:
        """The step's draft, cut to the room the context and n_predict leave (drafting.py), with the draft
        context's drafting KV discarded and the states a rollback needs saved (:3207-3307)."""
        n_max = draft_limit(self.record.limits.n_ctx, pos0, self.record.remaining())
        if n_max <= 0:
            return NO_DRAFT
        draft_state = self.slot.before_drafting()
        d = first_draft(self.drafters, self.kv, self.sampled, n_max, era=self.era, temp=self.params.temp)
        self.n_draft += len(d.tokens)
        self.slot.after_drafting(pos0, len(d.tokens), draft_state)
        return d

    def verify(self, draft: list[int], q: list | None, *, replay: bool) -> tuple[str, Verified]:
        """The rule a step verifies by, and what it kept: rejection when the drafter kept q, else
        sample-and-match; a replayed step at temp > 0 from b11368 accepts its tokens again
        (server_accept_replay, :57-80), at temp 0 they are sampled and matched again (:4267-4268)."""
        rows = ChainRows(self.ctx, self.chain)
        if replay and self.rejection_mode:
            return "checkpoint replay", by_replay(draft, rows)
        rule = "normal" if not draft else ("rejection" if q is not None else "sample-and-match")
        if rule == "rejection":
            v = by_rejection(draft, q, rows, lambda: canonical_float(self.rng))
        else:
            v = by_match(draft, rows, is_eog=self.target.is_eog, eog_rule=self.era.eog_rule)
        return (f"checkpoint replay ({rule})" if replay else rule), v

    def decode(self, tokens: list[int], pos0: int) -> None:
        """The target batch (outputs on every row) and its mirror in the draft context (no output), or the
        MTP heads' catch-up on it (loop/draft_mtp.py) (:4072-4084)."""
        self.ctx.decode(tokens, pos0, [True] * len(tokens))
        if self.memory.mtp is not None:
            self.memory.mtp.process(tokens, pos0)
        elif self.draft_ctx is not None:
            mirror(self.draft_ctx.ctx, tokens, pos0)

    def emit(self, step: Step, v: Verified) -> None:
        """The step's kept tokens through the stop rules; the rest of them are dropped once one stops
        generation (:4350-4368)."""
        n_before = len(self.emitted)
        for tok, (logits, cands), chosen in zip(v.ids, v.rows, v.chosen):
            step.emitted.append(tok)
            if not self.record.add(tok, step.index, logits, cands, n_before=n_before, n_step=len(v.ids),
                                   chosen=chosen):
                self.alive = False
                break
