"""The verifier's expected acceptance (loop/expectation.py) and the work a speed model prices
(loop/work.py), on the tiny fixtures' speculative loop at temperature 1.

The expectation is exact given each draft: a[j] is the probability that the verifier keeps draft token j
once the ones before it were kept. So where the server's verification itself computed that probability
(the rows it verified), a[j] must equal it: p(d[j]) under sample-and-match, min(1, p/q) under the rejection
rule. And over many drafts the counted acceptance of the first draft position is a sum of independent
Bernoulli(a[0]) draws: it must lie within three standard deviations of the expectation.
"""
from __future__ import annotations

import math

import pytest

from replay.commands.trace import trace_prompt
from replay.paths import FIXTURES
from replay.runtime.llama import Model
from replay.tuning.runs import Expected, fresh_drafts

MODEL, DRAFT = FIXTURES / "tiny-target.gguf", FIXTURES / "tiny-draft.gguf"
SEEDS = range(1, 9)


@pytest.fixture(scope="module")
def target():
    m = Model(MODEL)
    yield m
    m.close()


def _runs(target, sampling: str):
    flags = {"draft_model": str(DRAFT), "spec_types": ("draft-simple",), "temp": 1.0, "n_predict": 48,
             "draft_sampling": sampling}
    return [trace_prompt(target, "bcdbcdbcd", flags={**flags, "seed": s}, build=11434, expect=True) for s in SEEDS]


@pytest.fixture(scope="module")
def matched(target):
    return _runs(target, "greedy")


@pytest.fixture(scope="module")
def rejected(target):
    return _runs(target, "probabilistic")


def test_under_sample_and_match_a_verified_positions_acceptance_is_the_targets_p_of_the_draft_token(matched):
    drafts = [s for r in matched for s in fresh_drafts(r.steps)]
    assert drafts and {s.rule for s in drafts} == {"sample-and-match"}
    for s in drafts:
        assert len(s.accept_p) == len(s.draft)
        assert s.accept_p[:len(s.target_p)] == pytest.approx(s.target_p, abs=1e-6)


def test_under_the_rejection_rule_it_is_p_over_q_capped_at_one(rejected):
    drafts = [s for r in rejected for s in fresh_drafts(r.steps)]
    assert drafts and {s.rule for s in drafts} == {"rejection"}
    for s in drafts:
        want = [min(1.0, p / q) if q > 0 else 0.0 for p, q in zip(s.target_p, s.draft_q)]
        assert s.accept_p[:len(want)] == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("rule", ["matched", "rejected"])
def test_the_first_positions_counted_acceptance_lies_within_three_deviations_of_its_expectation(rule, request):
    drafts = [s for r in request.getfixturevalue(rule) for s in fresh_drafts(r.steps)]
    a0 = [s.accept_p[0] for s in drafts]
    counted = sum(s.accepted > 0 for s in drafts)
    sd = math.sqrt(sum(a * (1 - a) for a in a0))
    assert len(drafts) >= 10 and abs(counted - sum(a0)) <= 3 * sd + 1e-9, (counted, sum(a0), sd)


def test_the_expectation_sums_each_drafts_running_products(matched):
    res = matched[0]
    e = Expected.of(res.steps, "this run")
    want = 0.0
    for s in fresh_drafts(res.steps):
        run = 1.0
        for a in s.accept_p:
            run *= a
            want += run
    assert e.accepted == pytest.approx(want) and e.drafted == sum(len(s.draft) for s in fresh_drafts(res.steps))


def test_the_generation_work_is_every_step_after_the_first_token(matched):
    """timings.predicted_ms spans the steps after the first token: one target decode each, of 1 + draft rows;
    the draft model decodes each drafted position it went on from and mirrors each verify batch."""
    for res in matched:
        w, steps = res.work, res.steps[1:]
        assert w.steps == len(steps) and w.tokens == len(res.emitted)
        assert sum(b * n for b, n in w.target_batches.items()) == sum(1 + len(s.draft) for s in steps)
        assert w.target_samples >= len(res.emitted) - 1
        assert res.decodes["target"][0] == w.steps + 1  # the prompt's one decode besides
