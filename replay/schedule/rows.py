"""Which decode computed each generated token's values on the server: a one-token decode, or a row of
a batch of two or more (pure).

A speculating llama-server scores a token in one of two ways (server-context.cpp, the speculative
path): a step with a draft decodes [last token, draft...] as one verify batch, and every token it emits
from that batch is sent with the placeholder (prob 1.0, no alternatives); a step without a draft decodes
the last token alone and sends the token it samples with its real values. The first generated token
comes from the prompt's last batch (schedule/prompt.py replays those). So the transcript itself says,
token by token, where its values were computed: a real entry after the first came from a one-token
decode, a placeholder (or a streamed token without an entry) from a verify batch.

That matters past 256 positions: ggml-cpu computes a one-token decode over 512 KV cells or more with
one chunk of the KV per thread (ops.cpp:9489-9492), a batch row without chunks; the row a token's
value is read from and every KV row written there differ by up to 0.4 nats after a long prompt
(docs/numerics.md). The replay decodes each token alone and gives it the server's threads where the
server decoded it alone and one thread (a single chunk: the batch row, bit for bit) where it batched.
"""
from __future__ import annotations

from typing import Callable, Sequence

from replay.transcripts.entries import is_placeholder
from replay.transcripts.plan import Gap, Known, PlanItem

ALONE = "alone"  # a one-token decode on the server: the replay uses the server's -t
BATCHED = "batched"  # a row of a verify batch: the replay uses one thread (the batch row, bit for bit)
UNKNOWN = None  # the transcript does not say (no entry): decoded alone, as an unspeculating server does

SPECULATIVE_GAP = "speculative token"  # how plan.py names a streamed token that came without an entry


def scored_by(plan: Sequence[PlanItem], entry_of: Callable[[PlanItem], dict | None],
              values_of: Callable[[dict], tuple[float, list]], n_probs: int) -> list[str | None]:
    """For each plan item, the decode that computed the values of the token(s) it holds: ALONE for a
    real entry, BATCHED for a placeholder or a streamed speculative token, UNKNOWN otherwise.
    `entry_of` gives an item's server entry (None: none), `values_of` an entry's (logprob, top).

    >>> from replay.transcripts.plan import EntryPlace
    >>> items = [Known(1, EntryPlace(entry=0)), Known(2, EntryPlace(entry=1)), Known(3, EntryPlace(entry=None)),
    ...          Gap(b"x", "streamed without probabilities (speculative token)", EntryPlace())]
    >>> sent = {0: (-0.5, [(1, -0.5)]), 1: (0.0, [])}
    >>> scored_by(items, lambda i: i.place.entry, lambda e: sent[e], 1)
    ['alone', 'batched', None, 'batched']
    """
    out: list[str | None] = []
    for item in plan:
        if isinstance(item, Gap) and item.place.entry is None:
            out.append(BATCHED if SPECULATIVE_GAP in item.reason else UNKNOWN)
            continue
        entry = entry_of(item)
        if entry is None:
            out.append(UNKNOWN)
            continue
        lp, top = values_of(entry)
        out.append(BATCHED if is_placeholder(lp, top, n_probs) else ALONE)
    return out


def threads_for(scored: str | None, server_threads: int) -> int:
    """The threads a one-token replay decode takes for a row the server computed as `scored` says.

    >>> threads_for(ALONE, 8), threads_for(BATCHED, 8), threads_for(UNKNOWN, 8)
    (8, 1, 8)
    """
    return 1 if scored == BATCHED else server_threads


def split_kv(pos: int, pad: int = 256) -> bool:
    """Whether a one-token decode writing KV position `pos` (the slot's cells 0..pos, contiguous) sees
    512 cells or more: libllama pads the KV view to 256 (src/llama-kv-cache.cpp get_n_kv), and
    ggml-cpu splits the KV sum from 512 on (ops.cpp:9489). Below it the thread count changes nothing.

    >>> split_kv(255), split_kv(256)
    (False, True)
    """
    return -(-(pos + 1) // pad) * pad >= 512


FA_TILE_ROWS = 64  # ggml-cpu/common.h:9 GGML_FA_TILE_Q


def tiled_verify(longest_draft: int, flash_attn: str, type_k: str, type_v: str, n_ubatch: int = 512) -> bool:
    """Whether a verify batch (the last token and its draft) can reach ggml with FA_TILE_ROWS rows or more
    (a ubatch of -ub rows at most) with an f16/f32 KV cache under flash attention: ggml-cpu then computes
    its attention tile by tile (ggml_compute_forward_flash_attn_ext_tiled, ops.cpp:9545-9566), whose rows
    no one-row decode gives. `longest_draft` is the server's common_speculative_n_max
    (settings/config.py longest_draft).

    >>> tiled_verify(64, "auto", "f16", "f16"), tiled_verify(62, "auto", "f16", "f16")   # ngram-mod's 64; 62 + 1
    (True, False)
    >>> tiled_verify(64, "off", "f16", "f16"), tiled_verify(64, "on", "q8_0", "q8_0")    # not the tiled path
    (False, False)
    >>> tiled_verify(64, "auto", "f16", "f16", n_ubatch=32)                              # cut into 32-row ubatches
    False
    """
    return (min(longest_draft + 1, n_ubatch) >= FA_TILE_ROWS and flash_attn != "off" and type_k == type_v
            and type_k in ("f16", "f32"))


def row_counts(kinds: Sequence[str | None], n_prompt: int) -> dict[str, int]:
    """How a record's generated tokens were scored (kinds[k]: token k's, from scored_by): by the prompt's
    last batch (token 0), by one-token decodes, by verify-batch rows, or unknown; and `alone_split`, the
    one-token decodes over 512 KV cells or more, whose values the server's -t changes (the evidence of
    its thread count; row k - 1, at position n_prompt + k - 1, scores token k).

    >>> row_counts([ALONE, BATCHED, ALONE, ALONE], 254)
    {'prompt': 1, 'alone': 2, 'batched': 1, 'unknown': 0, 'alone_split': 1}
    """
    out = {"prompt": min(len(kinds), 1), "alone": 0, "batched": 0, "unknown": 0, "alone_split": 0}
    for k, kind in enumerate(kinds[1:], start=1):
        out["alone" if kind == ALONE else "batched" if kind == BATCHED else "unknown"] += 1
        if kind == ALONE and split_kv(n_prompt + k - 1):
            out["alone_split"] += 1
    return out
