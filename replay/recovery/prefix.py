"""Which KV positions a record may keep from the record evaluated before it.

Two reasons to keep a prompt prefix between the records of one file, and one rule that makes
either exact: a KV cell's values depend on the ubatch it was computed in (its row count picks
the CPU matmul kernel, shared/reference/NUMERICS.md), so a kept cell is only right if it was
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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Prefix:
    keep: int  # KV positions kept from the previous record
    how: str  # "fresh", "shared prefix" (speed-up), "server cache" (mirrors the server) or "server cache (rebuilt)"
    note: str | None = None  # why the server's own cache state could not be taken from the previous record

    @property
    def rebuild(self) -> bool:
        """The kept cells must be computed afresh (the context may hold the same tokens, computed
        another way)."""
        return self.how == "server cache (rebuilt)"


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
    shared = min(common_prefix(kv_tokens, prompt), exact_upto)
    if server_cached and server_cached < len(prompt):
        if server_cached <= shared:
            return Prefix(server_cached, "server cache")
        note = (f"the server took {server_cached} prompt tokens from its cache, left by a request that is not "
                "the previous record of this file; they were evaluated on their own to rebuild it, which is "
                "exact only if the earlier prompt put them in ubatches of the same kind")
        return Prefix(server_cached, "server cache (rebuilt)", note)
    if not reuse:
        return Prefix(0, "fresh")
    limit = min(shared, len(prompt) - 1)  # the last prompt token's logits must come from a decode
    keep = max((p for p in reuse_points(len(prompt), n_batch, n_ubatch) if p <= limit), default=0)
    return Prefix(keep, "shared prefix" if keep else "fresh")
