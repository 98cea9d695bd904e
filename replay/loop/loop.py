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

Every emitted token carries its verify-row values, the ones a fixed server would report: the
pre-sampling softmax of the verify row that scored it, and the post-sampling candidates of the
target chain there: recover's truth (docs/architecture.md, "The truth"). recover computes most rows
one at a time in their kind (evaluation/walk.py, schedule/rows.py) and takes them from this loop where
the transcript does not show the server's batches (commands/looped.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from replay.builds.loop_shapes import Era
from replay.errors import TranscriptError
from replay.loop.draft_mtp import MtpHeads, check_mtp
from replay.loop.draft_model import DraftContext, DraftSimple, compatibility, mirror
from replay.loop.drafters import Drafter, make_drafters
from replay.loop.expectation import acceptance_prob, not_expectable
from replay.loop.replayable import check_replayable
from replay.loop.state import SlotState
from replay.loop.verifiers import ChainRows, Verified, by_match, by_rejection, by_replay
from replay.loop.verify import prob_of
from replay.numerics.rng import MT19937, REJECTION_SEED_XOR, canonical_float
from replay.numerics.server_probs import pre_sampling
from replay.runtime.llama import Model
from replay.runtime.sampler import LLAMA_DEFAULT_SEED, SamplerChain, post_sampling
from replay.schedule.memory import SlotConfig
from replay.schedule.prefix import FRESH, Prefix, plan_checkpointed, plan_prefix
from replay.schedule.prompt import NO_SPANS, MessageSpans
from replay.settings import SpecConfig, draft_thread_count
from replay.settings.sampling import Effective
from replay.transcripts.utf8 import utf8_complete

CANDS_KEPT = 256  # candidates kept per emitted token for explaining a divergence
BEST_KEPT = 256  # raw logits kept per emitted token, likewise
EMPTY_Q = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32))  # a draft distribution with no candidates


def drawn(params) -> bool:
    """Whether the server's chains draw at random (a seed then decides the tokens): a temperature above 0,
    a dynamic temperature range, or XTC on; else each keeps one candidate and the draw is no choice.

    >>> from replay.settings.sampling import SamplingParams
    >>> drawn(SamplingParams(temp=0.0)), drawn(SamplingParams(temp=0.7)), drawn(SamplingParams(temp=0.0, xtc_probability=0.5))
    (False, True, True)
    """
    return params.temp > 0 or params.dynatemp_range > 0 or params.xtc_probability > 0


@dataclass
class Emitted:
    """One token the server emitted, with its verify-row values (what a fixed server would report)."""

    index: int
    id: int
    step: int
    logprob: float  # pre-sampling, what a fixed server reports with post_sampling_probs false
    top: list[tuple[int, float]]
    post_prob: float
    post_top: list[tuple[int, float]]
    # how it was chosen, for explaining a divergence (comparison/divergence.py): the chain pass that scored
    # its row (1-based), that pass's candidates (ids and p, in order), and the verifier's rule
    draw: int = 0
    cands: np.ndarray | None = field(default=None, repr=False)
    # "drawn" (the target chain's own draw: a normal step, sample-and-match, a bonus), "replayed" (a restored
    # step's kept token), "rejection accepted" (a draft token the rejection rule kept), "rejection resampled"
    # (drawn from the residual in place of the first draft token it rejected): verify.py's words
    chosen: str = "drawn"
    # the row's BEST_KEPT largest raw logits (and its own): a near tie at temperature 0, or a token the
    # trace's chain cut that the server's kept within the numeric difference (comparison/divergence.py)
    best_logits: dict[int, float] = field(default_factory=dict, repr=False)


