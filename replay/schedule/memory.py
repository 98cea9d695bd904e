"""A server slot's memory, in-process: the prompt phase of a request run as llama-server runs it.

`SlotMemory` holds the target context (and the draft model's, which mirrors every prompt batch:
common_speculative_process, server-context.cpp:4072-4084), the tokens in it, and the slot's context
checkpoints with their saved state. `prefill` decodes a prompt from `n_past` in the server's batches
(schedule/prompt.py), saving a checkpoint before the batches the server saves one before; `restore`
brings a checkpoint back for a request that reuses the slot's memory (plan_reuse), as the server
does before trimming the memory to n_past (:3597-3611, 3674).

A checkpoint's state is the memory that cannot drop a suffix: the sliding-window cells, or the
recurrent state (llama_state_seq_*_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, as
common_prompt_checkpoint::update_tgt / load_tgt take it). Its pos_min/pos_max are the memory's
before the batch it precedes (:3884-3885).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from replay.builds.prompt_rules import BuildRules, rules_of_build
from replay.errors import ModelError, TranscriptError
from replay.runtime.llama import Context, Model
from replay.schedule.prefix import Prefix
from replay.schedule.prompt import NO_SPANS, CheckpointRules, MessageSpans, PromptBatch, next_batch, with_checkpoint
from replay.settings.config import context_size, host_cores, kv_layout, rollback_snapshots, thread_count


@dataclass
class Checkpoint:
    """common_prompt_checkpoint: where it was taken, by which request, and the saved states."""

    n_tokens: int
    pos_min: int
    pos_max: int
    task: int
    data_tgt: bytes = field(default=b"", repr=False)
    data_dft: bytes | None = field(default=None, repr=False)


def checkpoint_rules(model: Model, removes_suffixes: bool, *, n_ctx_checkpoints: int = 32,
                     min_step: int | None = None, swa_full: bool = False, build: int | None = None,
                     bounded: bool = False) -> CheckpointRules:
    """Does the server checkpoint this target (server-context.cpp:3708-3721)? When --ctx-checkpoints > 0
    and its memory cannot drop a suffix (recurrent or hybrid: common_context_can_seq_rm gives FULL, which
    Context.removes_suffixes() tells), drops one only up to a bound (`bounded`: recurrent-state snapshots,
    RS) or it has sliding-window layers without --swa-full (n_swa = llama_model_n_swa unless swa_full,
    :1337). `build` picks the rules of that build (builds.py; None: the newest); `min_step` None is that
    build's default."""
    swa = 0 if swa_full else model.n_swa
    rules = rules_of_build(build)
    enabled = n_ctx_checkpoints > 0 and (swa > 0 or not removes_suffixes or bounded)
    return CheckpointRules(enabled, n_ctx_checkpoints=n_ctx_checkpoints,
                           min_step=rules.min_step if min_step is None else min_step, build=rules)


def schedule_of(slot: "SlotMemory", spans: MessageSpans) -> dict:
    """The prompt schedule a request was evaluated with, for reports: whether the target checkpoints,
    the sizes of the last prompt's batches, the slot's checkpoints and the user-message starts."""
    return {"checkpoints": slot.rules.enabled, "prompt_batches": [b.end - b.start for b in slot.last_batches],
            "checkpoints_at": [c.n_tokens for c in slot.checkpoints], "user_message_starts": list(spans.user_starts)}


def min_step_given(cfg) -> int | None:
    """--checkpoint-min-step when it was given (our flags, the transcript's), else None: the build's default."""
    return None if cfg.sources.get("checkpoint_min_step", "default") == "default" else cfg.checkpoint_min_step


