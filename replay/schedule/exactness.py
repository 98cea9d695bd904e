"""Where recover's one-token schedule computes a record's values as the server computed them, and where
not (pure): the first token whose values come from decodes the transcript does not show.

recover evaluates a record's tokens one decode each (evaluation/walk.py), with the threads and the rows
the transcript says the server used (rows.py). Some servers' values come from batches a one-token
decode does not reproduce: a checkpointing target's rewrite batches, a verify batch with flash attention
off or of 64 rows or more, the state a continued record starts from, and any verify row of a record that
carries no entry to say which tokens a verify batch scored. From that token on, recover replays the
server's loop (commands/looped.py) or calls the values approximate (comparison/values.py
APPROXIMATE_DRIFT).
"""
from __future__ import annotations

from typing import Sequence

from replay.schedule.rows import ALONE, BATCHED, UNKNOWN, split_kv  # noqa: F401  (ALONE: the doctests')


def approximate_from(kinds: Sequence[str | None], n_prompt: int, *, checkpoints: bool,
                     flash_attn_off: bool, tiled: bool = False, continued: bool = False,
                     speculative: bool = False) -> tuple[int | None, str]:
    """The first token whose values this replay cannot compute in the decodes the server computed them in,
    and why (comparison/bounds.py APPROXIMATE_DRIFT), or (None, ""). `kinds[k]` is token k's (schedule/rows.py).

    A checkpointing target past 256 positions: the server decoded accepted tokens again after restoring a
    checkpoint, in batches the transcript does not show. Flash attention off, from the first token a verify
    batch scored: the batch's attention matmuls take another path for several rows than for one. The same
    where a verify batch can have 64 rows or more (`tiled`: schedule/rows.py tiled_verify): its attention is
    computed tile by tile, and how many rows a batch had (rejected drafts included) the transcript does not show.
    A checkpointing target whose next record continues this one's reply from the server's cache
    (`continued`), from the first token a verify batch scored: that record starts from the state and the
    checkpoints the server's verify steps left, which one-row decodes do not rebuild. A speculating server's
    record that carries no entry to say how a token was scored (UNKNOWN: it asked for no probabilities),
    from the first such token past 256 positions (rows.py split_kv): there a verify batch's row and a
    one-token decode compute apart, and which of the two scored it the transcript does not show.

    >>> approximate_from([None, ALONE, BATCHED], 100, checkpoints=False, flash_attn_off=False, tiled=True)[0]
    2
    >>> approximate_from([None, ALONE, BATCHED], 100, checkpoints=True, flash_attn_off=False, continued=True)[0]
    2

    >>> approximate_from([None, ALONE, BATCHED, BATCHED], 300, checkpoints=False, flash_attn_off=True)[0]
    2
    >>> approximate_from([None, ALONE, BATCHED], 300, checkpoints=True, flash_attn_off=False)[0]   # past 256
    1
    >>> approximate_from([None, ALONE, BATCHED], 100, checkpoints=True, flash_attn_off=False)[0]  # a rewrite batch
    2
    >>> approximate_from([None, ALONE, ALONE], 100, checkpoints=True, flash_attn_off=False)
    (None, '')
    >>> approximate_from([None, ALONE, ALONE], 300, checkpoints=True, flash_attn_off=True)
    (None, '')
    >>> approximate_from([None, None, None], 300, checkpoints=False, flash_attn_off=False, speculative=True)[0]
    1
    >>> approximate_from([None, None, None], 100, checkpoints=False, flash_attn_off=False, speculative=True)
    (None, '')
    """
    k, why = _from_batched(kinds, n_prompt, checkpoints=checkpoints, flash_attn_off=flash_attn_off, tiled=tiled,
                           continued=continued)
    if speculative:  # no entry to say how a token was scored: as if any row could have been a verify batch's
        u = next((u for u in range(1, len(kinds)) if kinds[u] is UNKNOWN
                  and (checkpoints or flash_attn_off or split_kv(n_prompt + u - 1))), None)
        if u is not None and (k is None or u < k):
            return u, ("the record carries no probabilities to say which tokens the server scored in verify batches"
                       + (", and this target rewrote accepted tokens' KV from checkpoints" if checkpoints else
                          ", and with flash attention off" if flash_attn_off else ", and past 256 positions") +
                       " a verify batch's row and a one-token decode compute apart")
    return k, why


def _from_batched(kinds: Sequence[str | None], n_prompt: int, *, checkpoints: bool, flash_attn_off: bool,
                  tiled: bool, continued: bool) -> tuple[int | None, str]:
    """approximate_from's rules for the tokens the transcript shows a verify batch scored (BATCHED)."""
    if BATCHED not in kinds[1:]:
        return None, ""
    if checkpoints:
        # past 256 positions the thread split moves any row; below it, the rewrite batch's matmuls still take
        # other kernels than a one-row decode where the weights are repacked (measured: Gemma 3 Q4_K_M on
        # haswell, a 30-token chat prompt, draft-simple: 0.24 nats by token 31 computed one row at a time)
        k = next((k for k in range(1, len(kinds)) if split_kv(n_prompt + k - 1) or kinds[k] == BATCHED), None)
        if k is not None:
            return k, ("this target verifies drafts from checkpoints (its memory cannot drop a suffix), and the "
                       "server rewrote the KV of accepted tokens in batches the transcript does not show")
    if flash_attn_off:
        k = next(k for k in range(1, len(kinds)) if kinds[k] == BATCHED)
        return k, ("with flash attention off (-fa off) a verify batch's attention takes other matmul kernels for "
                   "several rows than a one-row decode does, so its rows and the KV they wrote are not reproduced "
                   "one row at a time")
    if tiled:
        k = next(k for k in range(1, len(kinds)) if kinds[k] == BATCHED)
        return k, ("this server drafts up to 63 tokens or more, and a verify batch of 64 rows or more computes its "
                   "attention tile by tile (ggml-cpu ops.cpp:9545-9566), which one-row decodes do not reproduce")
    if checkpoints and continued:
        k = next(k for k in range(1, len(kinds)) if kinds[k] == BATCHED)
        return k, ("the next record continues this reply from the server's cache, and this target (which "
                   "checkpoints) left it the state and checkpoints of its verify steps, which one-row decodes do not "
                   "rebuild")
    return None, ""
