"""The pure pieces of the speculative loop, against known answers and hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest

from replay.loop.verify import match_continues, rejection_step
from replay.numerics.rng import MT19937, canonical_double, canonical_float


def test_mt19937_10000th_output_is_the_standards_known_answer():
    r = MT19937()
    for _ in range(9999):
        r()
    assert r() == 4123659995


def test_mt19937_first_outputs_for_seed_5489():
    r = MT19937(5489)
    assert [r() for _ in range(3)] == [3499211612, 581869302, 3890346734]


def test_canonical_float_is_one_draw_rounded_to_float32():
    r1, r2 = MT19937(1), MT19937(1)
    x = canonical_float(r1)
    assert x.dtype == np.float32 and x == np.float32(r2()) / np.float32(2**32)


def test_canonical_float_never_reaches_one():
    class Max:
        def __call__(self):
            return 0xFFFFFFFF
    assert canonical_float(Max()) == np.float32(0.99999994)


def test_canonical_double_uses_two_draws_low_word_first():
    r1, r2 = MT19937(7), MT19937(7)
    a, b = r2(), r2()
    assert canonical_double(r1) == (a + b * 2.0**32) / 2.0**64


def test_canonical_double_matches_libllama_dist_sampler():
    """libllama's dist sampler draws uniform_real_distribution<double> from mt19937(seed):
    with two equal candidates it picks the second iff the draw is >= 0.5."""
    import ctypes

    import llama_cpp as L

    from replay.runtime.sampler import TOKEN_DATA
    for seed in range(20):
        s = L.llama_sampler_init_dist(seed)
        buf = np.zeros(2, dtype=TOKEN_DATA)
        buf["id"] = [0, 1]
        arr = L.llama_token_data_array(data=buf.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=2,
                                       selected=-1, sorted=False)
        L.llama_sampler_apply(s, ctypes.byref(arr))
        L.llama_sampler_free(s)
        u = canonical_double(MT19937(seed))
        assert arr.selected == (1 if u * 2.0 > 1.0 else 0), (seed, u)


def uniforms(*xs):
    it = iter(np.float32(x) for x in xs)
    return lambda: next(it)


def test_accept_without_a_draw_when_p_is_at_least_q():
    d = rejection_step(5, [5, 6], [0.6, 0.4], [5, 6], [0.5, 0.5], id_target=6, uniform=uniforms())
    assert d.accepted and d.token == 5 and d.u_accept is None


def test_accept_when_the_draw_is_below_p_over_q():
    d = rejection_step(5, [5, 6], [0.3, 0.7], [5, 6], [0.6, 0.4], id_target=6, uniform=uniforms(0.49))
    assert d.accepted and d.u_accept == pytest.approx(0.49)


def test_reject_resamples_from_the_normalised_residual():
    # p = (a .3, b .7), q = (a .6, b .4): p/q(a) = .5 < .8 -> reject; residual = {b: .3}, sum .3
    d = rejection_step(0, [0, 1], [0.3, 0.7], [0, 1], [0.6, 0.4], id_target=0, uniform=uniforms(0.8, 0.1))
    assert not d.accepted and d.token == 1 and d.u_residual == pytest.approx(0.1)


def test_residual_scan_follows_candidate_order():
    # residual over target order [2, 0, 1]: r = {2: .2, 0: .1}, sum .3; u = .5*.3 = .15 -> 2 (.15-.2 <= 0)
    d = rejection_step(1, [2, 0, 1], [0.3, 0.3, 0.4], [1, 2, 0], [0.8, 0.1, 0.1], id_target=2,
                       uniform=uniforms(0.9, 0.5))
    assert not d.accepted and d.token == 2
    d = rejection_step(1, [2, 0, 1], [0.3, 0.3, 0.4], [1, 2, 0], [0.8, 0.1, 0.1], id_target=2,
                       uniform=uniforms(0.9, 0.9))  # u = .27: .27-.2 = .07 > 0, .07-.1 <= 0 -> 0
    assert d.token == 0


def test_tokens_outside_q_keep_all_their_probability():
    d = rejection_step(3, [3, 9], [0.1, 0.9], [3], [1.0], id_target=3, uniform=uniforms(0.5, 0.99))
    assert not d.accepted and d.token == 9


def test_a_draft_token_outside_q_is_rejected_without_an_accept_draw():
    d = rejection_step(4, [4, 5], [0.5, 0.5], [5], [1.0], id_target=4, uniform=uniforms(0.3))
    assert not d.accepted and d.u_accept is None and d.u_residual == pytest.approx(0.3)
    assert d.token == 4  # residual {4: .5}


def test_empty_residual_falls_back_to_the_target_sample():
    d = rejection_step(1, [1, 2], [0.5, 0.5], [1, 2], [0.9, 0.6], id_target=2, uniform=uniforms(0.99))
    assert not d.accepted and d.token == 2 and d.u_residual is None


def test_sample_and_match_stops_at_a_mismatch_or_an_inner_eog():
    assert match_continues(5, 5, False, 0, 3)
    assert not match_continues(5, 6, False, 0, 3)
    assert not match_continues(7, 7, True, 0, 3)   # EOG before the last draft position
    assert match_continues(7, 7, True, 2, 3)       # EOG at the last position: the bonus follows
