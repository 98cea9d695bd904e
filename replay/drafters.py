"""The drafters llama-server can use, reimplemented (common/speculative.cpp, common/ngram-*.cpp, b11434).

Each drafter gets, per step, `inp` (every token in the target's KV: prompt and
accepted generated tokens, without the last sampled one), `id_last` (the last
sampled token) and `n_max` (the server's cap for this step), and returns the
draft (possibly empty). `begin(prompt)` runs once per request and `accept(n)`
after a step this drafter drafted for.

draft-simple needs the draft model; it lives in trace.py next to the decode
schedule it must mirror. The n-gram drafters are pure and live here.
"""
from __future__ import annotations

from typing import Sequence

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
