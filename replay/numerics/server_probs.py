"""The server's pre-sampling probabilities, bit for bit: what llama-server reports for a token
before sampling (`pre_sampling`), from `get_token_probabilities` reproduced exactly.

`get_token_probabilities` (tools/server/server-common.cpp:1591-1641) builds the full vocabulary
in id order, `std::partial_sort`s the first `n_top` by logit, then computes `expf(l - max)` for
every entry and adds them **sequentially in float32, in the array order partial_sort left**,
and divides each by that sum. A float32 sum of ~50k terms depends on its order at the 1e-4
level, and numpy's own float32 `exp` differs from glibc's `expf` in the last bit for a third
of inputs; both are reproduced here:

* `partial_sort`: the order libstdc++'s `__heap_select` + `__sort_heap` leave (bits/stl_algo.h
  `__partial_sort`, bits/stl_heap.h): the first n_top become the top entries in descending
  order, equal logits in the heap's own order (the order the server lists them in); scanning
  the rest, an entry larger than the heap's smallest swaps places with it.
* `glibc_expf`: glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, the ARM optimized-routines
  algorithm: 32-entry 2^(i/32) table, degree-3 polynomial, evaluated in double), vectorised.
* `logf`: the C library's own logf through ctypes (only a few values per token).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from decimal import Decimal, getcontext

import numpy as np

try:
    from replay.numerics import _native  # replay/numerics/_native.c, built by `pip install`
except ImportError:  # pragma: no cover - a tree whose extension was not built
    _native = None

_N = 32
_SHIFT = float.fromhex("0x1.8p+52")
_INV_LN2_N = float.fromhex("0x1.71547652b82fep+0") * _N
_C = (float.fromhex("0x1.c6af84b912394p-5") / _N / _N / _N,
      float.fromhex("0x1.ebfce50fac4f3p-3") / _N / _N,
      float.fromhex("0x1.62e42ff0c52d6p-1") / _N)


def _table() -> np.ndarray:
    """__exp2f_data.tab: bits of the double nearest 2^(i/32), minus i << 47 (sysdeps/ieee754/flt-32/e_exp2f_data.c)."""
    getcontext().prec = 60
    out = []
    for i in range(_N):
        d = float(Decimal(2) ** (Decimal(i) / Decimal(_N)))  # correctly rounded
        bits = int(np.array(d, dtype=np.float64).view(np.uint64))
        out.append((bits - (i << 47)) & 0xFFFFFFFFFFFFFFFF)
    return np.array(out, dtype=np.uint64)


_TAB = _table()
_UNDERFLOW = np.float32(float.fromhex("-0x1.9fe368p6"))  # below: expf returns 0


def glibc_expf(x: np.ndarray) -> np.ndarray:
    """expf of a float32 array (finite inputs <= 88.7), as glibc computes it."""
    xd = x.astype(np.float64)
    z = _INV_LN2_N * xd
    kd = z + _SHIFT  # round to an integer in the low bits
    ki = kd.view(np.uint64)
    r = z - (kd - _SHIFT)
    t = _TAB.take((ki & np.uint64(_N - 1)).astype(np.intp)) + (ki << np.uint64(52 - 5))
    s = t.view(np.float64)
    zz = _C[0] * r + _C[1]
    r2 = r * r
    y = _C[2] * r + 1.0
    y += zz * r2
    y *= s
    out = y.astype(np.float32)
    out[x < _UNDERFLOW] = 0.0
    return out


def _libm():
    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    lib.logf.restype = ctypes.c_float
    lib.logf.argtypes = [ctypes.c_float]
    lib.expf.restype = ctypes.c_float
    lib.expf.argtypes = [ctypes.c_float]
    return lib


_LIBM = _libm()


def logf(p: float) -> float:
    """The C library's logf (completion_token_output::logarithm uses std::log on a float)."""
    return float(_LIBM.logf(float(p)))


def libm_expf(x: float) -> float:
    """The C library's expf of one value (for checking glibc_expf)."""
    return float(_LIBM.expf(float(x)))


def _adjust_heap(keys: list[float], ids: list[int], hole: int, length: int, key: float, tid: int) -> None:
    """libstdc++ `std::__adjust_heap` then `std::__push_heap` (bits/stl_heap.h) for the comparison
    `a.logit > b.logit`: the hole at `hole` sinks along the child the comparison prefers, then
    (key, tid) rises back from where it stopped. The heap's first entry is its smallest logit."""
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if keys[second] > keys[second - 1]:
            second -= 1
        keys[hole], ids[hole] = keys[second], ids[second]
        hole = second
    if length % 2 == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        keys[hole], ids[hole] = keys[second - 1], ids[second - 1]
        hole = second - 1
    parent = (hole - 1) // 2
    while hole > top and keys[parent] > key:
        keys[hole], ids[hole] = keys[parent], ids[parent]
        hole = parent
        parent = (hole - 1) // 2
    keys[hole], ids[hole] = key, tid