@dataclass(frozen=True)
class SlotConfig:
    """How llama-server made a slot's target context and when it checkpoints it, from its context flags
    (settings.ContextConfig), how its slots were asked for (the transcript's flags: kv_layout) and its
    build (the prompt rules: builds/prompt_rules.py). Equal configs make equal slots: a made slot is
    kept while the config stays the same (recover's Recoverer, trace's slot state)."""

    n_ctx: int
    n_batch: int  # -b, at most n_ctx (the server's context takes min(n_batch, n_ctx))
    n_ubatch: int
    threads: int
    flash_attn: str
    type_k: str
    type_v: str
    swa_full: bool
    n_seq_max: int
    kv_unified: bool
    n_ctx_checkpoints: int
    min_step: int | None  # --checkpoint-min-step when given, else None: the build's default
    rules: BuildRules
    build: int | None = field(default=None, compare=False)  # for reports; `rules` is what decides
    n_rs_seq: int = 0  # the target's recurrent-state snapshots asked for (settings/config.py rollback_snapshots)
    # MTP heads draft: the server's target keeps every row's hidden state for them (llama_set_embeddings_nextn,
    # unmasked: common/speculative.cpp:1478), which on some architectures runs the last layer on every row of
    # a batch instead of its output rows (e.g. glm4-moe.cpp:368, deepseek2.cpp:637): the first entry too
    nextn: bool = False

    @staticmethod
    def of(cfg: Any, recorded: Mapping[str, Any] | None = None, build: int | None = None,
           spec: Any | None = None) -> "SlotConfig":
        """From a ContextConfig, the transcript's server flags, the server's build number (None: unknown)
        and its speculative settings (SpecConfig: the snapshots its drafters ask of the target)."""
        n_ctx = context_size(cfg)
        n_seq_max, unified = kv_layout(cfg, recorded)
        return SlotConfig(n_ctx, min(cfg.n_batch, n_ctx), cfg.n_ubatch, thread_count(cfg), cfg.flash_attn,
                          cfg.cache_type_k, cfg.cache_type_v, cfg.swa_full, n_seq_max, unified, cfg.n_ctx_checkpoints,
                          min_step_given(cfg), rules_of_build(build), build, rollback_snapshots(spec),
                          spec is not None and "draft-mtp" in (spec.spec_types or ()))

    def context(self, model: Model, type_k: str | None = None, type_v: str | None = None,
                threads: int | None = None, *, target: bool = False) -> Context:
        """A context for `model` made as the server makes the slot's: the `target`'s with the snapshots its
        drafters ask for (the draft model's never: common/common.cpp:1251), the draft model's with its own
        KV types (-ctkd/-ctvd) and threads (-td, where given: common_base_params_to_speculative,
        common/speculative.cpp:2527-2560)."""
        return Context(model, n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                       n_threads=threads or self.threads,
                       n_threads_batch=host_cores(),
                       flash_attn=self.flash_attn, type_k=type_k or self.type_k, type_v=type_v or self.type_v,
                       swa_full=self.swa_full, n_seq_max=self.n_seq_max, kv_unified=self.kv_unified,
                       n_rs_seq=self.n_rs_seq if target else 0)

    def open(self, target: Model, draft: Model | None = None,
             draft_types: tuple[str, str] = ("f16", "f16"), draft_threads: int | None = None, *,
             mtp: bool = False) -> "SlotMemory":
        """A fresh slot: the target's context (and the draft model's, on `draft_threads`: None, the
        target's; or, `mtp`, the target's MTP context), with the checkpoint rules of the target's memory.
        The slot owns its contexts (SlotMemory.close)."""
        ctx = self.context(target, target=True)
        if self.nextn and target.n_layer_nextn > 0:
            ctx.keep_hidden(masked=False)
        removes = ctx.removes_suffixes()
        if mtp:
            # made from the target model on the target's settings, the draft KV types (-ctkd/-ctvd) and the
            # target's -t (-td is a draft model's only), one output row per slot (common/speculative.cpp:
            # 2527-2562, 2603-2617). Its memory is a plain KV of the nextn layers (src/llama-model.cpp:
            # 2808-2820), which drops a suffix: nothing to probe
            dctx = Context(target, n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                           n_threads=self.threads, n_threads_batch=host_cores(), flash_attn=self.flash_attn,
                           type_k=draft_types[0], type_v=draft_types[1], swa_full=self.swa_full,
                           n_seq_max=self.n_seq_max, kv_unified=self.kv_unified, mtp_of=ctx,
                           n_outputs_max=self.n_seq_max)
        else:
            dctx = self.context(draft, *draft_types, threads=draft_threads) if draft is not None else None
        rules = checkpoint_rules(target, removes, n_ctx_checkpoints=self.n_ctx_checkpoints,
                                 min_step=self.min_step, swa_full=self.swa_full, build=self.build,
                                 bounded=ctx.n_rs_seq > 0)
        return SlotMemory(ctx, rules, n_swa=0 if self.swa_full else target.n_swa, draft=dctx,
                          removes=(removes, dctx is None or mtp or dctx.removes_suffixes()))


