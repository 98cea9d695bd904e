"""How llama-server cuts a prompt into decode batches, and before which batches it saves a context
checkpoint. Pure: the decisions only; schedule/memory.py runs them on a libllama context.

A KV cell's values depend on the batch it was computed in (on quantized weights the CPU kernels
change with the row count), so a replay that decodes the prompt in other batches than the server
did reports other values: on Gemma 3 270M Q4_K_M an 821-token prompt in one batch puts the first
token 0.089 nats off; cut as the server cuts it (305 + 512 + 4 tokens), 3e-4.

The server fills one batch per update_slots() pass (tools/server/server-context.cpp:3781-3849),
up to n_batch tokens. When it may checkpoint (`do_checkpoint`, :3708-3721: --ctx-checkpoints > 0,
a completion task, and a target whose memory cannot drop a suffix: recurrent/hybrid, or
sliding-window attention without --swa-full), it also ends a batch

* after a token that leaves exactly min(n_batch, 4 + n_ubatch) or min(n_batch, 4) prompt tokens
  (`checkpoint_offsets`, :3829-3848, PR #20288), so the memory can be saved just before them;
* before a user message starts (the request's message spans, :3820-3827) when that message is the
  last user message, when the slot has no checkpoint yet, or when it is more than
  --checkpoint-min-step tokens past the slot's last checkpoint.

Before decoding a batch it saves a checkpoint at n_tokens = the batch's start (:3852-3905) when it
may checkpoint, the memory is not empty, and the batch ends the prompt, starts a user message, or
ends within n_ubatch tokens of the prompt's end; and, unless that batch starts the last user
message or is near the end, only more than min-step tokens after the last checkpoint. The list
keeps at most --ctx-checkpoints entries (create_checkpoint, :2513-2580).

    >>> rules = CheckpointRules(enabled=True)
    >>> [(b.start, b.end, b.checkpoint) for b in prompt_batches(821, n_batch=2048, n_ubatch=512, rules=rules)]
    [(0, 305, False), (305, 817, True), (817, 821, True)]
    >>> [(b.start, b.end) for b in prompt_batches(821, n_batch=2048, n_ubatch=512, rules=CheckpointRules(False))]
    [(0, 821)]

The rules of older builds differ in the details (user-message breaks, spacing, eviction): builds.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

from replay.builds.prompt_rules import NEWEST, BuildRules


@dataclass(frozen=True)
class CheckpointRules:
    """What a server does about context checkpoints for one target, and its build's rules (builds.py)."""

    enabled: bool  # do_checkpoint's model and flag condition (server-context.cpp:3708-3721)
    n_ctx_checkpoints: int = 32  # --ctx-checkpoints (common/common.h:635)
    min_step: int = 8192  # --checkpoint-min-step (common/common.h:637; the build's default when not given)
    build: BuildRules = NEWEST

    @property
    def user_breaks(self) -> bool:
        """Can a user-message start end a batch for this target?"""
        return self.build.user_breaks in ("last", "every") or (self.build.user_breaks == "gated" and self.enabled)


@dataclass(frozen=True)
class MessageSpans:
    """Where user messages start in a prompt's tokens (common_chat_msg_spans, common/chat.h:166-190).

    >>> s = MessageSpans((3, 10))
    >>> s.is_user_start(10), s.is_user_start(4), s.last_user
    (True, False, 10)
    """

    user_starts: tuple[int, ...] = ()

    def is_user_start(self, pos: int) -> bool:
        return pos in self.user_starts

    @property
    def last_user(self) -> int:
        """last_user_message_pos(): -1 without user messages."""
        return self.user_starts[-1] if self.user_starts else -1


NO_SPANS = MessageSpans()


@dataclass(frozen=True)
class PromptBatch:
    """Prompt tokens [start, end) decoded together; `checkpoint`: the memory is saved first, at n_tokens = start."""

    start: int
    end: int
    checkpoint: bool = False


