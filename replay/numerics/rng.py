"""Bit-exact C++ random streams (libstdc++, GCC), as llama.cpp's libcommon draws them.

    MT19937(seed)        std::mt19937 seeded with init_genrand (not Python's random.seed)
    canonical_float(r)   std::generate_canonical<float, 24>: one 32-bit draw
    canonical_double(r)  std::generate_canonical<double, 53>: two draws, low word first

`std::uniform_real_distribution<T>(0, 1)(r)` is `canonical * (1 - 0) + 0`, i.e. the
canonical value itself. Users in llama.cpp b11434:

    common/sampling.cpp:440   rejection rng  = mt19937(seed ^ 0x9e3779b9), uniform float (:740)
    common/speculative.cpp:66 draft sampler  seed = seed ^ 0x85ebca6b (drawn inside libllama's dist)

Known answer (C++ standard, [rand.predef]): the 10000th output of a
default-constructed std::mt19937 (seed 5489) is 4123659995.
"""
from __future__ import annotations

import math

import numpy as np

REJECTION_SEED_XOR = 0x9E3779B9  # common/sampling.cpp:440
DRAFT_SEED_XOR = 0x85EBCA6B  # common/speculative.cpp:66


class MT19937:
    """std::mt19937: 624-word state, tempering as in the standard."""

    def __init__(self, seed: int = 5489):
        mt = [seed & 0xFFFFFFFF] + [0] * 623
        for i in range(1, 624):
            p = mt[i - 1]
            mt[i] = (1812433253 * (p ^ (p >> 30)) + i) & 0xFFFFFFFF
        self._mt = mt
        self._i = 624

    def __call__(self) -> int:
        if self._i >= 624:
            mt = self._mt
            for k in range(624):
                y = (mt[k] & 0x80000000) | (mt[(k + 1) % 624] & 0x7FFFFFFF)
                mt[k] = mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self._i = 0
        y = self._mt[self._i]
        self._i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y & 0xFFFFFFFF


_ONE_BELOW_F32 = np.nextafter(np.float32(1), np.float32(0))
_TWO32_F32 = np.float32(4294967296.0)


def canonical_float(r: MT19937) -> np.float32:
    """generate_canonical<float, 24>: float(draw) / 2^32 in float arithmetic, clamped below 1."""
    x = np.float32(r()) / _TWO32_F32
    return x if x < 1 else _ONE_BELOW_F32


def canonical_double(r: MT19937) -> float:
    """generate_canonical<double, 53>: (a + b * 2^32) / 2^64 with a drawn first, clamped below 1."""
    a = r()
    b = r()
    x = (float(a) + float(b) * 4294967296.0) / 18446744073709551616.0
    return x if x < 1.0 else math.nextafter(1.0, 0.0)


# --- std::default_random_engine and the distributions llama-speculative draws from ---------------
# examples/speculative/speculative.cpp:67-68 seeds `std::default_random_engine rng(seed)` and draws
# `std::uniform_real_distribution<> u_dist` (acceptance), `std::uniform_int_distribution<unsigned>`
# (which draft sequence to verify, :284-285) and `std::discrete_distribution<>` (residual, :386-390).
# libstdc++'s default_random_engine is minstd_rand0.

class MinStdRand0:
    """std::minstd_rand0: x <- 16807 x mod (2^31 - 1); seed s mod m, 0 becomes 1 (bits/random.tcc)."""

    M = 2147483647
    MIN, MAX = 1, 2147483646

    def __init__(self, seed: int):
        x = seed % self.M
        self._x = x if x != 0 else 1

    def __call__(self) -> int:
        self._x = (16807 * self._x) % self.M
        return self._x


def minstd_canonical_double(r: MinStdRand0) -> float:
    """generate_canonical<double, 53> over minstd_rand0 (bits/random.tcc): the engine's range
    R = 2^31 - 2 gives floor(log2 R) = 30 bits per draw, so k = (53 + 30 - 1) // 30 = 2 draws,
    summed as (g1 - min) + (g2 - min) * R and divided by R^2, in double; clamped below 1."""
    rr = float(r.MAX - r.MIN + 1)
    s, t = 0.0, 1.0
    for _ in range(2):
        s += float(r() - r.MIN) * t
        t *= rr
    x = s / t
    return x if x < 1.0 else math.nextafter(1.0, 0.0)


def minstd_uniform_int(r: MinStdRand0, a: int, b: int) -> int:
    """uniform_int_distribution<unsigned>(a, b) over minstd_rand0 (bits/uniform_int_dist.h, the
    downscaling branch): scaling = range_engine // (b - a + 1); draw until below scaling * (b - a + 1).
    Even a one-value range consumes a draw."""
    urng_range = r.MAX - r.MIN
    erange = b - a + 1
    scaling = urng_range // erange
    past = erange * scaling
    while True:
        v = r() - r.MIN
        if v < past:
            return a + v // scaling


def minstd_discrete(r: MinStdRand0, probs: list[float]) -> int:
    """discrete_distribution<int>(probs)(r) (bits/random.tcc): weights normalised by their double
    sum, cumulative sums with the last forced to 1.0, then lower_bound of one canonical double.
    Fewer than two weights always give 0 without a draw."""
    if len(probs) < 2:
        return 0
    total = 0.0
    for p in probs:
        total += float(p)
    cp, acc = [], 0.0
    for p in probs:
        acc += float(p) / total
        cp.append(acc)
    cp[-1] = 1.0
    u = minstd_canonical_double(r)
    for i, c in enumerate(cp):  # lower_bound: first c >= u
        if c >= u:
            return i
    return len(cp) - 1
