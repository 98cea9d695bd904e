"""The server's pre-sampling probabilities, bit for bit: what llama-server reports for a token
before sampling (`pre_sampling`), from `get_token_probabilities` reproduced exactly.

`get_token_probabilities` (tools/server/server-common.cpp:1591-1641) builds the full vocabulary
in id order, `std::partial_sort`s the first `n_top` by logit, then computes `expf(l - max)` for
every entry and adds them **sequentially in float32, in the array order partial_sort left**,
and divides each by that sum. A float32 sum of ~50k terms depends on its order at the 1e-4
level, and numpy's own float32 `exp` differs from glibc's `expf` in the last bit for a third
of inputs; both are reproduced here:

* `partial_sort_values`: the value sequence libstdc++'s `__heap_select` + `__sort_heap` leave
  (bits/stl_algo.h `__partial_sort`): the first n_top become the top values in descending
  order; scanning the rest, an entry larger than the heap's smallest swaps places with it.
  Only values matter for the sum, so equal values need no tie rule.
* `glibc_expf`: glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, the ARM optimized-routines
  algorithm: 32-entry 2^(i/32) table, degree-3 polynomial, evaluated in double), vectorised.
* `logf`: the C library's own logf through ctypes (only a few values per token).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import heapq
from dataclasses import dataclass
from decimal import Decimal, getcontext

import numpy as np

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


def _heap_select(v: np.ndarray, n_top: int) -> tuple[list[float], np.ndarray]:
    """libstdc++ `__heap_select(first, middle, last, greater)` (bits/stl_algo.h): the first n_top
    values form a heap whose top is the smallest; scanning the rest, a value larger than that top
    takes its place in the heap and the top is written where the value was. Returns (heap values,
    the rest of the array as the scan left it).

    The heap's smallest value only grows, so each block of the scan is first filtered in numpy by
    the smallest value at its start; blocks double in size as entries become rarer."""
    heap = [float(x) for x in v[:n_top]]
    heapq.heapify(heap)
    tail = v[n_top:].copy()
    start, block = 0, 256
    while start < len(tail):
        seg = tail[start:start + block]
        for j in np.flatnonzero(seg > heap[0]):
            x = float(seg[j])
            if x > heap[0]:
                seg[j] = heapq.heapreplace(heap, x)
        start += block
        block *= 2
    return heap, tail


def partial_sort_values(v: np.ndarray, n_top: int) -> np.ndarray:
    """The values of `v` in the order std::partial_sort(begin, begin + n_top, end, greater) leaves them."""
    n_top = min(n_top, len(v))
    if n_top <= 0:
        return v
    heap, tail = _heap_select(v, n_top)
    top = np.array(sorted(heap, reverse=True), dtype=v.dtype)  # __sort_heap
    return np.concatenate([top, tail])


# Once the running float32 sum holds expf(0) = 1 (the maximum comes first after partial_sort), a
# term below half an ulp of 1 (2^-24) cannot change it under round-to-nearest; expf(d) < 2^-24 for
# every d <= -16.7 (expf(-17) = 4.1e-8), so terms with a logit below max - 17 are skipped without
# changing a bit (the float32 rounding of max - 17 is far inside that margin for |logits| <= 1e5).
_NO_EFFECT = np.float32(-17.0)
# Logits further than this below the n-th largest cannot tie with it in p (the expf ratio, 1e-3, is
# four orders of magnitude above float32 rounding), so the top-N is searched only above it.
_TIE_MARGIN = np.float32(1e-3)


@dataclass(frozen=True)
class TokenProbs:
    """What get_token_probabilities(ctx, idx, n_top) returns for one logits row, bit for bit,
    without materialising the per-id vector: its float32 `total` and the top `n_top` (id, p)
    by descending p (ties: lower id first); `p(id)` gives any other entry."""

    logits: np.ndarray
    max: np.float32
    total: np.float32
    top: tuple[tuple[int, float], ...]

    def p(self, tok: int) -> float:
        e = glibc_expf(self.logits[tok:tok + 1] - self.max)
        return float(e[0] / self.total)


def get_token_probabilities(logits: np.ndarray, n_top: int) -> TokenProbs:
    """get_token_probabilities (tools/server/server-common.cpp:1591-1641) with `n_top` requested.

    The server partial_sorts the first n_top, takes max = cur[0].logit, sums expf(l - max)
    sequentially in float32 in the array order partial_sort left, and divides each term by that
    sum. Here the order comes from `_heap_select`, and only terms that can move the sum
    (`_NO_EFFECT`) and candidates for the top-N (`_TIE_MARGIN`) are exponentiated."""
    l32 = logits.astype(np.float32, copy=False)
    n_top = min(n_top, len(l32))
    if n_top <= 0 or not np.isfinite(l32).all() or abs(l32).max() > 1e5:
        return _full(l32, n_top)
    heap, tail = _heap_select(l32, n_top)
    top_vals = np.array(sorted(heap, reverse=True), dtype=np.float32)
    mx = top_vals[0]
    seq = np.concatenate([top_vals, tail[tail > mx + _NO_EFFECT]])
    total = np.add.accumulate(glibc_expf(seq - mx), dtype=np.float32)[-1]  # like `cum_sum += p`
    kth = top_vals[n_top - 1]
    cand = np.flatnonzero(l32 >= kth - _TIE_MARGIN)
    p = glibc_expf(l32[cand] - mx) / total
    if p.min(initial=1.0) == 0.0:  # ties among zero probabilities: id order over the whole vocabulary
        return _full(l32, n_top)
    order = np.lexsort((cand, -p))[:n_top]
    return TokenProbs(l32, mx, total, tuple((int(cand[i]), float(p[i])) for i in order))


def _full(l32: np.ndarray, n_top: int) -> TokenProbs:
    """The direct computation over the whole vocabulary (no partial_sort when n_top is 0)."""
    mx = l32.max()
    order_vals = partial_sort_values(l32, n_top)
    total = np.add.accumulate(glibc_expf(order_vals - mx), dtype=np.float32)[-1]
    p = glibc_expf(l32 - mx) / total
    ids = np.lexsort((np.arange(len(p)), -p))[:max(n_top, 0)]
    return TokenProbs(l32, mx, total, tuple((int(i), float(p[i])) for i in ids))


def server_log(p: np.floating | float) -> float:
    """completion_token_output::logarithm (server-task.cpp:302-305): float log, 0 -> lowest float."""
    p32 = np.float32(p)
    if p32 == 0:
        return float(np.finfo(np.float32).min)
    return logf(p32)


def pre_sampling(logits: np.ndarray, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `tok`, top-N (id, logprob)) as the server reports them before sampling
    (populate_token_probs, server-context.cpp:2129-2150, on get_token_probabilities)."""
    tp = get_token_probabilities(logits, n_top)
    return server_log(tp.p(tok)), [(i, server_log(v)) for i, v in tp.top]
