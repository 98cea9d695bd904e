"""The distribution lab: which loops sample the target's own distribution (300 seeds).

On the tiny fixture after prompt "gfbdc" and prefix "e" the target's post-sampling
distribution is c 0.416, a 0.379, e 0.205, and the draft's top token is a. The server
(with or without speculation), our trace loop and the fixed example algorithm keep
that distribution; llama-speculative and our reimplementation of it do not (they emit
a every time), and they agree seed for seed, as do the server and trace.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.lab.distribution import Lab, example_binaries, run_lab
from replay.llamacpp.models import tiny_draft, tiny_target

pytestmark = [pytest.mark.build, pytest.mark.live_server]


@pytest.fixture(scope="module")
def lab_result(b11434):
    _, patched = example_binaries(None, "b11434")
    lab = Lab(tiny_target(), tiny_draft(), seeds=range(1, 301))
    return run_lab(lab, b11434.server, b11434.speculative, patched_speculative=patched)


def test_the_context_is_the_one_the_issue_asks_for(lab_result):
    ref = lab_result.reference
    assert len(ref) == 3 and min(ref.values()) >= 0.15  # the target's top-3 each >= 0.15
    pieces = lab_result.pieces
    assert {pieces[t]: round(p, 3) for t, p in ref.items()} == {"c": 0.416, "a": 0.379, "e": 0.205}
    # the server reports the same reference distribution (post_sampling_probs), bit for bit
    assert lab_result.server_reference == ref


@pytest.mark.parametrize("key", ["a", "b-greedy", "c-greedy", "f", "d-patched"])
def test_these_paths_preserve_the_distribution(lab_result, key):
    run = lab_result.path(key)
    assert run.runs >= 150  # ~70% of seeds draw the prefix first
    assert run.p_value > 0.01, (run.counts, run.p_value)
    assert run.verdict == "preserves"


@pytest.mark.parametrize("key", ["d", "e"])
def test_the_example_program_is_biased(lab_result, key):
    run = lab_result.path(key)
    assert run.p_value < 1e-6
    assert max(run.counts.values()) / run.runs >= 0.99  # one token (a) nearly always
    assert run.verdict == "BIASED"


def test_pairs_agree_seed_for_seed(lab_result):
    got = {(a, b): (same, n) for a, b, same, n in lab_result.agreements()}
    assert got == {("b-greedy", "c-greedy"): (300, 300), ("b-probabilistic", "c-probabilistic"): (300, 300),
                   ("d", "e"): (300, 300), ("d-patched", "f"): (300, 300)}


def test_the_servers_rejection_path_keeps_the_distribution(lab_result):
    # a finding, not a requirement: b11434's rejection sampling is unbiased here
    assert lab_result.path("b-probabilistic").p_value > 0.01


def test_dist_command_json(b11434):
    r = CliRunner().invoke(main, ["dist", "-n", "40", "--paths", "a,e,f", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output[r.output.index("{"):])
    assert [p["key"] for p in out["paths"]] == ["a", "e", "f"]
    assert out["paths"][1]["counts"] == {"a": out["paths"][1]["runs_with_prefix"]}


def test_unknown_path_is_a_usage_error():
    r = CliRunner().invoke(main, ["dist", "--paths", "a,z"])
    assert r.exit_code == 2 and "unknown path(s): z" in r.output