class SlotMemory:
    """One slot's memory: its contexts (SlotConfig.open makes them; close() frees them), the slot's
    checkpoints, and the request counter."""

    def __init__(self, ctx: Context, rules: CheckpointRules, *, n_swa: int, draft: Context | None = None,
                 removes: tuple[bool, bool] = (True, True)):
        self.ctx, self.draft, self.rules, self.n_swa = ctx, draft, rules, n_swa
        # can the target's (the draft's) memory drop a suffix (Context.removes_suffixes, asked once when made)?
        self.target_removes, self.draft_removes = removes
        self.checkpoints: list[Checkpoint] = []
        self.task = 0
        self.last_batches: list[PromptBatch] = []  # the batches of the last prompt prefilled
        # draft-mtp's carry over the MTP context `draft` (loop/draft_mtp.py MtpHeads; the loop attaches it):
        # kept with the slot for the server's life, as the server never resets it
        self.mtp: Any = None

    @property
    def tokens(self) -> list[int]:
        """The tokens in the slot's memory, by position."""
        return self.ctx.kv_tokens

    def close(self) -> None:
        if self.mtp is not None:
            self.mtp.close()
            self.mtp = None
        for c in (self.draft, self.ctx):
            if c is not None:
                c.close()

    def reset(self) -> None:
        """An empty slot (a fresh server, or a slot whose history is unknown)."""
        self.ctx.clear()
        if self.draft is not None:
            self.draft.clear()
        self.checkpoints = []

    def restore(self, ck: Checkpoint) -> None:
        """Load a checkpoint's states into the contexts (load_tgt / load_dft, :3597-3601)."""
        self.ctx.load_partial(ck.data_tgt)
        if self.draft is not None and ck.data_dft is not None:
            self.draft.load_partial(ck.data_dft)

    def keep(self, n_past: int, checkpoints: Sequence[Checkpoint] | None = None) -> None:
        """Trim both contexts to the first n_past positions (seq_rm(p0, -1), :3674); `checkpoints` is the
        slot's list after the request's reuse decision (plan_reuse erases those past n_past)."""
        if checkpoints is not None:
            self.checkpoints = list(checkpoints)
        for c in (self.ctx, self.draft):
            if c is not None:
                if n_past > 0:
                    c.seq_rm(0, n_past, -1)
                else:
                    c.clear()

    def start(self, prompt: Sequence[int], prefix: Prefix, spans: MessageSpans = NO_SPANS) -> None:
        """A request's prompt phase: keep the first `prefix.keep` positions as the previous request left
        them (prefix.py says when that is the server's state; a checkpointing target restores the
        slot checkpoint the server restored first), or evaluate them on their own when the context
        does not hold them or `prefix.rebuild` says its cells were computed another way; then decode
        the rest of the prompt in the server's batches, as the server does from its n_past."""
        ctx, keep = self.ctx, prefix.keep
        n_prompt = len(prompt)
        if n_prompt == 0:
            raise TranscriptError("the prompt has no tokens")
        if n_prompt >= ctx.n_ctx:
            raise ModelError(f"the prompt has {n_prompt} tokens but the context holds {ctx.n_ctx}: "
                             "pass a larger --ctx-size (the server's -c)")
        if keep >= n_prompt:
            raise ValueError(f"cannot keep {keep} of {n_prompt} prompt positions: the last one must be decoded")
        if not prefix.rebuild and list(ctx.kv_tokens[:keep]) == list(prompt[:keep]):
            if prefix.restore is not None:
                self.restore(prefix.restore)
            self.keep(keep, prefix.checkpoints)
        else:  # rebuild those cells by evaluating the kept prefix on its own, as a prompt
            self.reset()
            if keep:
                # the MTP heads' carry stays what the previous request left: the server ran no catch-up
                # on tokens it took from its cache
                carry = (self.mtp.pending_h, self.mtp.verify_h) if self.mtp is not None else None
                self.prefill(prompt[:keep], spans=MessageSpans(tuple(p for p in spans.user_starts if p < keep)),
                             output_last=False)
                if carry is not None:
                    self.mtp.pending_h, self.mtp.verify_h = carry
        self.prefill(prompt, keep, spans=spans)

    def prefill(self, prompt: Sequence[int], n_past: int = 0, *, spans: MessageSpans = NO_SPANS,
                output_last: bool = True) -> list[PromptBatch]:
        """Decode prompt[n_past:] in the server's batches (logits at the last prompt token when
        `output_last`), saving checkpoints where the server does; returns the batches."""
        self.task += 1
        n = len(prompt)
        batches = []
        start = n_past
        while start < n:
            b = next_batch(n, start, n_batch=self.ctx.n_batch, n_ubatch=self.ctx.n_ubatch, rules=self.rules,
                           spans=spans, last_checkpoint=self.checkpoints[-1].n_tokens if self.checkpoints else None,
                           memory_empty=self.ctx.pos_min() < 0)
            if b.checkpoint:
                self._checkpoint(b.start)
            part = list(prompt[b.start:b.end])
            outs = [False] * (len(part) - 1) + [output_last and b.end == n]
            self.ctx.decode(part, b.start, outs)
            if self.mtp is not None:  # MTP heads catch up on every target batch (loop/draft_mtp.py)
                self.mtp.process(part, b.start)
            elif self.draft is not None:  # the draft context mirrors the batch (loop/draft_model.py mirror)
                self.draft.decode(part, b.start, [False] * len(part))
            batches.append(b)
            start = b.end
        if output_last:
            self.last_batches = batches
        return batches

    def _checkpoint(self, n_tokens: int) -> None:
        ck = Checkpoint(n_tokens, self.ctx.pos_min(), self.ctx.pos_max(), self.task, self.ctx.save_partial(),
                        self.draft.save_partial() if self.draft is not None else None)
        self.checkpoints = with_checkpoint(self.checkpoints, ck, n_max=self.rules.n_ctx_checkpoints,
                                           min_step=self.rules.min_step, eviction=self.rules.build.eviction)
