"""The libstdc++ behaviour spec-replay reproduces in Python, checked against g++ itself.

* minstd_rand0 with generate_canonical<double>, uniform_int_distribution and
  discrete_distribution: llama-speculative's random numbers (rng.py);
* std::partial_sort's final element order, whose float sum the server's pre-sampling
  probabilities depend on (softmax.py);
* glibc's expf (softmax.glibc_expf) against the C library.
"""
from __future__ import annotations

import random
import subprocess

import numpy as np
import pytest

from replay.numerics.rng import (
    MinStdRand0,
    minstd_canonical_double,
    minstd_discrete,
    minstd_uniform_int,
)
from replay.numerics.server_probs import glibc_expf, libm_expf, partial_sort

CPP = r"""
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>
int main() {
    char what[16];
    while (std::scanf("%15s", what) == 1) {
        if (what[0] == 'r') {                      // r SEED K W w1..wW: draws like speculative.cpp
            unsigned seed; int k, w; std::scanf("%u %d %d", &seed, &k, &w);
            std::vector<float> ws(w); for (auto & x : ws) std::scanf("%f", &x);
            std::default_random_engine rng(seed);
            std::uniform_real_distribution<> u;
            for (int i = 0; i < k; ++i) {
                std::uniform_int_distribution<unsigned int> ui(0, i % 3);
                unsigned a = ui(rng);
                double b = u(rng);
                std::discrete_distribution<> dd(ws.begin(), ws.end());
                int c = dd(rng);
                std::printf("%u %.17g %d ", a, b, c);
            }
            std::printf("\n");
        } else {                                   // p N TOP v1..vN: partial_sort order
            int n, top; std::scanf("%d %d", &n, &top);
            std::vector<float> v(n); for (auto & x : v) std::scanf("%f", &x);
            std::partial_sort(v.begin(), v.begin() + top, v.end(), [](float a, float b) { return a > b; });
            for (float x : v) std::printf("%.9g ", x);
            std::printf("\n");
        }
    }
}
"""


@pytest.fixture(scope="module")
def reference(compile_cpp):
    return compile_cpp("libstdcxx", CPP)


def _run(exe, text: str) -> list[str]:
    return subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()


def test_minstd_draws_match_libstdcxx(reference):
    rnd = random.Random(7)
    cases = []
    for _ in range(300):
        seed = rnd.choice([0, 1, 2, 2147483647, 2147483648, 4294967294, rnd.randrange(2**32)])
        w = [np.float32(rnd.random()) * rnd.choice([0, 1, 1, 1]) for _ in range(rnd.choice([1, 2, 3, 8]))]
        if not any(w):
            w[0] = np.float32(0.5)
        cases.append((seed, 6, w))
    out = _run(reference, "".join(f"r {s} {k} {len(w)} {' '.join(repr(float(x)) for x in w)}\n" for s, k, w in cases))
    for (seed, k, w), line in zip(cases, out):
        rng = MinStdRand0(seed)
        got = []
        for i in range(k):
            got += [str(minstd_uniform_int(rng, 0, i % 3)), repr(minstd_canonical_double(rng)),
                    str(minstd_discrete(rng, [float(x) for x in w]))]
        want = line.split()
        assert [int(x) for x in got[0::3]] == [int(x) for x in want[0::3]], seed
        assert [float(x) for x in got[1::3]] == [float(x) for x in want[1::3]], seed
        assert [int(x) for x in got[2::3]] == [int(x) for x in want[2::3]], (seed, w)


def test_partial_sort_order_matches_libstdcxx(reference):
    rnd = np.random.default_rng(3)
    cases = []
    for _ in range(60):
        n = int(rnd.choice([1, 5, 40, 3000]))
        top = int(rnd.choice([1, 3, 5, 10, 20]))
        v = rnd.standard_normal(n).astype(np.float32)
        if rnd.random() < 0.3:
            v = np.round(v, 1).astype(np.float32)  # ties
        cases.append((v, min(top, n)))
    out = _run(reference, "".join(f"p {len(v)} {t} {' '.join(repr(float(x)) for x in v)}\n" for v, t in cases))
    for (v, top), line in zip(cases, out):
        want = np.array([float(x) for x in line.split()], dtype=np.float32)
        ids, tail = partial_sort(v, top)
        assert np.array_equal(np.concatenate([v[ids], tail]), want)


