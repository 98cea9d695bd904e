"""Which KV positions a record may keep from the record evaluated before it.

Two reasons to keep a prompt prefix between the records of one file, and one rule that makes
either exact: a KV cell's values depend on the ubatch it was computed in (its row count picks
the CPU matmul kernel, docs/numerics.md), so a kept cell is only right if it was
computed in the same ubatch the server used for that position.

* The server reused its own cache (`cache_prompt`, on by default): the response says how many
  prompt tokens it took from the slot (`timings.cache_n`), and it decoded the rest starting
  there (server-context.cpp:3442-3448 common prefix, 3639-3644 keep_first, 3781-3874 batches
  from n_past). Its values for that record come from that KV state, and a fresh evaluation
  differs from them (0.06 to 0.28 nats on SmolLM2, measured). When the previous record of the
  file is the request that left those cells (same tokens, computed the way we computed them),
  keeping exactly `cache_n` positions rebuilds the server's state bit for bit.
* The server evaluated the prompt from scratch: keeping a shared prefix is only a speed-up, and
  it is exact only up to a position from which the rest of the prompt runs through the same
  ubatches as a fresh evaluation (`reuse_points`): whole n_ubatch blocks.

A target that checkpoints (sliding-window attention, recurrent or hybrid memory:
schedule/prompt.py) cannot simply keep a prefix: the server restores one of the slot's context
checkpoints first, or processes the whole prompt again (schedule/prompt.py plan_reuse). For those,
`plan_checkpointed` replays the server's decision on the slot's checkpoints as this replay took
them, and checks it against the response's cache_n; the speed-up is not used (a kept prefix would
leave other sliding-window cells than a fresh evaluation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from replay.schedule.prompt import plan_reuse


@dataclass(frozen=True)
class Prefix:
    keep: int  # KV positions kept from the previous record
    how: str  # "fresh", "shared prefix" (speed-up), "server cache" (mirrors the server) or "server cache (rebuilt)"
    note: str | None = None  # why the server's own cache state could not be taken from the previous record
    restore: object | None = None  # the slot checkpoint restored first (checkpointing targets)
    checkpoints: tuple | None = None  # the slot's checkpoints after the decision (None: unchanged)

    @property
    def rebuild(self) -> bool:
        """The kept cells must be computed afresh (the context may hold the same tokens, computed
        another way)."""
        return self.how == "server cache (rebuilt)"


FRESH = Prefix(0, "fresh")


def reuse_points(n_prompt: int, n_batch: int, n_ubatch: int) -> range:
    """Positions from which decoding the rest of the prompt in batches of n_batch runs exactly the
    ubatches a fresh evaluation runs there. The server sends the prompt in batches of n_batch from
    position 0 and llama_decode splits each into consecutive ubatches of n_ubatch
    (llama_batch_allocr::split_simple, src/llama-batch.cpp): when n_batch is a multiple of n_ubatch
    every ubatch start qualifies, otherwise only batch starts."""
    return range(0, n_prompt, n_ubatch if n_batch % n_ubatch == 0 else n_batch)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_prefix(kv_tokens: Sequence[int], exact_upto: int, prompt: Sequence[int], server_cached: int | None,
                n_batch: int, n_ubatch: int, *, reuse: bool = True) -> Prefix:
    """Decide how many KV positions to keep for `prompt`.

    `kv_tokens` are the tokens in the context by position, the first `exact_upto` of them computed
    as the server computed them for the previous record (its prompt, and its generated tokens
    when the server decoded them one at a time). `server_cached` is the response's cache_n."""
    held = common_prefix(kv_tokens, prompt)
    shared = min(held, exact_upto)
    if server_cached and server_cached < len(prompt):
        if server_cached <= shared:
            return Prefix(server_cached, "server cache")
        if server_cached <= held:  # the previous record left them, but not all computed as the server did
            note = (f"the server took {server_cached} prompt tokens from its cache, {server_cached - exact_upto} of "
                    "them tokens the previous record generated that this replay did not compute as the server did "
                    "(tokens without entries, or values it labelled approximate); they were evaluated on their own "
                    "to rebuild it, which is exact only if the server decoded them one at a time")
        else:
            note = (f"the server took {server_cached} prompt tokens from its cache, left by a request that is not "
                    "the previous record of this file; they were evaluated on their own to rebuild it, which is "
                    "exact only if the earlier prompt put them in ubatches of the same kind")
        return Prefix(server_cached, "server cache (rebuilt)", note)
    if not reuse:
        return Prefix(0, "fresh")
    limit = min(shared, len(prompt) - 1)  # the last prompt token's logits must come from a decode
    keep = max((p for p in reuse_points(len(prompt), n_batch, n_ubatch) if p <= limit), default=0)
    return Prefix(keep, "shared prefix" if keep else "fresh")


