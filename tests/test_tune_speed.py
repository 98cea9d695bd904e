"""tune's speed model: a cost table prices the generation phase's work (tuning/costs.py), measured on this
host (tuning/measure.py) or fitted to the transcript's timings (tuning/calibrate.py).

Quick tier: the pricing and the fit on known work, and the measured table on the tiny fixtures. Whether
the predictions match real servers is a benchmark (bench/tune_speed.py, docs/tune.md), not a timed test.
"""
from __future__ import annotations

import json

import pytest
from cli_helpers import run

from replay.errors import TranscriptError
from replay.loop.work import Work
from replay.paths import FIXTURES
from replay.tuning.calibrate import Timed, fit, scale, usable
from replay.tuning.costs import CostTable, at_size, plain, tokens_per_second

MODEL, DRAFT = FIXTURES / "tiny-target.gguf", FIXTURES / "tiny-draft.gguf"
T = FIXTURES / "transcripts" / "tiny-draft-simple.json"


def _work(steps: list[int], draft_decodes: int = 0) -> Work:
    """Steps that decode `rows` rows each; tokens = steps + 1 as with nothing rejected."""
    tb: dict[int, int] = {}
    for b in steps:
        tb[b] = tb.get(b, 0) + 1
    return Work(tb, {1: draft_decodes} if draft_decodes else {}, sum(steps), draft_decodes, sum(steps) + 1)


def test_no_speculation_is_one_decode_of_one_row_and_one_sample_per_token_after_the_first():
    table = CostTable({1: 8.0, 4: 11.0}, {1: 1.0}, target_sample=2.0, draft_sample=0.5)
    w = _work([4, 4, 4], draft_decodes=9)
    assert plain(w) == Work({1: 12}, {}, 12, 0, 13)
    assert table.time_ms(plain(w)) == 12 * (8.0 + 2.0)
    # 3 decodes of 4 rows, 9 draft decodes, 12 samples, 9 draft samples
    assert table.time_ms(w) == 3 * 11.0 + 9 * 1.0 + 12 * 2.0 + 9 * 0.5
    assert tokens_per_second([w], table) == pytest.approx(1000 * 12 / 70.5)


def test_a_batch_size_the_table_lacks_is_interpolated_between_its_neighbours():
    assert at_size({1: 10.0, 3: 14.0, 9: 20.0}, 6) == 17.0 and at_size({1: 10.0, 3: 14.0}, 5) == 18.0


def test_the_fit_recovers_the_costs_that_made_the_timings():
    works = [_work([1] * a + [3] * b + [5] * c, draft_decodes=d)
             for a, b, c, d in [(1, 2, 3, 4), (3, 1, 0, 9), (0, 4, 2, 2), (5, 0, 1, 7), (2, 2, 2, 11), (4, 3, 1, 0)]]
    timed = [Timed(w, 3.0 * w.steps + 0.5 * sum((b - 1) * n for b, n in w.target_batches.items())
                   + 1.25 * sum(w.draft_batches.values())) for w in works]
    t = fit(timed)
    assert t.target[1] == pytest.approx(3.0) and t.target[5] == pytest.approx(5.0) and t.draft[1] == pytest.approx(1.25)
    assert all(t.time_ms(x.work) == pytest.approx(x.ms) for x in timed) and "rms error 0.0%" in t.source


def test_timings_too_few_or_too_alike_to_fit_are_refused_in_words():
    w = _work([2, 2])
    with pytest.raises(TranscriptError, match="at least 4"):
        fit([Timed(w, 10.0)] * 3)
    with pytest.raises(TranscriptError, match="no cost per target decode"):
        fit([Timed(Work({}, {1: 3}, 0, 3, 1), 10.0), Timed(Work({}, {1: 5}, 0, 5, 1), 12.0)] * 2)
    # one setting's traffic: every step drafted as many tokens, so decodes, rows and draft decodes rise together
    # (as in eight real SmolLM2 records: tests/test_tune_live.py)
    alike = [Timed(_work([4] * n, draft_decodes=4 * n), 7.0 * n) for n in (10, 6, 8, 10, 9)]
    with pytest.raises(TranscriptError, match="work too alike .*--measure"):
        fit(alike)


def test_a_measured_table_is_scaled_to_the_servers_total_time():
    here = CostTable({1: 10.0}, target_sample=0.0, source="measured")
    timed = [Timed(_work([1] * 4), 30.0), Timed(_work([1] * 2), 30.0)]
    t = scale(here, timed)
    assert t.scale == pytest.approx(60.0 / 60.0 * 1.0) and "scaled x1.000 to the transcript's timings (2 records)" in t.source
    assert scale(here, [Timed(_work([1] * 3), 60.0)]).time_ms(_work([1] * 3)) == pytest.approx(60.0)


def test_timings_of_shared_batches_or_other_tokens_do_not_calibrate():
    w = _work([2, 2])
    assert usable(w, {"predicted_n": 5, "predicted_ms": 9.0}, None) == Timed(w, 9.0)
    assert usable(w, {"predicted_n": 5, "predicted_ms": 9.0}, "a 4-slot server (/props total_slots)") is None
    assert usable(w, {"predicted_n": 4, "predicted_ms": 9.0}, None) is None
    assert usable(w, None, None) is None


def test_measure_prices_every_batch_size_the_sweep_decodes_on_this_host():
    r = run("tune", T, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-draft-n-max=1,8", "--measure", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    model = d["speed_model"]
    sizes = {int(b) for s in d["settings"] for rec in s["records"] for b in rec["generation"]["target_batches"]}
    assert sizes <= {int(b) for b in model["target_decode_ms"]} and max(sizes) == 9  # n-max 8: the last token + 8
    assert all(v > 0 for v in model["target_decode_ms"].values()) and model["draft_sample_ms"] > 0
    assert model["source"].startswith("measured on this host") and "scaled" in model["source"]  # it has timings
    for s in d["settings"]:
        assert s["predicted"]["tokens_per_second"] > 0 and s["predicted"]["speedup"] > 0


def test_without_measure_one_record_is_too_few_to_fit_and_the_table_says_so():
    r = run("tune", T, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-draft-n-max=1,8")
    assert r.exit_code == 0 and "no speed prediction" in r.stderr and "at least 4" in r.stderr, r.output
    assert "ranked by target decodes per token" in r.stdout