def test_glibc_expf_is_the_c_librarys():
    rnd = np.random.default_rng(5)
    x = np.concatenate([(-rnd.random(100_000) * 110).astype(np.float32),
                        np.float32([0.0, -1e-7, -87.3, -103.9, -104.0, -200.0])])
    want = np.array([libm_expf(v) for v in x], dtype=np.float32)
    assert np.array_equal(glibc_expf(x).view(np.uint32), want.view(np.uint32))


SORT_CPP = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
struct td { int id; float logit; float p; };  // llama_token_data
int main() {
    char what[4]; int n;
    while (std::scanf("%3s %d", what, &n) == 2) {
        std::vector<td> v(n);
        for (int i = 0; i < n; ++i) { v[i].id = i; v[i].logit = 0; std::scanf("%a", &v[i].p); }
        auto comp = [](const td & a, const td & b) { return a.p > b.p; };  // common/sampling.cpp:867-869
        if (what[0] == 's') std::sort(v.begin(), v.end(), comp);
        else std::partial_sort(v.begin(), v.end(), v.end(), comp);  // introsort's depth-0 fallback
        for (auto & x : v) std::printf("%d ", x.id);
        std::printf("\n");
    }
}
"""


def _hostile_rows() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    rows = [np.zeros(0), np.ones(1), np.full(16, 0.5), np.full(17, 0.5), np.full(200, 0.25),
            np.arange(40, dtype=float), np.arange(40, dtype=float)[::-1]]
    for n in (5, 16, 17, 18, 31, 33, 100, 1000, 49152):
        rows.append(rng.integers(0, max(2, n // 8), n).astype(float))        # many ties
        rows.append(np.round(rng.dirichlet(np.ones(n)), 3))                  # ties at the tail, zeros
    p = rng.dirichlet(np.ones(4096)).astype(np.float32)
    p[rng.integers(0, 4096, 3000)] = 0.0                                     # grammar-masked zeros
    rows.append(p.astype(float))
    return [r.astype(np.float32) for r in rows]


def test_std_sort_leaves_equal_probabilities_where_libstdcxx_does(compile_cpp):
    """common_sampler_get_candidates sorts with std::sort (introsort, not stable): on rows with ties,
    over and under the 16-entry insertion threshold, and 49,152 candidates (SmolLM2's vocabulary,
    `--top-k 0`), the emulation puts every id where g++'s std::sort does, and its heap-sort fallback
    where std::partial_sort(first, last, last) does."""
    from replay.numerics.stdsort import _heap_sort, std_sort_order
    from replay.runtime.sampler import TIE_WINDOW, server_order
    exe = compile_cpp("std_sort", SORT_CPP)
    rows = _hostile_rows()
    text = "".join(f"{w} {len(r)} " + " ".join(float(x).hex() for x in r) + "\n" for r in rows for w in ("s", "h"))
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True, timeout=120).stdout
    lines = out.split("\n")
    for j, r in enumerate(rows):
        want_sort = [int(x) for x in lines[2 * j].split()]
        want_heap = [int(x) for x in lines[2 * j + 1].split()]
        assert std_sort_order(r) == want_sort, (j, len(r))
        k, ix = [float(x) for x in r], list(range(len(r)))
        _heap_sort(k, ix, 0, len(r))
        assert ix == want_heap, (j, len(r))
        # the sampler's order (stable unless ties meet where the order is reported: the first TIE_WINDOW
        # entries with p > 0, post_sampling stops at a zero) is g++'s there
        def reported(order):
            return [i for i in order[:TIE_WINDOW] if r[i] > 0]
        assert reported(server_order(r).tolist()) == reported(want_sort), (j, len(r))
        stable = list(np.argsort(-r, kind="stable"))
        if j == 4:
            assert want_sort[:TIE_WINDOW] != stable[:TIE_WINDOW]  # a stable sort would list other ids
