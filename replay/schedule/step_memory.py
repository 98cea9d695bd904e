"""A slot's memory through one speculative step: the checkpoint before drafting, the trim after
verifying, the restore after a partial acceptance on a memory that cannot drop a suffix.

The server's generation phase keeps the slot's contexts (SlotMemory: the target, and the draft model's
or the MTP context) in step with what it emitted (server-context.cpp:3205-3307, 4272-4348):

    before drafting   on a draft context that cannot drop a suffix, its state is saved    :3262-3270
    after drafting    the draft context's drafting KV goes (back to that state first)     :3271-3279
                      on a target that cannot drop the draft's length, its state is saved :3281-3299
    after verifying   kept all it needs to: positions past the accepted drafts go          :4342-4348
                      else (a partial acceptance it cannot drop): both back to the saved
                      states, positions from the step's first on go, the step is replayed :4272-4311

Whether a rollback of n tokens needs the saved state is `needs_checkpoint`, pure.
"""
from __future__ import annotations

from dataclasses import dataclass

from replay.schedule.memory import SlotMemory


def needs_checkpoint(n: int, *, drops_suffix: bool, n_rs_seq: int) -> bool:
    """Whether taking back the last `n` tokens of the target needs the state saved before the step: any on
    a memory that cannot drop a suffix (FULL), more than n_rs_seq on one with recurrent-state snapshots
    (RS), none otherwise (PART) (server-context.cpp:3281-3284 with n the draft's length when it is
    taken, 4276-4278 with n the rollback).

    >>> needs_checkpoint(3, drops_suffix=True, n_rs_seq=0), needs_checkpoint(1, drops_suffix=False, n_rs_seq=0)
    (False, True)
    >>> needs_checkpoint(2, drops_suffix=True, n_rs_seq=2), needs_checkpoint(3, drops_suffix=True, n_rs_seq=2)
    (False, True)
    >>> needs_checkpoint(0, drops_suffix=False, n_rs_seq=0)
    False
    """
    if n <= 0:
        return False
    return not drops_suffix or (n_rs_seq > 0 and n > n_rs_seq)


@dataclass(frozen=True)
class SpecCheckpoint:
    """The slot's spec_ckpt (server-context.cpp:3205-3304): the contexts' states a step saves before
    drafting, to go back to after a partial acceptance; None for a context that can drop a suffix."""

    target: bytes | None
    draft: bytes | None


NO_CHECKPOINT = SpecCheckpoint(None, None)


class StepMemory:
    """The memory operations of speculative steps on one slot's contexts (module docstring)."""

    def __init__(self, memory: SlotMemory):
        self.ctx, self.draft = memory.ctx, memory.draft
        self.target_drops, self.n_rs_seq = memory.target_removes, memory.ctx.n_rs_seq
        self.draft_drops = self.draft is None or memory.draft_removes
        self.checkpoint = NO_CHECKPOINT  # taken before the latest drafted step

    def rolls_back(self, n: int) -> bool:
        """needs_checkpoint for this slot's target."""
        return needs_checkpoint(n, drops_suffix=self.target_drops, n_rs_seq=self.n_rs_seq)

    def before_drafting(self) -> bytes | None:
        """The draft context's state, saved when it cannot drop a suffix (:3262-3270)."""
        return self.draft.save_partial() if self.draft is not None and not self.draft_drops else None

    def after_drafting(self, pos0: int, n_draft: int, draft_state: bytes | None) -> None:
        """Drafting's KV leaves the draft context (back to `draft_state` first, if saved); the target's state
        is saved when a rollback of the whole draft would need it (:3271-3299)."""
        if self.draft is not None:
            if draft_state is not None:
                self.draft.load_partial(draft_state)
            self.draft.seq_rm(0, pos0, -1)
        self.checkpoint = SpecCheckpoint(self.ctx.save_partial() if self.rolls_back(n_draft) else None, draft_state)

    @property
    def checkpointed(self) -> bool:
        """Whether the latest drafted step saved the target's state."""
        return self.checkpoint.target is not None

    def restore(self, pos0: int) -> None:
        """Both contexts back to the checkpoint, and positions from the step's first (`pos0`) on gone
        (:4282-4300)."""
        self.ctx.load_partial(self.checkpoint.target)
        self.ctx.seq_rm(0, pos0, -1)
        if self.draft is not None:
            if self.checkpoint.draft is not None:
                self.draft.load_partial(self.checkpoint.draft)
            self.draft.seq_rm(0, pos0, -1)

    def trim(self, keep: int) -> None:
        """Positions from `keep` on (rejected drafts) leave both contexts (:4342-4348)."""
        self.ctx.seq_rm(0, keep, -1)
        if self.draft is not None:
            self.draft.seq_rm(0, keep, -1)