def next_batch(n_tokens: int, start: int, *, n_batch: int, n_ubatch: int, rules: CheckpointRules,
               spans: MessageSpans = NO_SPANS, last_checkpoint: int | None = None, memory_empty: bool = False,
               batch_used: int = 0) -> PromptBatch:
    """The next prompt batch of a slot that has `start` of its `n_tokens` prompt tokens in memory.

    `last_checkpoint` is the n_tokens of the slot's newest checkpoint (None: it has none);
    `memory_empty`: the slot's memory holds no cell (llama_memory_seq_pos_min < 0, :3887);
    `batch_used`: tokens other slots put in the batch first (generating slots go first, :3310).
    The forms of older builds (builds.py) are taken from `rules.build`.

        >>> next_batch(821, 0, n_batch=2048, n_ubatch=512, rules=CheckpointRules(True), memory_empty=True)
        PromptBatch(start=0, end=305, checkpoint=False)
        >>> next_batch(5, 0, n_batch=2048, n_ubatch=512, rules=CheckpointRules(True), memory_empty=True).end
        1
        >>> next_batch(3000, 0, n_batch=2048, n_ubatch=512, rules=CheckpointRules(True), memory_empty=True).end
        2048
    """
    do, form = rules.enabled, rules.build.user_breaks
    end, size = start, batch_used
    while end < n_tokens and size < n_batch:  # :3781
        end += 1
        size += 1
        if spans.is_user_start(end):  # :3820-3827 (gated); older builds break without a checkpoint
            if form == "every" or (form == "last" and end == spans.last_user):
                break
            if form == "gated" and do and (end == spans.last_user or last_checkpoint is None
                                           or end > last_checkpoint + rules.min_step):
                break
        if do and any(n_tokens == end + min(n_batch, off) for off in (4 + n_ubatch, 4)):
            break  # :3829-3848
    return PromptBatch(start, end, do and _checkpoints_before(n_tokens, start, end, n_ubatch=n_ubatch, rules=rules,
                                                              spans=spans, last=last_checkpoint, empty=memory_empty))


def _checkpoints_before(n_tokens: int, start: int, end: int, *, n_ubatch: int, rules: CheckpointRules,
                        spans: MessageSpans, last: int | None, empty: bool) -> bool:
    """Is a checkpoint saved before decoding prompt batch [start, end) (:3852-3905, builds.py for older forms)?"""
    b = rules.build
    near_end = n_tokens < end + n_ubatch  # :3856
    if b.small_gate:  # b9093..b9305: no user messages; mid-prompt checkpoints every --checkpoint-every-n-tokens
        if end != n_tokens and not near_end and end - (end - start) - (last or 0) < rules.min_step:
            return False
        return not empty and end >= 64 and (last is None or start > last + 64)
    if b.user_breaks == "last":  # b9310..b9763: around the last user message only
        known = spans.last_user > 0
        if end != n_tokens and not known and not near_end:
            return False
        on_user, after_user = known and start == spans.last_user, known and start > spans.last_user
        if known and not (on_user or (after_user and near_end)):
            return False
        return not empty and (last is None or start > last + rules.min_step)
    if end != n_tokens and not spans.is_user_start(start) and not near_end:  # :3875-3880
        return False
    if empty:  # :3887-3889
        return False
    return (last is None or start == spans.last_user or (near_end and b.near_end_gate)
            or start > last + rules.min_step)  # :3895-3898


C = TypeVar("C")


def with_checkpoint(checkpoints: Sequence[C], new: C, *, n_max: int, min_step: int, eviction: str = "full") -> list[C]:
    """The slot's checkpoint list after create_checkpoint adds `new` (server-context.cpp:2513-2580).

    Items have `n_tokens` and `task` (the request that made them). When the list would be full,
    checkpoints of other requests that lie within min_step of an earlier kept one go first; then the
    oldest, until there is room; one at the same n_tokens is superseded. Older builds (`eviction`,
    builds.py): "spacing" thins by min_step at every addition and never supersedes; "oldest" only
    drops the oldest.

        >>> from types import SimpleNamespace as C
        >>> ck = [C(n_tokens=n, task=0) for n in (10, 20, 30)]
        >>> [c.n_tokens for c in with_checkpoint(ck, C(n_tokens=40, task=1), n_max=3, min_step=15)]
        [10, 30, 40]
        >>> [c.n_tokens for c in with_checkpoint(ck, C(n_tokens=40, task=1), n_max=3, min_step=0)]
        [20, 30, 40]
    """
    ck = list(checkpoints)
    last, i = -1, 0
    while eviction != "oldest" and (eviction == "spacing" or len(ck) + 1 >= n_max) and i < len(ck):
        c = ck[i]
        if c.task != new.task and last >= 0 and c.n_tokens <= last + min_step:
            del ck[i]
            continue
        last = c.n_tokens
        i += 1
    while ck and len(ck) >= n_max:
        del ck[0]
    if eviction == "full":
        ck = [c for c in ck if c.n_tokens != new.n_tokens]
    ck.append(new)
    return ck


@dataclass(frozen=True)
class Mark:
    """A checkpoint without its data, for planning (n_tokens where it was taken, the request that made it)."""

    n_tokens: int
    task: int = 0
    pos_min: int = 0
    pos_max: int = 0


