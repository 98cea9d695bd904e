"""StdIntMap reproduces libstdc++'s std::unordered_map<int,int> iteration order (g++ is the reference)."""
from __future__ import annotations

import random
import subprocess

import pytest

from replay.numerics.stdmap import StdIntMap

CPP = r"""
#include <cstdio>
#include <unordered_map>
int main() {
    int n;
    while (std::scanf("%d", &n) == 1) {
        std::unordered_map<int, int> m;
        for (int i = 0; i < n; ++i) { int k; std::scanf("%d", &k); auto it = m.find(k); if (it == m.end()) m.emplace(k, 1); else it->second++; }
        std::printf("%zu", m.bucket_count());
        for (auto & kv : m) std::printf(" %d:%d", kv.first, kv.second);
        std::printf("\n");
        std::unordered_map<int, int> copy = m;  // try_draft iterates a copy
        for (auto & kv : copy) std::printf(" %d", kv.first);
        std::printf("\n");
    }
}
"""


@pytest.fixture(scope="module")
def reference(compile_cpp):
    return compile_cpp("stdmap", CPP)


def test_iteration_order_matches_libstdcxx(reference):
    rng = random.Random(1)
    cases = []
    for _ in range(300):
        n = rng.choice([1, 2, 5, 12, 13, 14, 27, 30, 60, 130, 300])
        hi = rng.choice([20, 200, 50000])
        cases.append([rng.randrange(hi) for _ in range(n)])
    inp = "".join(f"{len(c)} {' '.join(map(str, c))}\n" for c in cases)
    out = subprocess.run([str(reference)], input=inp, capture_output=True, text=True, check=True).stdout.splitlines()
    for k, keys in enumerate(cases):
        m = StdIntMap()
        for x in keys:
            m.increment(x)
        bucket_count, *pairs = out[2 * k].split()
        assert m.n_bkt == int(bucket_count), (k, keys)
        assert [f"{a}:{b}" for a, b in m.items()] == pairs, (k, keys)
        assert [str(a) for a, _ in m.items()] == out[2 * k + 1].split()
