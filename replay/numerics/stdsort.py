"""The order libstdc++'s `std::sort` leaves equal keys in (pure).

common_sampler_get_candidates (common/sampling.cpp:861-880) sorts the chain's candidates with
`std::sort(..., [](a, b) { return a.p > b.p; })` when the chain left them unsorted (a chain without
top-k, `--top-k 0`). std::sort is introsort and not stable: entries of equal p end in an order that
depends on the whole array, and the top-N the server lists (post-sampling probabilities) follows it.
This module follows libstdc++'s algorithm step by step (bits/stl_algo.h, GCC 11-14, unchanged):

    __sort:                  __introsort_loop(first, last, 2 * __lg(n)), then __final_insertion_sort
    __introsort_loop:        while n > _S_threshold (16): at depth 0 heap-sort the range
                             (__partial_sort(first, last, last)); else cut at
                             __unguarded_partition_pivot, recurse on the right part, loop on the left
    __unguarded_partition_pivot: __move_median_to_first(first, first + 1, mid, last - 1), then
                             __unguarded_partition(first + 1, last, first)
    __final_insertion_sort:  __insertion_sort of the first 16, __unguarded_insertion_sort of the rest

It is pure Python (about 1 s for 49,152 candidates), so the sampler uses it only where a tie can
change what is reported (runtime/sampler.py); tests/test_libstdcxx_emulation.py checks it against g++.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

THRESHOLD = 16  # _S_threshold


def std_sort_order(keys: Sequence[float] | np.ndarray) -> list[int]:
    """The permutation `std::sort(v, v + n, [](a, b) { return a.key > b.key; })` leaves: position i
    of the result holds the index (into `keys`) of the entry libstdc++ puts there.

    >>> std_sort_order([0.1, 0.5, 0.5, 0.2])
    [1, 2, 3, 0]
    >>> order = std_sort_order([0.25] * 17 + [0.5])   # ties over the insertion threshold
    >>> order[0], sorted(order) == list(range(18))
    (17, True)
    """
    k = [float(x) for x in keys]
    ix = list(range(len(k)))
    n = len(k)
    if n > 1:
        _introsort_loop(k, ix, 0, n, 2 * (n.bit_length() - 1))
        _final_insertion_sort(k, ix, 0, n)
    return ix


def _swap(k: list, ix: list, a: int, b: int) -> None:
    k[a], k[b] = k[b], k[a]
    ix[a], ix[b] = ix[b], ix[a]


def _introsort_loop(k: list, ix: list, first: int, last: int, depth: int) -> None:
    while last - first > THRESHOLD:
        if depth == 0:
            _heap_sort(k, ix, first, last)
            return
        depth -= 1
        cut = _partition_pivot(k, ix, first, last)
        _introsort_loop(k, ix, cut, last, depth)
        last = cut


def _partition_pivot(k: list, ix: list, first: int, last: int) -> int:
    mid = first + (last - first) // 2
    _move_median_to_first(k, ix, first, first + 1, mid, last - 1)
    return _unguarded_partition(k, ix, first + 1, last, first)


def _move_median_to_first(k: list, ix: list, result: int, a: int, b: int, c: int) -> None:
    # comp(x, y) is k[x] > k[y]
    if k[a] > k[b]:
        if k[b] > k[c]:
            _swap(k, ix, result, b)
        elif k[a] > k[c]:
            _swap(k, ix, result, c)
        else:
            _swap(k, ix, result, a)
    elif k[a] > k[c]:
        _swap(k, ix, result, a)
    elif k[b] > k[c]:
        _swap(k, ix, result, c)
    else:
        _swap(k, ix, result, b)


def _unguarded_partition(k: list, ix: list, first: int, last: int, pivot: int) -> int:
    while True:
        while k[first] > k[pivot]:
            first += 1
        last -= 1
        while k[pivot] > k[last]:
            last -= 1
        if not first < last:
            return first
        _swap(k, ix, first, last)
        first += 1


def _final_insertion_sort(k: list, ix: list, first: int, last: int) -> None:
    if last - first > THRESHOLD:
        _insertion_sort(k, ix, first, first + THRESHOLD)
        for i in range(first + THRESHOLD, last):  # __unguarded_insertion_sort
            _unguarded_linear_insert(k, ix, i)
    else:
        _insertion_sort(k, ix, first, last)


def _insertion_sort(k: list, ix: list, first: int, last: int) -> None:
    for i in range(first + 1, last):
        if k[i] > k[first]:  # move_backward(first, i, i + 1), *first = val
            val, vi = k[i], ix[i]
            k[first + 1:i + 1], ix[first + 1:i + 1] = k[first:i], ix[first:i]
            k[first], ix[first] = val, vi
        else:
            _unguarded_linear_insert(k, ix, i)


def _unguarded_linear_insert(k: list, ix: list, last: int) -> None:
    val, vi = k[last], ix[last]
    nxt = last - 1
    while val > k[nxt]:
        k[last], ix[last] = k[nxt], ix[nxt]
        last = nxt
        nxt -= 1
    k[last], ix[last] = val, vi


def _heap_sort(k: list, ix: list, first: int, last: int) -> None:
    """__partial_sort(first, last, last): __make_heap, then __sort_heap (bits/stl_heap.h). Under
    comp (a > b) the heap's first entry is the smallest key, and each pop moves it to the end."""
    n = last - first
    for parent in range((n - 2) // 2, -1, -1):  # __make_heap
        _adjust_heap(k, ix, first, parent, n, k[first + parent], ix[first + parent])
    for end in range(n - 1, 0, -1):  # __sort_heap: __pop_heap(first, first + end + 1)
        val, vi = k[first + end], ix[first + end]
        k[first + end], ix[first + end] = k[first], ix[first]
        _adjust_heap(k, ix, first, 0, end, val, vi)


def _adjust_heap(k: list, ix: list, base: int, hole: int, length: int, val: float, vi: int) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if k[base + child] > k[base + child - 1]:  # comp(first + child, first + (child - 1))
            child -= 1
        k[base + hole], ix[base + hole] = k[base + child], ix[base + child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        k[base + hole], ix[base + hole] = k[base + child - 1], ix[base + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and k[base + parent] > val:  # comp(first + parent, value)
        k[base + hole], ix[base + hole] = k[base + parent], ix[base + parent]
        hole = parent
        parent = (hole - 1) // 2
    k[base + hole], ix[base + hole] = val, vi