def plan_checkpointed(slot_tokens: Sequence[int], exact_upto: int, prompt: Sequence[int], server_cached: int | None,
                      checkpoints: Sequence, *, pos_min: int, n_swa: int) -> Prefix:
    """How much of the slot's memory to keep for `prompt` on a target that checkpoints.

    The server's own decision (plan_reuse) on this replay's slot state must give its cache_n. Where it
    does not, the server's memory differed from ours at the request's start (its last request's
    tokens were decoded in verify batches, which leave other sliding-window cells, so another
    llama_memory_seq_pos_min): the checkpoint whose restore gives cache_n is the one the server took.
    Without one, the kept cells cannot be rebuilt as the server had them ("server cache (rebuilt)").

        >>> from replay.schedule.prompt import Mark
        >>> m = [Mark(305, pos_min=0, pos_max=304), Mark(817, pos_min=305, pos_max=816)]
        >>> p = plan_checkpointed(list(range(850)), 821, list(range(900)), 816, m, pos_min=338, n_swa=512)
        >>> p.keep, p.how, p.restore.n_tokens
        (816, 'server cache', 817)
        >>> plan_checkpointed(list(range(850)), 821, list(range(900)), 0, m, pos_min=338, n_swa=512).checkpoints
        ()
    """
    if not server_cached:
        fresh = plan_reuse(prompt, slot_tokens, checkpoints, cache_prompt=False, pos_min=pos_min, n_swa=n_swa)
        return Prefix(0, "fresh", checkpoints=fresh.checkpoints)
    r = plan_reuse(prompt, slot_tokens, checkpoints, cache_prompt=True, pos_min=pos_min, n_swa=n_swa)
    if r.n_past != server_cached:
        # the checkpoint the server must have restored (its pos_min passed the threshold, ours did not, or
        # the other way round): the newest one that yields its cache_n
        shared = common_prefix(slot_tokens, prompt)
        for c in reversed(checkpoints):
            pos_next = min(shared, max(c.pos_min + 1, c.pos_max))
            n_past = min(pos_next, len(slot_tokens), c.n_tokens)
            n_past -= n_past == len(prompt)
            if c.pos_max <= shared and n_past == server_cached:
                r = type(r)(n_past, c, tuple(k for k in checkpoints if k.pos_max <= pos_next),
                            f"checkpoint at {c.n_tokens} restored")
                break
    if r.n_past == server_cached and server_cached <= exact_upto:
        return Prefix(server_cached, "server cache", restore=r.restore, checkpoints=r.checkpoints)
    if r.n_past == server_cached:
        note = (f"the server kept {server_cached} prompt tokens from its cache, {server_cached - exact_upto} of them "
                "tokens the previous record generated, which that server decoded in speculative verify batches; "
                "recover decodes a reply one token at a time, so those cells were evaluated on their own: not "
                "the server's state (trace reproduces verify batches)")
    else:
        note = (f"the server took {server_cached} prompt tokens from its cache, left by a request that is not the "
                "previous record of this file (or not as this replay computed it); they were evaluated on their "
                "own to rebuild it, which for a sliding-window or recurrent model is not the server's state")
    return Prefix(server_cached, "server cache (rebuilt)", note, checkpoints=())