def partial_sort(v: np.ndarray, n_top: int) -> tuple[list[int], np.ndarray]:
    """std::partial_sort(begin, begin + n_top, end, [](a, b) { return a.logit > b.logit; }) over
    (id, logit) entries in id order, as libstdc++ does it (bits/stl_algo.h `__partial_sort`):
    `__make_heap` of the first n_top, `__heap_select` (an entry whose logit is above the heap's
    first takes its place by `__pop_heap`, which writes that first entry where the new one was),
    `__sort_heap`. Returns (the first n_top ids in the order left, the logits of the rest in the
    order left). Equal logits keep libstdc++'s order, which is the order the server lists them in.

    The heap's first logit only grows, so each block of the scan is first filtered in numpy by
    the value at its start; blocks double in size as entries become rarer."""
    n_top = min(n_top, len(v))
    keys, ids = [float(x) for x in v[:n_top]], list(range(n_top))
    for parent in range((n_top - 2) // 2, -1, -1):  # __make_heap
        _adjust_heap(keys, ids, parent, n_top, keys[parent], ids[parent])
    tail = v[n_top:].copy()
    start, block = 0, 256
    while n_top and start < len(tail):
        seg = tail[start:start + block]
        for j in np.flatnonzero(seg > keys[0]):
            x = float(seg[j])
            if x > keys[0]:  # __pop_heap(first, middle, i)
                seg[j] = keys[0]
                _adjust_heap(keys, ids, 0, n_top, x, n_top + start + int(j))
        start += block
        block *= 2
    for last in range(n_top - 1, 0, -1):  # __sort_heap: __pop_heap(first, last, last)
        k, i = keys[last], ids[last]
        keys[last], ids[last] = keys[0], ids[0]
        _adjust_heap(keys, ids, 0, last, k, i)
    return ids, tail


# Once the running float32 sum holds expf(0) = 1 (the maximum comes first after partial_sort), a
# term below half an ulp of 1 (2^-24) cannot change it under round-to-nearest; expf(d) < 2^-24 for
# every d <= -16.7 (expf(-17) = 4.1e-8), so terms with a logit below max - 17 are skipped without
# changing a bit (the float32 rounding of max - 17 is far inside that margin for |logits| <= 1e5).
_NO_EFFECT = np.float32(-17.0)


@dataclass(frozen=True)
class TokenProbs:
    """What get_token_probabilities(ctx, idx, n_top) returns for one logits row, bit for bit,
    without materialising the per-id vector: its float32 `total` and its first `n_top` (id, p) in
    the server's order; `p(id)` gives any other entry."""

    logits: np.ndarray
    max: np.float32
    total: np.float32
    top: tuple[tuple[int, float], ...]

    def p(self, tok: int) -> float:
        with np.errstate(invalid="ignore", over="ignore"):
            e = glibc_expf(self.logits[tok:tok + 1] - self.max)
            return float(e[0] / self.total)


def get_token_probabilities(logits: np.ndarray, n_top: int) -> TokenProbs:
    """get_token_probabilities (tools/server/server-common.cpp:1591-1641) with `n_top` requested.

    The server partial_sorts the first n_top by logit, takes max = cur[0].logit, sums expf(l - max)
    sequentially in float32 in the array order partial_sort left, divides each term by that sum,
    and lists the first n_top in that order. Only the terms above max - 17 are exponentiated
    (`_NO_EFFECT`). This is the portable numpy path; `_native.c` takes the same steps in C."""
    l32 = logits.astype(np.float32, copy=False)
    n_top = min(n_top, len(l32))
    mx, mn = l32.max(), l32.min()  # a NaN makes both NaN
    if n_top <= 0 or not (np.isfinite(mx) and np.isfinite(mn)) or max(mx, -mn) > 1e5:
        return reference_probabilities(l32, n_top)
    ids, tail = partial_sort(l32, n_top)
    seq = np.concatenate([l32[ids], tail[tail > mx + _NO_EFFECT]])
    total = np.add.accumulate(glibc_expf(seq - mx), dtype=np.float32)[-1]  # like `cum_sum += p`
    p = glibc_expf(l32[ids] - mx) / total
    return TokenProbs(l32, mx, total, tuple(zip(ids, map(float, p))))


def reference_probabilities(l32: np.ndarray, n_top: int) -> TokenProbs:
    """The direct computation over the whole vocabulary, in the server's own steps (the full
    partial_sort order, every term exponentiated; no partial_sort when n_top is 0): the rows the
    shortcuts decline, and the tests' reference for both of them."""
    n_top = max(min(n_top, len(l32)), 0)
    mx = l32.max()
    ids, tail = partial_sort(l32, n_top)
    with np.errstate(invalid="ignore", over="ignore"):  # an infinite or NaN logit: NaN, as the server gets
        total = np.add.accumulate(glibc_expf(np.concatenate([l32[ids], tail]) - mx), dtype=np.float32)[-1]
        p = glibc_expf(l32[ids] - mx) / total
    return TokenProbs(l32, mx, total, tuple(zip(ids, map(float, p))))


def server_log(p: np.floating | float) -> float:
    """completion_token_output::logarithm (server-task.cpp:302-305): float log, 0 -> lowest float."""
    p32 = np.float32(p)
    if p32 == 0:
        return float(np.finfo(np.float32).min)
    return logf(p32)


def pre_sampling(logits: np.ndarray, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `tok`, top-N (id, logprob)) as the server reports them before sampling
    (populate_token_probs, server-context.cpp:2129-2150, on get_token_probabilities).

    The compiled `_native.pre_sampling` follows the same rule as `get_token_probabilities` below
    (tests/test_server_probs.py holds the two and the direct computation equal on real and hostile
    rows); it is what keeps recover near raw decode speed (README, bench). Without it (a source
    tree whose extension was not built) the numpy path gives the same values, a little slower."""
    if _native is not None:
        got = _native.pre_sampling(np.ascontiguousarray(logits, dtype=np.float32), tok, n_top)
        if got is not None:
            return got
    tp = get_token_probabilities(logits, n_top)
    return server_log(tp.p(tok)), [(i, server_log(v)) for i, v in tp.top]