def prompt_batches(n_tokens: int, *, n_batch: int, n_ubatch: int, rules: CheckpointRules, n_past: int = 0,
                   spans: MessageSpans = NO_SPANS, checkpoints: Sequence[Mark] = ()) -> list[PromptBatch]:
    """Every batch of a prompt from `n_past`, the slot holding `checkpoints` (see next_batch)."""
    out: list[PromptBatch] = []
    ck = list(checkpoints)
    start = n_past
    while start < n_tokens:
        b = next_batch(n_tokens, start, n_batch=n_batch, n_ubatch=n_ubatch, rules=rules, spans=spans,
                       last_checkpoint=ck[-1].n_tokens if ck else None, memory_empty=start == 0)
        if b.checkpoint:
            ck = with_checkpoint(ck, Mark(b.start, task=-2), n_max=rules.n_ctx_checkpoints, min_step=rules.min_step,
                                 eviction=rules.build.eviction)
        out.append(b)
        start = b.end
    return out


@dataclass(frozen=True)
class Reuse:
    """What a new request on a slot keeps (the SLOT_STATE_STARTED block, server-context.cpp:3442-3644)."""

    n_past: int  # prompt tokens taken from the slot (the response's timings.cache_n)
    restore: object | None = None  # the checkpoint restored first (an item of the slot's list)
    checkpoints: tuple = ()  # the slot's list afterwards (those with pos_max > pos_next erased)
    why: str = ""


def plan_reuse(prompt: Sequence[int], slot_tokens: Sequence[int], checkpoints: Sequence, *, cache_prompt: bool,
               pos_min: int, n_swa: int, build: BuildRules = NEWEST) -> Reuse:
    """How much of the slot's memory a request keeps, and which checkpoint it restores.

    `slot_tokens` are the tokens in the slot's memory (the previous request's prompt and generated
    tokens, but its last one), `pos_min` the memory's llama_memory_seq_pos_min now, `n_swa` the
    model's sliding window (0 with --swa-full or without SWA). The rule (:3442-3644):

        n_past = common prefix (0 without cache_prompt); thold = max(0, n_past - n_swa - (0 if new tokens else 1))
        if 0 < n_past <= len(slot_tokens) and pos_min >= thold:     # the memory lacks cells it needs
            the newest checkpoint with pos_max <= n_past and (pos_min < thold or pos_min == 0) is restored:
                n_past = min(n_past, max(its pos_min + 1, its pos_max), its n_tokens)
            none: the whole prompt is processed again (n_past = 0)
        checkpoints with pos_max > n_past are erased; at least one token is evaluated (n_past - 1)

        >>> m = [Mark(305, pos_min=0, pos_max=304), Mark(817, pos_min=305, pos_max=816)]
        >>> r = plan_reuse(list(range(900)), list(range(850)), m, cache_prompt=True, pos_min=338, n_swa=512)
        >>> r.n_past, r.restore.n_tokens, [c.n_tokens for c in r.checkpoints]   # position 816 is evaluated again
        (816, 817, [305, 817])
        >>> plan_reuse([1, 2, 3], [1, 2, 3, 4], [], cache_prompt=True, pos_min=0, n_swa=0).n_past
        2
    """
    n_past = _common_prefix(slot_tokens, prompt) if cache_prompt else 0
    pos_next = n_past
    has_new = n_past < len(prompt)
    minus = {"window": 0, "window-1": 1}.get(build.threshold, 0 if has_new else 1)
    thold = max(0, pos_next - n_swa - minus)  # :3527, PR #24110
    restore, why = None, "common prefix" if n_past else "nothing kept"
    inside = n_past < len(slot_tokens) if build.threshold == "window" else n_past <= len(slot_tokens)
    if n_past > 0 and inside and pos_min >= thold:
        restore = next((c for c in reversed(checkpoints)
                        if (c.pos_max <= pos_next or not build.pos_max_check)
                        and (c.pos_min < thold or c.pos_min == 0)), None)
        if restore is not None:
            pos_next = min(pos_next, max(restore.pos_min + 1, restore.pos_max))
            n_past = min(pos_next, len(slot_tokens), restore.n_tokens)
            why = f"checkpoint at {restore.n_tokens} restored"
        else:
            pos_next = n_past = 0
            why = "no usable checkpoint: the whole prompt is processed again"
    kept = tuple(c for c in checkpoints if c.pos_max <= pos_next)  # :3617-3628
    if n_past == len(prompt) and n_past > 0:  # [TAG_PROMPT_LOGITS] :3633-3637
        n_past -= 1
    return Reuse(n_past, restore, kept, why)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
