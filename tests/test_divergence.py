"""Why a trace diverged (comparison/divergence.py): a draw within the numeric difference of a boundary
(numerics), or anything else (the loop). The draw is the target chain's own: checked here against
libllama's dist sampler, so the figures in a divergence report are the server's."""
from __future__ import annotations

import numpy as np
import pytest

from replay.comparison.divergence import admitted, dist_draw, explain_greedy, explain_rejection, explain_sampled
from replay.llamacpp.models import tiny_target
from replay.runtime.llama import Model
from replay.runtime.sampler import SamplerChain
from replay.settings.sampling import SamplingParams

IDS = np.array([5, 6, 7])
P = np.array([0.5, 0.3, 0.2], dtype=np.float32)


def test_a_draw_near_the_boundary_to_the_servers_token_is_numerics():
    # intervals: 5 [0, .5), 6 [.5, .8), 7 [.8, 1); u = .79 picked 6, .01 below 7's interval
    e = explain_sampled(IDS, P, 0.79, ours=6, theirs=7, noise=0.05)
    assert e.cause == "numerics" and "lies 0.010000 from the server's token" in e.text


def test_a_draw_far_from_it_is_the_loop():
    e = explain_sampled(IDS, P, 0.60, ours=6, theirs=7, noise=0.05)
    assert e.cause == "loop" and e.text.startswith("not a near tie")


def test_a_token_the_chain_removed_is_the_loop():
    assert explain_sampled(IDS, P, 0.6, ours=6, theirs=3, noise=0.05).cause == "loop"


def test_greedy_near_ties_and_rejection_draws():
    assert explain_greedy(-0.70, -0.72, 0.05).cause == "numerics"
    assert explain_greedy(-0.70, -1.50, 0.05).cause == "loop"
    assert explain_rejection(0.401, p=0.2, q=0.5, noise=0.05).cause == "numerics"  # p/q 0.4
    assert explain_rejection(0.9, p=0.2, q=0.5, noise=0.05).cause == "loop"


@pytest.mark.parametrize("seed", [1, 7, 42, 12345])
def test_the_draw_is_libllamas_dist_draw(seed):
    """A chain of dist only, over fixed logits, for several passes: the token it picks is the one whose
    cumulative-p interval holds our reconstruction of its draw."""
    with Model(tiny_target()) as m:
        chain = SamplerChain(m, SamplingParams(samplers=(), seed=seed))
        logits = np.array([0.1, 1.2, -0.3, 0.8, 0.0, 0.5, 1.0, -1.0], dtype=np.float32)
        try:
            for ordinal in range(1, 6):
                cands, sel = chain.apply(logits)
                u = dist_draw(seed, ordinal)
                order = np.argsort(cands["id"])  # dist scans the array as the chain left it: id order here
                cum = np.cumsum(cands["p"][order].astype(np.float64))
                picked = int(cands["id"][order][np.searchsorted(cum, u * cum[-1])])
                assert picked == int(cands["id"][sel])
        finally:
            chain.close()


def test_near_ties_in_the_order_can_swap_two_intervals():
    """p 0.36 and 0.34 sit within e^(2 * 0.05) of each other: the server's array may hold them in
    either order, so a draw at 0.30 (inside the first interval here) can fall in the other's."""
    ids, p = np.array([1, 2, 3]), np.array([0.36, 0.34, 0.30], dtype=np.float32)
    assert explain_sampled(ids, p, 0.30, ours=1, theirs=2, noise=0.05).cause == "numerics"
    assert explain_sampled(ids, p, 0.30, ours=1, theirs=2, noise=0.001).cause == "loop"


def test_a_trace_token_outside_the_kept_candidates_still_gets_an_explanation():
    e = explain_sampled(IDS, P, 0.79, ours=99, theirs=7, noise=0.05)
    assert e.cause == "numerics" and "outside the kept candidates" in e.text


def test_a_token_the_chain_cut_near_the_boundary_can_be_the_servers_draw():
    """top-k kept 5 and 6; 7's logit lies 0.08 below 6's, so with every logit off by 0.05 the server's
    chain may have kept 7 in 6's place (admitted), and a draw near the end of the row then falls in
    7's interval. 0.2 below, it is out of reach: the loop."""
    raw = {5: 1.0, 6: 0.49, 7: 0.41}
    ids, p = np.array([5, 6]), np.array([0.625, 0.375], dtype=np.float32)
    wide = admitted(ids, p, 7, raw, temp=1.0, noise=0.05)
    assert wide is not None and wide[0].tolist() == [5, 6, 7] and abs(wide[2] - 0.08) < 1e-9
    e = explain_sampled(*wide[:2], 0.99, ours=6, theirs=7, noise=0.05)
    assert e.cause == "numerics"
    assert explain_sampled(*wide[:2], 0.30, ours=5, theirs=7, noise=0.05).cause == "loop"
    assert admitted(ids, p, 7, {5: 1.0, 6: 0.49, 7: 0.29}, temp=1.0, noise=0.05) is None
    assert admitted(ids, p, 7, {5: 1.0, 7: 0.41}, temp=1.0, noise=0.05) is None  # a kept logit unknown
