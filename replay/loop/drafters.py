"""The drafters llama-server can use, reimplemented (common/speculative.cpp, common/ngram-*.cpp, b11434),
and the table that builds them from the server's flags (`DRAFTERS`, `make_drafters`).

Each drafter gets, per step, `inp` (every token in the target's KV: prompt and
accepted generated tokens, without the last sampled one), `id_last` (the last
sampled token) and `n_max` (the server's cap for this step), and returns the
draft (possibly empty). `begin(prompt)` runs once per request and `accept(n)`
after a step this drafter drafted for.

draft-simple needs the draft model; it lives in draft_model.py next to the decode
schedule it must mirror. The n-gram drafters are pure and live here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from replay.errors import TranscriptError
from replay.loop.replayable import PRIORITY
from replay.loop.state import SlotState
from replay.numerics.stdmap import StdIntMap


class Drafter(Protocol):
    name: str

    def begin(self, prompt: Sequence[int]) -> None: ...

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]: ...

    def accept(self, n_accepted: int) -> None: ...

EMPTY = -1
MASK64 = (1 << 64) - 1


class NgramSimple:
    """ngram-simple (common/ngram-map.cpp:49-112): copy what followed the last earlier
    occurrence of the current n-gram. Stateless. Defaults --spec-ngram-simple-size-n 12, -size-m 48."""

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.n, self.m = size_n, size_m

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]:
        n, m, L = self.n, self.m, len(inp)
        if L <= n + m + 1:
            return []
        pattern = list(inp[L - n + 1:L]) + [id_last]
        match = 0
        for j in range(L - n - 1, 0, -1):  # j = 0 is never checked (:85)
            if list(inp[j:j + n]) == pattern:
                match = j
                break
        if match == 0:
            return []
        copy = min(m, L - (match + n))
        if copy < n:
            return []
        return list(inp[match + n:match + n + copy])

    def accept(self, n_accepted: int) -> None:
        pass


class NgramMod:
    """ngram-mod (common/speculative.cpp:1930-2103, common/ngram-mod.cpp): a 4Mi-entry hash
    table from n_match-grams to the next token, shared by all slots for the server's life.
    Defaults --spec-ngram-mod-n-match 24, -n-max 64, -n-min 48."""

    name = "ngram-mod"
    SIZE = 4 * 1024 * 1024

    def __init__(self, n_match: int = 24, n_max: int = 64, n_min: int = 48):
        self.n, self.n_max, self.n_min = n_match, n_max, n_min
        self.entries: dict[int, int] = {}  # sparse view of the table; absent = EMPTY
        self.i_last = 0
        self.n_draft_last = 0
        self.n_low = 0

    def _idx(self, toks: Sequence[int]) -> int:
        r = 0
        for t in toks[:self.n]:
            r = (r * 6364136223846793005 + (t & MASK64)) & MASK64
        return r % self.SIZE

    def _add(self, toks: Sequence[int]) -> None:
        self.entries[self._idx(toks)] = toks[self.n]

    def reset(self) -> None:
        self.entries.clear()

    def begin(self, prompt: Sequence[int]) -> None:
        self.i_last = 0
        self.n_draft_last = 0
        n = self.n
        if len(prompt) < n:
            return
        for i in range(len(prompt) - n):
            self._add(prompt[i:i + n + 1])
        self.i_last = len(prompt) - n
        if len(self.entries) / self.SIZE > 0.25:
            self.reset()

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]:
        self.n_draft_last = 0
        n, L = self.n, len(inp)
        if L < n:
            return []
        if self.i_last + 32 < L:
            for i in range(self.i_last, L - n):
                self._add(inp[i:i + n + 1])
            self.i_last = L - n
        window = list(inp[L - n + 1:L]) + [id_last]
        out: list[int] = []
        for i in range(self.n_max):
            tok = self.entries.get(self._idx(window[i:i + n]), EMPTY)
            if tok == EMPTY:
                if i < self.n_min:
                    return []
                break
            window.append(tok)
            out.append(tok)
        self.n_draft_last = len(out)
        return out

    def accept(self, n_accepted: int) -> None:
        if self.n_draft_last > 0:
            if n_accepted / self.n_draft_last < 0.25:
                self.n_low += 1
                if self.n_low >= 5:
                    self.reset()
                    self.n_low = 0
                    self.i_last = 0
            else:
                self.n_low = 0


# --- ngram-map-k / ngram-map-k4v ------------------------------------------------

NGRAM_MAX_VALUES = 4  # common/ngram-map.h:39
NGRAM_HASH_MAP_SIZE = 262144  # common/ngram-map.h:42
NGRAM_MAX_VALUE_COUNT = 16380  # common/ngram-map.cpp:118
LCG_FACTOR = 2654435761  # common/ngram-map.cpp:11


def _map_hash(tokens: Sequence[int], start: int, n: int) -> int:
    """common_ngram_map_hash: uint32 h = h * 2654435761 + t (common/ngram-map.cpp:14-20)."""
    h = 0
    for i in range(n):
        h = (h * LCG_FACTOR + tokens[start + i]) & 0xFFFFFFFF
    return h


class _Value:
    __slots__ = ("value_idx", "value_num", "n_accepted")

    def __init__(self, m: int):
        self.value_idx, self.value_num, self.n_accepted = 0, 0, m

    def copy_from(self, o: "_Value") -> None:
        self.value_idx, self.value_num, self.n_accepted = o.value_idx, o.value_num, o.n_accepted


class _Key:
    __slots__ = ("key_idx", "stat_idx", "key_num", "values")

    def __init__(self, key_idx: int, m: int):
        self.key_idx, self.stat_idx, self.key_num = key_idx, 0, 0
        self.values = [_Value(m) for _ in range(NGRAM_MAX_VALUES)]


class NgramMap:
    """ngram-map-k (key_only) and ngram-map-k4v (common/ngram-map.cpp:121-536, speculative.cpp:1876-1928).

    Per-slot state that persists across requests: the key statistics `keys`, the
    hash map `key_map` (0 = empty) and the bookkeeping indices. Reproduced
    literally, including k4v drafting the continuation of the *matched*
    occurrence rather than of the most frequent stored value (:503-507).
    Defaults --spec-ngram-map-k{,4v}-size-n 12, -size-m 48, -min-hits 1.
    """

    def __init__(self, key_only: bool, size_n: int = 12, size_m: int = 48, min_hits: int = 1):
        self.name = "ngram-map-k" if key_only else "ngram-map-k4v"
        self.key_only, self.n, self.m, self.min_hits = key_only, size_n, size_m, min_hits
        self.keys: list[_Key] = []
        self.key_map: dict[int, int] = {}  # sparse key_map; absent = 0
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.last_draft_created = False
        self.last_draft_key_idx = 0
        self.last_draft_value_idx = 0
        self.old_cleanup = False  # eras C-D (builds/loop_shapes.py map_cleanup "old"): set by make_drafters

    def begin(self, tokens: Sequence[int]) -> None:
        """common_ngram_map_begin: forget keys and values from where the new prompt may differ. From b9897
        (common/ngram-map.cpp:121) that is min(size_last_begin, B-n-m) and index 0 marks an empty entry;
        before it, everything at or after size_last_begin, with no such guard."""
        n, m = self.n, self.m
        size_begin = len(tokens)
        cleanup = self.size_last_begin
        old = self.old_cleanup
        if cleanup > size_begin and not old:
            cleanup = size_begin - n - m if size_begin > n + m else 0
        # upstream's key_map is a vector of 2^18 entries, never empty (common/ngram-map.h:76), so this
        # runs whenever the prompt is shorter than the last checked size (common/ngram-map.cpp:139-169)
        if size_begin < self.idx_last_check:
            self.key_map = {h: k for h, k in self.key_map.items() if not ((old or k != 0) and k >= cleanup)}
            self.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
        if size_begin < self.idx_last_check and self.keys:
            for i in range(len(self.keys) - 1, -1, -1):
                key = self.keys[i]
                if key.key_idx >= cleanup:
                    del self.keys[i]
                    continue
                if self.key_only:
                    continue
                for j in range(NGRAM_MAX_VALUES - 1, -1, -1):
                    v = key.values[j]
                    if (old or v.value_idx != 0) and v.value_idx >= cleanup:
                        for k in range(j, NGRAM_MAX_VALUES - 1):
                            key.values[k].copy_from(key.values[k + 1])
                        key.values[-1].value_idx = 0
                        key.values[-1].value_num = 0
                if key.values[0].value_idx == 0:
                    del self.keys[i]
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin

    def _matches(self, inp: Sequence[int], j: int, key: Sequence[int]) -> bool:
        return all(inp[j + k] == key[k] for k in range(self.n))

    def draft(self, inp: Sequence[int], sampled: int, n_max: int) -> list[int]:
        """common_ngram_map_draft (common/ngram-map.cpp:221-516): the earlier occurrence of the last n
        tokens (the sampled one last), its key's statistics updated, and for k4v the continuation only when
        one value dominates the key's others."""
        self.last_draft_created = False
        self.last_draft_key_idx = self.last_draft_value_idx = 0
        n, m, cur = self.n, self.m, len(inp)
        if cur < 2 * n + m:
            return []
        self.idx_last_check = cur
        key = list(inp[cur - n + 1:cur]) + [sampled]
        match = self._match(inp, key)
        self._add_hashes(inp)
        if match == 0:
            return []
        offset = next((i for i, k in enumerate(self.keys) if self._matches(inp, k.key_idx, key)), len(self.keys))
        if offset == len(self.keys):
            self.keys.append(_Key(match, m))
        cur_key = self.keys[offset]
        cur_key.key_num = min(cur_key.key_num + 1, NGRAM_MAX_VALUE_COUNT)
        if self.key_only:
            n_draft = min(m, cur_key.values[0].n_accepted)
            self.last_draft_created, self.last_draft_key_idx, self.last_draft_value_idx = True, offset, 0
            return list(inp[match + n:match + n + n_draft])
        if cur_key.key_num < self.min_hits:
            return []
        self._count_values(inp, key, cur_key, match)
        slot_max = _dominant_value(cur_key)
        if slot_max is None:
            return []
        n_draft = min(m, cur_key.values[slot_max].n_accepted)
        self.last_draft_created, self.last_draft_key_idx, self.last_draft_value_idx = True, offset, slot_max
        return list(inp[match + n:match + n + n_draft])  # the matched occurrence's continuation (:503-507)

    def _match(self, inp: Sequence[int], key: Sequence[int]) -> int:
        """The key's earlier occurrence (0: none): its hash bucket's, else the newest one in the prompt
        before size_last_begin, else the newest one after it, before the last n + m tokens."""
        n, m, cur = self.n, self.m, len(inp)
        idx_key = self.key_map.get(_map_hash(key, 0, n) % NGRAM_HASH_MAP_SIZE, 0)
        if idx_key != 0 and idx_key < cur - n - m - 1 and self._matches(inp, idx_key, key):
            return idx_key
        if self.size_last_begin > n + m + 1:
            for j in range(self.size_last_begin - n - m - 1, self.key_map_last_idx, -1):
                if self._matches(inp, j, key):
                    return j
        j = cur - n - m - 1
        while j > self.size_last_begin and j > self.key_map_last_idx:
            if self._matches(inp, j, key):
                return j
            j -= 1
        return 0

    def _add_hashes(self, inp: Sequence[int]) -> None:
        """The hashes of the n-grams not yet in the map, in the same order (only into empty buckets)."""
        n, m, cur = self.n, self.m, len(inp)
        if self.size_last_begin > n + m + 1:
            for j in range(self.size_last_begin - n - m - 1, self.key_map_last_idx, -1):
                self.key_map.setdefault(_map_hash(inp, j, n) % NGRAM_HASH_MAP_SIZE, j)
        j = cur - n - m - 1
        while j > self.size_last_begin and j > self.key_map_last_idx:
            self.key_map.setdefault(_map_hash(inp, j, n) % NGRAM_HASH_MAP_SIZE, j)
            j -= 1
        self.key_map_last_idx = max((cur - n - m - 1) & 0xFFFFFFFF, self.key_map_last_idx)

    def _count_values(self, inp: Sequence[int], key: Sequence[int], cur_key: "_Key", match: int) -> None:
        """k4v: every occurrence of the key since its last count adds one to the value (the m tokens after
        it) it continues with, a new value taking the first empty slot."""
        n, m = self.n, self.m
        for i in range(cur_key.stat_idx, match + 1):
            if not self._matches(inp, i, key):
                continue
            begin = i + n
            idx_value = -1
            for v in range(NGRAM_MAX_VALUES):
                val = cur_key.values[v]
                if val.value_idx == 0:
                    val.value_idx, val.value_num, val.n_accepted = begin, 0, m
                    idx_value = v
                    break
                if all(inp[begin + t] == inp[val.value_idx + t] for t in range(m)):
                    idx_value = v
                    break
            if idx_value >= 0:
                val = cur_key.values[idx_value]
                val.value_num = min(val.value_num + 1, NGRAM_MAX_VALUE_COUNT)
        cur_key.stat_idx = match

    def accept(self, n_accepted: int) -> None:
        if not self.last_draft_created:
            return
        self.keys[self.last_draft_key_idx].values[self.last_draft_value_idx].n_accepted = n_accepted


