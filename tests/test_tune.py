"""`spec-replay tune` replays the transcript's traffic under other speculative settings (commands/tune.py).

Quick tier: the committed b11434 transcripts and the tiny fixtures. The transcript's own settings must
reproduce its draft totals exactly before anything else is reported; other settings change how many
decodes the same traffic takes. Real servers' traffic: tests/test_tune_live.py.
"""
from __future__ import annotations

import copy
import json

import pytest
from cli_helpers import one_error, run

from replay.run.tune import tune
from replay.paths import FIXTURES
from replay.tuning.sweep import sweep

MODEL, DRAFT = FIXTURES / "tiny-target.gguf", FIXTURES / "tiny-draft.gguf"
T = FIXTURES / "transcripts" / "tiny-draft-simple.json"


def _tune(path, varies):
    """The Python API, started as the command line starts a run (run/tune.py)."""
    return tune(path, MODEL, varies, flags={"draft_model": str(DRAFT)})


def test_the_baseline_is_the_transcripts_own_draft_totals():
    runs = _tune(T, ["--spec-draft-n-max=1,8"])
    base = runs[0]
    recorded = json.loads(T.read_text())["response"]["timings"]
    assert base.setting.spelled == "as recorded"
    assert (base.total("drafted"), base.total("accepted")) == (recorded["draft_n"], recorded["draft_n_accepted"]) == (36, 7)
    assert base.records[0].emitted == tuple(json.loads(T.read_text())["response"]["tokens"])


def test_the_draft_length_changes_the_decodes_not_the_tokens_under_sample_and_match():
    """Greedy drafting is verified by sample-and-match: the target's own draws, whatever was drafted."""
    runs = {r.setting.spelled: r for r in _tune(T, ["--spec-draft-n-max=1,2,8"])}
    one, two, eight = (runs[f"--spec-draft-n-max {n}"] for n in (1, 2, 8))
    assert all(r.records[0].same_tokens is True for r in (one, two, eight))
    assert [r.total("drafted") for r in (one, two, eight)] == [13, 24, 82]
    assert [r.target_decodes for r in (one, two, eight)] == [14, 13, 12]  # the prompt's decode included
    assert max(len(r.records[0].tried) for r in (one, two, eight)) == 8
    assert one.by_position() == [6 / 13]
    assert eight.records[0].draft[0] > two.records[0].draft[0] > one.records[0].draft[0] > 0


def test_an_ngram_type_that_finds_nothing_drafts_nothing():
    runs = {r.setting.spelled: r for r in _tune(T, ["--spec-type=ngram-simple"])}
    r = runs["--spec-type ngram-simple"]
    assert (r.total("drafted"), r.records[0].draft) == (0, (0, 0))
    assert r.target_decodes == r.tokens  # one decode per token: the prompt's, then one per step


def test_a_probabilistic_draft_at_temperature_1_is_one_sampled_run_per_setting():
    runs = _tune(FIXTURES / "transcripts" / "tiny-completion-grammar-probabilistic.json",
                 ["--spec-draft-n-max=1,8"])
    rec = runs[0].records[0]
    assert not rec.exact and rec.to_json()["counts"] == "one sampled run (the request's seed)"
    assert (runs[0].total("drafted"), runs[0].total("accepted")) == (46, rec.accepted)


