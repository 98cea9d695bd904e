"""The server's pre-sampling probabilities, three ways, must agree bit for bit.

`pre_sampling` runs once per generated token in recover and trace. Its compiled path
(replay/numerics/_native.c) and its numpy path (`get_token_probabilities`) follow only the entries
that can move the server's float sum; `reference_probabilities` takes the server's own steps over
the whole vocabulary. Below they are held equal to each other, and the compiled path to a C++
program that does what get_token_probabilities (server-common.cpp:1591-1641) does with
libstdc++'s std::partial_sort and glibc's expf, on real SmolLM2 rows and on hostile ones.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from replay.numerics import server_probs
from replay.numerics.server_probs import get_token_probabilities, pre_sampling, reference_probabilities, server_log

SERVER_CPP = r"""
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>
struct td { int id; float logit; float p; };
int main() {  // N TOP TOK v1..vN -> "logprob(tok) id1 logprob1 ... idTOP logprobTOP", as the server reports
    int n, top, tok;
    while (std::scanf("%d %d %d", &n, &top, &tok) == 3) {
        std::vector<td> cur(n);
        for (int i = 0; i < n; ++i) { cur[i].id = i; std::scanf("%a", &cur[i].logit); cur[i].p = 0; }
        std::partial_sort(cur.begin(), cur.begin() + top, cur.end(),
                          [](const td & a, const td & b) { return a.logit > b.logit; });
        float max_l = cur[0].logit, cum_sum = 0.0f;
        for (auto & c : cur) { c.p = expf(c.logit - max_l); cum_sum += c.p; }
        for (auto & c : cur) c.p /= cum_sum;
        auto lg = [](float p) { return p == 0.0f ? -3.4028234663852886e38 : (double) std::log(p); };
        float ptok = 0; for (auto & c : cur) if (c.id == tok) ptok = c.p;
        std::printf("%a", lg(ptok));
        for (int i = 0; i < top; ++i) std::printf(" %d %a", cur[i].id, lg(cur[i].p));
        std::printf("\n");
    }
}
"""


def _hostile_rows(seed: int = 11) -> list[np.ndarray]:
    """Vocabularies from 1 to 49,152 entries: flat, peaked (fewer than N entries within 17 nats of
    the top), heavy ties, tied maxima, huge gaps (zero probabilities), a 40-nat spike."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(160):
        n = int(rng.choice([1, 2, 5, 50, 3000, 49152]))
        v = (rng.standard_normal(n) * rng.choice([0.5, 5, 20, 60])).astype(np.float32)
        if k % 3 == 0:
            v = np.round(v, 1).astype(np.float32)
        if k % 5 == 0:
            v[rng.integers(n)] += 40
        if k % 7 == 0:
            v[:] = v.max()
        if k % 11 == 0:
            v[rng.integers(n)] = -300
        rows.append(v)
    return rows


def _reference(v: np.ndarray, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    tp = reference_probabilities(v, n_top)
    return server_log(tp.p(tok)), [(i, server_log(p)) for i, p in tp.top]


def _numpy_path(v: np.ndarray, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    tp = get_token_probabilities(v, n_top)
    return server_log(tp.p(tok)), [(i, server_log(p)) for i, p in tp.top]


CASES = [(v, n_top, (7 * i) % len(v)) for i, v in enumerate(_hostile_rows()) for n_top in (1, 5, 20)]


def test_the_extension_is_built_and_computes_every_row_itself():
    """pre_sampling takes the numpy path where the compiled one declines (returns None), so the
    "compiled" cases below would pass on numpy alone: here the extension of this checkout is loaded and
    answers every hostile row itself, with the numpy path's values."""
    from pathlib import Path
    native = server_probs._native
    assert native is not None, "replay/numerics/_native.c is not built: pip install -e ."
    assert Path(native.__file__).parent == Path(server_probs.__file__).parent and ".so" in Path(native.__file__).suffixes
    for v, n_top, tok in CASES:
        got = native.pre_sampling(np.ascontiguousarray(v, dtype=np.float32), tok, n_top)
        assert got is not None and got == _numpy_path(v, tok, n_top), (len(v), n_top, tok)


@pytest.mark.parametrize("path", [pre_sampling, _numpy_path], ids=["compiled", "numpy"])
def test_shortcuts_equal_the_servers_own_steps_on_hostile_rows(path):
    for v, n_top, tok in CASES:
        assert path(v, tok, n_top) == _reference(v, tok, n_top), (len(v), n_top, tok)


def test_both_paths_equal_libstdcxx_partial_sort_and_glibc_expf(compile_cpp):
    exe = compile_cpp("server_probs", SERVER_CPP)
    cases = [(v, min(n_top, len(v)), tok) for v, n_top, tok in CASES if len(v) <= 3000]
    text = "".join(f"{len(v)} {n} {t} " + " ".join(float(x).hex() for x in v) + "\n" for v, n, t in cases)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == len(cases)
    for (v, n_top, tok), line in zip(cases, out):
        f = line.split()
        want = (float.fromhex(f[0]), [(int(f[i]), float.fromhex(f[i + 1])) for i in range(1, len(f), 2)])
        assert pre_sampling(v, tok, n_top) == want, (len(v), n_top, tok)  # equal logits in the server's order
        assert _numpy_path(v, tok, n_top) == want, (len(v), n_top, tok)


def test_rows_the_shortcut_declines_still_get_the_servers_values():
    row = np.float32([0.0, np.nan, 1.0])
    assert repr(pre_sampling(row, 2, 1)) == repr(_reference(row, 2, 1))  # NaN, as the server's sum
    inf = np.float32([np.inf, 1.0, 0.0])
    assert repr(pre_sampling(inf, 1, 2)) == repr(_reference(inf, 1, 2))
    assert pre_sampling(np.float32([3.0, 1.0]), 0, 0) == _reference(np.float32([3.0, 1.0]), 0, 0)


def test_a_row_that_is_not_float32_is_converted_not_misread():
    row = np.linspace(-5, 5, 1000)  # float64
    assert pre_sampling(row, 3, 5) == _reference(row.astype(np.float32), 3, 5)


@pytest.mark.model
def test_all_three_agree_on_real_smollm2_rows(smollm2):
    from replay.runtime.llama import Context, Model
    model = Model(smollm2)
    ctx = Context(model, n_ctx=256)
    prompt = model.tokenize("The capital of France is", add_special=True, parse_special=False)
    ctx.decode(prompt, 0)
    for pos in range(len(prompt), len(prompt) + 24):
        row = ctx.logits_view(-1)
        tok = int(np.argmax(row))
        want = _reference(row.copy(), tok, 5)
        assert pre_sampling(row, tok, 5) == want
        assert _numpy_path(row.copy(), tok, 5) == want
        ctx.decode([tok], pos)
    ctx.close()
    model.close()