def _dominant_value(key: "_Key") -> int | None:
    """The slot of a key's most frequent value, when it occurs at least twice as often as all its others
    together (or they never occur), else None: k4v drafts only then (common/ngram-map.cpp:461-498)."""
    max_occur, slot_max = 0, 0
    for v in range(NGRAM_MAX_VALUES):
        if key.values[v].value_num > max_occur:
            max_occur, slot_max = key.values[v].value_num, v
    sum_occur = sum(key.values[v].value_num for v in range(NGRAM_MAX_VALUES) if v != slot_max)
    return None if sum_occur > 0 and max_occur < 2 * sum_occur else slot_max


# --- ngram-cache ----------------------------------------------------------------

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2  # common/ngram-cache.h
LAX_MIN_SAMPLE, LAX_MIN_PERCENT = (2, 2, 1, 1), (66, 50, 50, 50)  # common/ngram-cache.cpp:60-63
STRICT_MIN_SAMPLE, STRICT_MIN_PERCENT = (4, 3, 2, 2), (75, 66, 66, 66)


class NgramCache:
    """ngram-cache (common/speculative.cpp:2105-2281, common/ngram-cache.cpp): n-gram (1..4) ->
    counts of the next token, per slot, kept across requests; drafts up to 8 tokens.

    Part maps keep libstdc++'s unordered_map iteration order (numerics/stdmap.py), because the
    most frequent continuation is the first one met with the highest count. Without
    -lcs/-lcd the static and dynamic caches are empty, so only the context cache drafts.
    """

    name = "ngram-cache"
    N_DRAFT = 8  # speculative.cpp:2272, hard-coded

    def __init__(self) -> None:
        self.context: dict[tuple[int, ...], StdIntMap] = {}
        self.cache_size = 0

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def _update(self, toks: Sequence[int]) -> None:
        """common_ngram_cache_update with nnew = len(toks): n-grams fully inside `toks`."""
        for size in range(NGRAM_MIN, NGRAM_MAX + 1):
            for i in range(size, len(toks)):
                key = tuple(toks[i - size:i])
                part = self.context.get(key)
                if part is None:
                    part = self.context[key] = StdIntMap()
                part.increment(toks[i])

    def _try(self, ngrams: list[tuple[int, ...]], min_sample, min_percent) -> int | None:
        for i in range(len(ngrams) - 1, -1, -1):
            part = self.context.get(ngrams[i])
            if part is None:
                continue
            max_count, total, best = 0, 0, None
            for tok, count in part.items():
                if count * 1 > max_count * 1:  # count_static is 1 without a static cache
                    best, max_count = tok, count
                total += count
            if total < min_sample[i] or 100 * max_count < min_percent[i] * total:
                continue
            return best
        return None

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]:
        if self.cache_size < len(inp) + 1:
            self._update(list(inp[self.cache_size:]) + [id_last])
            self.cache_size = len(inp) + 1
        seq = list(inp) + [id_last]
        if len(seq) < NGRAM_STATIC:
            return []
        draft: list[int] = []
        while len(draft) < self.N_DRAFT:
            full = seq + draft
            ngrams = [tuple(full[len(full) - size:]) for size in range(NGRAM_MIN, NGRAM_MAX + 1)]
            tok = self._try(ngrams, LAX_MIN_SAMPLE, LAX_MIN_PERCENT)
            if tok is None:
                break  # the dynamic and static caches are empty: nothing else can draft
            draft.append(tok)
        return draft

    def accept(self, n_accepted: int) -> None:
        pass