def test_a_transcript_its_own_settings_do_not_reproduce_is_refused(tmp_path):
    t = copy.deepcopy(json.loads(T.read_text()))
    t["response"]["timings"]["draft_n"] = 35
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    msg = one_error(run("tune", p, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-draft-n-max=2"))
    assert "own settings do not reproduce it (its draft totals differ" in msg and "record 1" in msg


@pytest.mark.parametrize("vary,words", [
    ("--temp=0.5", "--temp is not a setting of the speculative loop"),
    ("--spec-draft-n-max", "give FLAG=V1,V2"),
    ("--spec-draft-n-max=two", "--spec-draft-n-max"),
    ("--spec-drat-n-max=2", "not a flag of llama-server"),
    ("--spec-draft-model=x.gguf", "not a setting of the speculative loop"),
])
def test_a_bad_vary_is_a_usage_error_in_one_line(vary, words):
    r = run("tune", T, "-m", MODEL, "--vary", vary)
    assert r.exit_code == 2 and words in r.output and r.output.count("Error") == 1, r.output


def test_the_grid_is_every_combination_once():
    s = sweep(["--spec-draft-n-max=2,4", "--spec-type=ngram-mod,draft-simple+ngram-mod"])
    assert [x.spelled for x in s] == ["as recorded", "--spec-draft-n-max 2 --spec-type ngram-mod",
                                      "--spec-draft-n-max 2 --spec-type draft-simple,ngram-mod",
                                      "--spec-draft-n-max 4 --spec-type ngram-mod",
                                      "--spec-draft-n-max 4 --spec-type draft-simple,ngram-mod"]


def test_the_command_prints_a_ranked_table_and_json():
    r = run("tune", T, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-draft-n-max=1,8")
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("as recorded", "--spec"))]
    assert lines[0].startswith("as recorded") and lines[1].startswith("--spec-draft-n-max 8")  # fewest decodes first
    assert "one run with the request's seed" in r.stderr and "note:" not in r.stdout  # notes on stderr
    d = json.loads(run("tune", T, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-draft-n-max=1,8", "--json").stdout)
    assert d["format"] == "spec-replay-tune" and [s["drafted"] for s in d["settings"]] == [36, 13, 82]


@pytest.mark.processes
def test_workers_replay_the_settings_in_processes_and_report_the_same_bytes():
    args = ("tune", T, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-draft-n-max=1,2,8", "--json")
    one, two = run(*args), run(*args, "--workers", "2")
    assert one.exit_code == two.exit_code == 0, two.output
    assert one.stdout == two.stdout and len(json.loads(two.stdout)["settings"]) == 4


def test_samples_add_runs_with_the_next_seeds_and_give_a_mean_with_its_interval():
    d = json.loads(run("tune", T, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-draft-n-max=2", "--samples", "5",
                       "--json").stdout)
    seed = json.loads(T.read_text())["request"]["seed"]
    base = d["settings"][0]
    rec = base["records"][0]
    assert [s["seed"] for s in rec["samples"]] == [seed + 1, seed + 2, seed + 3, seed + 4]
    assert (rec["drafted"], rec["accepted"]) == (36, 7)  # run 0 is the recorded one, reproduced
    runs = [7 / 36] + [s["accepted"] / s["drafted"] for s in rec["samples"]]
    assert len(set(runs)) > 1  # other seeds, other texts
    acc = base["samples"]["acceptance"]
    assert acc["runs"] == 5 and acc["mean"] == pytest.approx(sum(runs) / 5)
    low, high = acc["interval_95"]
    assert min(runs) <= low <= acc["mean"] <= high <= max(runs)


def test_the_expectation_is_the_verifiers_along_the_recorded_tokens_where_a_setting_emits_them():
    runs = _tune(T, ["--spec-draft-n-max=1,8"])
    for run_ in runs:
        rec = run_.records[0]
        assert rec.expected is not None and rec.expected.along == "the recorded tokens"
        assert rec.expected.drafted == rec.drafted and 0 < rec.expected.accepted < rec.expected.drafted
    grammar = _tune(FIXTURES / "transcripts" / "tiny-completion-grammar-probabilistic.json",
                    ["--spec-draft-n-max=1"])
    assert grammar[0].records[0].expected is None
    assert grammar[0].records[0].no_expectation == "a grammar resamples what it rejects"


def test_a_setting_the_loop_cannot_run_is_refused_before_anything_is_replayed(monkeypatch):
    import replay.run.tune as tune_mod
    ran = []
    monkeypatch.setattr(tune_mod, "run_setting", lambda *a, **k: ran.append(a) or pytest.fail("replayed"))
    msg = one_error(run("tune", T, "-m", MODEL, "-md", DRAFT, "--vary", "--spec-type=ngram-mod,draft-eagle3"))
    assert "Error: setting '--spec-type draft-eagle3'" in msg and "cannot be replayed" in msg and not ran