@dataclass
class Step:
    """One verify step. Vocabulary as in verify.py."""

    index: int
    pos0: int  # position of `sampled` (the last emitted token, not yet in the KV)
    sampled: int
    rule: str  # "normal" | "sample-and-match" | "rejection" | "checkpoint replay[ (sample-and-match)]",
    #            with ", checkpoint restored" when a partly accepted step was undone
    drafter: str | None = None
    draft: list[int] = field(default_factory=list)
    draft_q: list[float] | None = None  # draft probability of each draft token (probabilistic draft-simple)
    target_p: list[float] = field(default_factory=list)  # target (post-sampling) p of each verified draft token
    uniforms: list[list[float | None]] = field(default_factory=list)  # rejection draws: [u_accept, u_residual]
    # the verifier's probability of keeping each draft token once the ones before it were kept (Request.expect;
    # None: not asked, or the chain has no such probability: loop/expectation.py)
    accept_p: list[float] | None = None
    accepted: int = 0
    resampled: int | None = None
    bonus: int | None = None
    emitted: list[int] = field(default_factory=list)  # after the stop rules

    def to_json(self) -> dict:
        keys = ("index", "pos0", "sampled", "drafter", "draft", "draft_q", "target_p", "uniforms", "rule",
                "accepted", "resampled", "bonus", "emitted") + (("accept_p",) if self.accept_p is not None else ())
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class Limits:
    """What ends generation besides end-of-generation tokens (process_token, server-context.cpp:1966-2095)."""

    n_ctx: int  # the slot's context
    n_predict: int = -1  # -1: no limit
    stop: tuple[str, ...] = ()

    def context_full(self, n_prompt: int, n_before: int, n_step: int) -> bool:
        """The context stop for every token of a step (server-context.cpp:2018-2026):
        `prompt.n_tokens() + 1 >= n_ctx`, where at emission the slot holds the prompt, the tokens
        emitted before this step and all but one of this step's, the same for each of them:

            n_tokens = n_prompt + n_before + n_step - 1

        so a normal step stops after token n_ctx - n_prompt, and a speculative step whose accepted
        draft fills the context exactly stops after its first token."""
        return n_prompt + n_before + n_step - 1 + 1 >= self.n_ctx


@dataclass(frozen=True)
class SpecCheckpoint:
    """The slot's spec_ckpt (server-context.cpp:3205-3304): the contexts' states a step saves before
    drafting on a target whose memory cannot drop a suffix (recurrent and hybrid models: :3281-3299), to
    go back to after a partial acceptance; None for a context that can drop one."""

    target: bytes | None
    draft: bytes | None


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


def drafts_counted(n_accepted: int, replay: bool) -> int:
    """How many of a step's accepted tokens the server counts as accepted drafts (draft_n_accepted):
    a replayed step's last kept token was the verifier's, not a drafter's (:4322-4325).

    >>> drafts_counted(3, replay=False), drafts_counted(3, replay=True), drafts_counted(0, replay=True)
    (3, 2, 0)
    """
    return n_accepted - 1 if replay and n_accepted > 0 else n_accepted


