"""The server's pre-sampling probabilities, bit for bit.

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
    kd = z + _SHIFT
    ki = kd.view(np.uint64)
    kd = kd - _SHIFT
    r = z - kd
    t = _TAB[(ki % _N).astype(np.int64)] + (ki << np.uint64(52 - 5))
    s = t.view(np.float64)
    zz = _C[0] * r + _C[1]
    r2 = r * r
    y = _C[2] * r + 1.0
    y = zz * r2 + y
    y = y * s
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


def partial_sort_values(v: np.ndarray, n_top: int) -> np.ndarray:
    """The values of `v` in the order std::partial_sort(begin, begin + n_top, end, greater) leaves them."""
    n = len(v)
    n_top = min(n_top, n)
    if n_top <= 0:
        return v
    heap = [float(x) for x in v[:n_top]]  # a min-heap: its top is the entry the next larger value evicts
    heapq.heapify(heap)
    tail = v[n_top:].copy()
    block = 1024
    for b0 in range(0, len(tail), block):
        seg = tail[b0:b0 + block]
        for j in np.flatnonzero(seg > heap[0]):
            x = float(seg[j])
            if x > heap[0]:
                seg[j] = heapq.heapreplace(heap, x)
    top = np.array(sorted(heap, reverse=True), dtype=v.dtype)
    return np.concatenate([top, tail])


def server_probs(logits: np.ndarray, n_top: int) -> tuple[np.ndarray, np.float32]:
    """Per-id probabilities exactly as get_token_probabilities computes them with `n_top`
    requested: (p in id order, the float32 sum they were divided by)."""
    l32 = logits.astype(np.float32, copy=False)
    mx = l32.max()
    e_id = glibc_expf(l32 - mx)
    order_vals = partial_sort_values(l32, n_top)
    # the ordered sequence equals the id-ordered one except where partial_sort moved a value:
    # exponentiate only those (expf of the same float is the same float)
    moved = order_vals != l32
    seq = e_id.copy()
    seq[moved] = glibc_expf(order_vals[moved] - mx)
    total = np.add.accumulate(seq, dtype=np.float32)[-1]  # sequential, like `cum_sum += p`
    return e_id / total, total