# --- the factory ------------------------------------------------------------------

@dataclass(frozen=True)
class DrafterKind:
    """How a --spec-type's drafter is made from the server's flags, and whether its state outlives a
    request (per slot, or server-wide for ngram-mod: docs/server-loop.md, fact 5)."""

    make: Callable[[Any, Any], Drafter]  # (SpecConfig, DraftModel | None) -> Drafter
    scope: str  # how long its state lives: "request", "slot" or "server" (loop/state.py)

    @property
    def persists(self) -> bool:
        """Is the drafter object itself kept in the slot's state? (draft-mtp's state is kept with the slot's
        memory instead, scope "slot-memory": a drafter is made per request over it.)"""
        return self.scope in ("slot", "server")


def _draft_simple(spec, draft_model) -> Drafter:
    assert draft_model is not None, "draft-simple needs its draft model (checked by replayable.check_replayable)"
    return draft_model.drafter(spec)


def _draft_mtp(spec, source) -> Drafter:
    from replay.loop.draft_mtp import DraftMtp
    if source is None:  # loop.py makes the slot's MTP context before its drafters
        raise TranscriptError("--spec-type draft-mtp needs the target's MTP context, which was not made")
    heads, temp, seed = source
    return DraftMtp(heads, spec, temp, seed)


DRAFTERS: dict[str, DrafterKind] = {
    "ngram-simple": DrafterKind(lambda s, _: NgramSimple(s.ngram_simple_size_n, s.ngram_simple_size_m), "request"),
    "ngram-map-k": DrafterKind(lambda s, _: NgramMap(True, s.ngram_map_k_size_n, s.ngram_map_k_size_m,
                                                     s.ngram_map_k_min_hits), "slot"),
    "ngram-map-k4v": DrafterKind(lambda s, _: NgramMap(False, s.ngram_map_k4v_size_n, s.ngram_map_k4v_size_m,
                                                       s.ngram_map_k4v_min_hits), "slot"),
    "ngram-mod": DrafterKind(lambda s, _: NgramMod(s.ngram_mod_n_match, s.ngram_mod_n_max, s.ngram_mod_n_min),
                             "server"),
    "ngram-cache": DrafterKind(lambda s, _: NgramCache(), "slot"),
    "draft-simple": DrafterKind(_draft_simple, "request"),
    # its carry (pending_h) lives with the slot's memory (loop/draft_mtp.py MtpHeads), so it persists per slot
    "draft-mtp": DrafterKind(_draft_mtp, "slot-memory"),
}
assert set(DRAFTERS) == set(PRIORITY)


def make_drafters(spec, *, draft_model=None, mtp=None, state: SlotState | None = None,
                  map_cleanup: str = "new") -> list[Drafter]:
    """The drafters of `spec.spec_types` in the server's priority order. Drafters whose state outlives
    a request are kept in the slot's `state` (per slot, or server-wide: DrafterKind.scope); pass the
    same state for consecutive requests to one slot. `map_cleanup` is the era's n-gram map cleanup
    rule (builds/loop_shapes.py). `draft_model` is draft-simple's DraftContext, `mtp` draft-mtp's
    MtpHeads."""
    state = state if state is not None else SlotState()
    out = []
    for t in PRIORITY:
        if t not in spec.spec_types:
            continue
        kind = DRAFTERS[t]
        if kind.persists:
            out.append(state.drafter(t, kind.scope, lambda kind=kind: _made(kind, spec, draft_model, map_cleanup)))
        else:
            out.append(kind.make(spec, mtp if t == "draft-mtp" else draft_model))
    return out


def _made(kind: DrafterKind, spec, draft_model, map_cleanup: str) -> Drafter:
    d = kind.make(spec, draft_model)
    if hasattr(d, "old_cleanup"):
        d.old_cleanup = map_cleanup == "old"
    return d