@dataclass(frozen=True)
class Request:
    """What one request brings to the loop: its prompt ids, its sampling settings (with grammar and
    limits), the server's speculative flags, how many probabilities it asked for, the prompt's message
    spans (schedule/prompt.py), and the prompt tokens the server took from its cache (timings.cache_n)."""

    prompt: tuple[int, ...]
    settings: Effective
    spec: SpecConfig
    n_probs: int = 0
    spans: MessageSpans = NO_SPANS
    cached: int | None = None
    expect: bool = False  # take each draft's acceptance probabilities (Step.accept_p, loop/expectation.py: tune)
    # keep each emitted token's candidates and largest logits, what explaining a divergence needs
    # (comparison/trace.py explain); recover, which only asks whether the loop parts, goes without
    evidence: bool = True


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
        self.era = era
        params = settings.params
        # at temperature <= 0 (no dynamic range, no XTC) every sampler keeps one candidate before the draw
        # (src/llama-sampler.cpp:265-285, llama_sampler_temp_impl), so no seed moves a token: greedy runs
        # replay without one, as eval harnesses send them
        if params.seed == LLAMA_DEFAULT_SEED and drawn(params):
            raise TranscriptError("the request has no fixed seed (seed -1): the server drew a random one, so the "
                                  "run cannot be reproduced; record with an explicit \"seed\"")
        self.target, self.params = target, params
        self.limits = Limits(n_ctx=slot_config.n_ctx, n_predict=settings.n_predict, stop=settings.stop)
        self.prompt = list(request.prompt)
        self.n_probs = max(request.n_probs, 1)
        self.notes: list[str] = []
        self.prefix: Prefix = FRESH  # what the request kept of the slot's memory (reuse), once prefilled
        self.spans, self.cached = request.spans, request.cached
        self.expect = request.expect and not_expectable(params, settings.grammar is not None) is None
        self.evidence = request.evidence
        self.checkpoint = SpecCheckpoint(None, None)  # taken before the latest drafted step (checkpointed targets)
        self.pending: PendingReplay | None = None
        # a replayed step re-accepts its tokens at temp > 0 from b11368 (server_accept_replay, :4263)
        self.rejection_mode = era.rejection and params.temp > 0
        self.chain = SamplerChain(target, params, settings.grammar, suppress_tokens=era.suppress_tokens,
                                  single_draw=era.single_draw)
        self.rng = MT19937((params.seed ^ REJECTION_SEED_XOR) & 0xFFFFFFFF)  # common/sampling.cpp:440
        types, draft_model = self._drafting(spec, era, target, draft_model)
        self.owns_memory = slot_state is None
        self.state = state = slot_state if slot_state is not None else SlotState()
        # the draft context copies the target's -c/-b/-ub/-fa/--swa-full but has its own KV types, -ctkd/-ctvd,
        # and threads, -td
        draft_types = (spec.draft_cache_type_k, spec.draft_cache_type_v)
        draft_threads = draft_thread_count(spec) if draft_model is not None else None  # -td needs a draft model
        mtp = "draft-mtp" in types
        if mtp:
            check_mtp(target)
        key = (str(target.path), slot_config, str(draft_model.path) if draft_model is not None else None, draft_types,
               draft_threads, mtp)
        self.memory, self.continued = state.memory_for(
            key, lambda: slot_config.open(target, draft_model, draft_types, draft_threads, mtp=mtp))
        self.ctx = self.memory.ctx
        if mtp and self.memory.mtp is None:
            self.memory.mtp = MtpHeads(self.ctx, self.memory.draft, suppress_tokens=era.suppress_tokens)
        # recurrent and hybrid targets cannot drop rejected drafts: the server checkpoints them
        # ("speculative decoding will use checkpoints", server-context.cpp:1373-1380); with recurrent-state
        # snapshots (n_rs_seq > 0: MTP and the other hidden-state drafters on qwen35 and its kin) they drop up
        # to n_rs_seq, and only a longer rollback needs the checkpoint (RS: :3281-3284, 4276-4278)
        self.ckpt_tgt = not self.memory.target_removes
        self.n_rs_seq = self.ctx.n_rs_seq
        self.ckpt_dft = self.memory.draft is not None and not self.memory.draft_removes
        self.draft_ctx = (DraftContext(draft_model, self.memory.draft, era, params.temp, params.seed, state)
                          if draft_model is not None else None)
        self.drafters: list[Drafter] = make_drafters(replace(spec, spec_types=tuple(types)), draft_model=self.draft_ctx,
                                                     mtp=(self.memory.mtp, params.temp, params.seed) if mtp else None,
                                                     state=state, map_cleanup=era.map_cleanup)
        self.emitted: list[Emitted] = []
        self.text = b""
        self.kv: list[int] = []  # tokens in the target KV (prompt + accepted, without `sampled`)
        self.sampled = -1
        self.alive = True
        self.n_draft = 0
        self.n_accepted = 0

    def _drafting(self, spec, era: Era, target: Model, draft_model: Model | None) -> tuple[list[str], Model | None]:
        """The speculative types the server drafted with, and its draft model, as it would take them."""
        types = [t for t in spec.spec_types if t != "none"]
        if era.md_auto_draft and draft_model is not None and "draft-simple" not in types:
            # b9246..b9453: "'draft' speculative type is not explicitly enabled - enabling it"
            types.append("draft-simple")
            self.notes.append(f"-md without --spec-type draft-simple: {era.describe()} enables draft-simple itself")
        why = compatibility(target, draft_model) if draft_model is not None and "draft-simple" in types else None
        if why is not None:
            # the server logs "the target and draft vocabs are not compatible" and speculates not at all
            self.notes.append(f"the server cannot draft with {draft_model.path.name} ({why}), so it ran without "
                              "speculation (common_speculative_are_compatible); so does this trace")
            return [], None
        if not types:
            self.notes.append("no speculative type: the server did not speculate (from b9464 it speculates only "
                              "with --spec-type; -md alone loads the draft and never drafts); traced without drafting")
        return types, draft_model

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
        if n_prompt >= self.limits.n_ctx:  # the server answers 400 exceed_context_size_error (:3417-3425)
            raise TranscriptError(f"the prompt has {n_prompt} tokens but the context holds {self.limits.n_ctx}")
        self.prefix = self.reuse()
        self.memory.start(self.prompt, self.prefix, spans=self.spans)
        self.chain.accept_prompt(self.prompt)
        for d in self.drafters:
            d.begin(self.prompt)
        logits = self.ctx.logits(-1)
        tok, cands = self._sample(logits)
        draw = self.chain.n_applies
        self.chain.accept(tok)
        self.kv = list(self.prompt)
        self.sampled = tok
        self.alive = self.emit(tok, 0, logits, cands, n_before=0, n_step=1, chosen=(draw, "drawn"))
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
        if pending is not None:  # the kept tokens of a restored step: no drafting (:3215-3220)
            draft, drafter, q = pending.ids, pending.drafter, None
        else:
            draft, drafter, q = self.draft_step(pos0)
        before = SamplerState(self.chain.snapshot(), copy.deepcopy(self.rng)) \
            if self.checkpoint.target is not None and draft else None
        self.decode([sampled] + draft, pos0)
        accept_p = self.acceptance(draft, q) if self.expect and draft and pending is None else None
        rule, v = self.verify(draft, q, replay=pending is not None)
        step = Step(index=index, pos0=pos0, sampled=sampled, rule=rule, drafter=drafter.name if drafter else None,
                    draft=list(draft), draft_q=_q_of(draft, q), target_p=v.target_p, uniforms=v.uniforms,
                    accept_p=accept_p, accepted=len(v.ids) - 1, resampled=v.resampled, bonus=v.bonus)
        if before is not None and self.rolls_back(len(draft) + 1 - len(v.ids)):
            self.restore(pos0, before)
            self.pending = PendingReplay(list(v.ids), drafter)
            return replace(step, rule=rule + ", checkpoint restored")
        if before is not None:
            self.chain.close_snapshot(before.chain)
        self.n_accepted += drafts_counted(step.accepted, replay=pending is not None)
        if drafter is not None:  # every drafter hears what was accepted (common_speculative_accept, :2958-2992)
            for d in self.drafters:
                if d is drafter or getattr(d, "accepts_others", False):
                    d.accept(step.accepted)
        self.trim(pos0 + 1 + step.accepted)
        self.kv += [sampled] + v.ids[:-1]
        self.sampled = v.ids[-1]
        n_before = len(self.emitted)
        for tok, (logits, cands), chosen in zip(v.ids, v.rows, v.chosen):
            step.emitted.append(tok)
            if not self.emit(tok, index, logits, cands, n_before=n_before, n_step=len(v.ids), chosen=chosen):
                self.alive = False
                break  # the rest of this step's tokens are dropped
        return step

    def draft_step(self, pos0: int) -> tuple[list[int], Drafter | None, list | None]:
        """Drafting, on a checkpointed target after saving both contexts' states (:3262-3307)."""
        dft_state = self.memory.draft.save_partial() if self.memory.draft is not None and self.ckpt_dft else None
        draft, drafter, q = self.draft_tokens(pos0, dft_state)
        self.n_draft += len(draft)
        self.checkpoint = SpecCheckpoint(self.ctx.save_partial() if self.rolls_back(len(draft)) else None, dft_state)
        return draft, drafter, q

    def rolls_back(self, n: int) -> bool:
        """Whether taking back `n` tokens of the target needs the checkpoint: any on a memory that cannot drop
        a suffix (FULL), more than n_rs_seq on one with snapshots (RS), none otherwise (PART) (server-context.cpp:
        3281-3284 with n the draft's length when it is taken, 4276-4278 with n the rollback)."""
        if n <= 0:
            return False
        return self.ckpt_tgt or (self.n_rs_seq > 0 and n > self.n_rs_seq)

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

    def restore(self, pos0: int, before: SamplerState) -> None:
        """Undo a partly accepted step on a checkpointed target: both contexts back to the checkpoint,
        the chain and the rejection RNG to `before` (:4282-4311); nothing is emitted."""
        self.ctx.load_partial(self.checkpoint.target)
        self.ctx.seq_rm(0, pos0, -1)
        if self.memory.draft is not None:
            if self.checkpoint.draft is not None:
                self.memory.draft.load_partial(self.checkpoint.draft)
            self.memory.draft.seq_rm(0, pos0, -1)
        self.chain.restore(before.chain)
        self.rng = before.rng

    def draft_tokens(self, pos0: int, dft_state: bytes | None = None) -> tuple[list[int], Drafter | None, list | None]:
        """(draft, the drafter that made it, its q per position or None): the first drafter with a
        non-empty draft wins; the draft context's drafting KV is then discarded (:3262-3307)."""
        n_remaining = self.limits.n_predict - len(self.emitted) if self.limits.n_predict >= 0 else -1
        n_max = self.limits.n_ctx - pos0 - 2
        if n_remaining > 0:
            n_max = min(n_max, n_remaining - 1)
        if n_max <= 0:
            return [], None, None
        draft: list[int] = []
        drafter, q = None, None
        for d in self.drafters:
            got = d.draft(self.kv, self.sampled, n_max)
            if got:
                draft, drafter = got[:n_max], d
                if getattr(d, "last_q", None) is not None:  # draft-simple's or MTP's probabilistic drafts
                    q = d.last_q[:n_max]
                elif self.era.q_trim_bug and self.params.temp > 0 and len(got) > n_max:
                    # b11368..b11382: the server resizes the empty q of an n-gram draft it cuts to n_max
                    # rows of nothing, and verifies it by rejection (builds/loop_shapes.py q_trim_bug)
                    q = [EMPTY_Q] * n_max
                break
        if self.memory.draft is not None:  # the draft model's context, or the MTP context (:3271-3279)
            if dft_state is not None:  # a draft model that cannot drop a suffix goes back to its checkpoint
                self.memory.draft.load_partial(dft_state)
            self.memory.draft.seq_rm(0, pos0, -1)
        return draft, drafter, q

    def decode(self, tokens: list[int], pos0: int) -> None:
        """The target batch (outputs on every row) and its mirror in the draft context (no output), or the
        MTP heads' catch-up on it (loop/draft_mtp.py)."""
        self.ctx.decode(tokens, pos0, [True] * len(tokens))
        if self.memory.mtp is not None:
            self.memory.mtp.process(tokens, pos0)
        elif self.draft_ctx is not None:
            mirror(self.draft_ctx.ctx, tokens, pos0)

    def acceptance(self, draft: list[int], q: list | None) -> list[float]:
        """a[j] for every draft position (loop/expectation.py): the target chain's p of d[j] at row j with
        d[0..j) accepted into its history, divided by q under the rejection rule; 0 from an end-of-generation
        draft token before the draft's end on (sample-and-match stops there and counts it as no accepted
        draft). The chain (its history and random state) is put back as it was: verification then runs as
        the server's."""
        rule = "rejection" if q is not None else "sample-and-match"  # as verify() chooses
        snap, passes = self.chain.snapshot(), self.chain.passes
        out = []
        try:
            for j, d_tok in enumerate(draft):
                cands, _ = self.chain.apply(self.ctx.logits(j))
                p = float(ChainRows(self.ctx, self.chain).target_p(cands)[cands["id"] == d_tok].sum()) if len(cands) else 0.0
                q_j = None
                if rule == "rejection":
                    qi, qp = q[j]
                    q_j = float(prob_of(qi, qp, d_tok))
                if rule == "sample-and-match" and self.era.eog_rule and self.target.is_eog(d_tok) and j + 1 < len(draft):
                    # the verifier stops at a matched end of generation before the draft's end: it is emitted
                    # as the target's own draw, not counted as an accepted draft, and nothing after it is
                    # (match_continues, common/sampling.cpp:696)
                    out += [0.0] * (len(draft) - j)
                    break
                out.append(acceptance_prob(rule, p, q_j))
                self.chain.accept(d_tok)
        finally:
            self.chain.restore(snap)
            self.chain.passes = passes  # not the server's work
        return out

    def trim(self, keep: int) -> None:
        """Positions from `keep` on (rejected drafts) leave both KV caches (:4342-4348)."""
        self.ctx.seq_rm(0, keep, -1)
        if self.memory.draft is not None:
            self.memory.draft.seq_rm(0, keep, -1)

    def emit(self, tok: int, step: int, logits: np.ndarray, cands: np.ndarray, *, n_before: int,
             n_step: int, chosen: tuple[int, str] = (0, "drawn")) -> bool:
        """Record one emitted token with its verify-row values (what a server patched to report real
        probabilities sends; recover's truth is evaluation/walk.py's: docs/architecture.md, "The truth");
        False when generation stops after it
        (process_token, server-context.cpp:1966-2095: stop strings, the context, n_predict, EOG).
        `n_before` tokens were emitted before this step, which verified `n_step` (Limits.context_full)."""
        logprob, top = pre_sampling(logits, tok, self.n_probs)
        post_p, post_top = post_sampling(cands, tok, self.n_probs)
        kept, best = None, {}
        if self.evidence:
            kept = cands[:CANDS_KEPT].copy()
            ids = np.argpartition(logits, -BEST_KEPT)[-BEST_KEPT:] if len(logits) > BEST_KEPT else np.arange(len(logits))
            best = {int(i): float(logits[i]) for i in ids} | {tok: float(logits[tok])}
        self.emitted.append(Emitted(len(self.emitted), tok, step, logprob, top, post_p, post_top, draw=chosen[0],
                                    cands=kept, chosen=chosen[1], best_logits=best))
        self.text += self.target.piece(tok, special=False)
        lim = self.limits
        # the server looks for stop strings only while the text ends in a whole UTF-8 character, in its
        # bytes (:1977-1996)
        if utf8_complete(self.text) == len(self.text) and any(s and s.encode() in self.text for s in lim.stop):
            return False
        if self.target.is_eog(tok):
            return False
        if lim.context_full(len(self.prompt), n_before, n_step):
            return False
        if lim.n_predict >= 0 and len(self.emitted) >= lim.n_predict:
            return False
        return True

    # --- helpers ---------------------------------------------------------------------------

    def _sample(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        cands, sel = self.chain.sample(logits)
        return int(cands["id"][sel]), cands


def _q_of(draft: list[int], q: list | None) -> list[float] | None:
    """The draft's own probability of each draft token, from its candidates at that position."""
    if not q:
        return None
    return [float(qp[list(qi).index(t)]) if t in qi else 0.0 for t, (qi, qp) in zip(draft, q)]
