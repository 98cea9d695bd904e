"""One report schema (docs/report-format.md): every field a real report carries is documented there,
reports open with their format and version, and a non-finite number anywhere is written as the page
says (the strings "inf", "-inf", "nan"), never a crash and never invalid JSON."""
from __future__ import annotations

import json
import math
import re

import pytest

from cli_helpers import run

from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES, REPO_ROOT
from replay.report import schema
from replay.report.recovery import RecordReport, RecoverResult

DOC = (REPO_ROOT / "docs" / "report-format.md").read_text()
T = FIXTURES / "transcripts" / "tiny-draft-simple.json"


def _documented() -> set[str]:
    """Every field name the page's tables list: each backticked name in a table row (a row's first column
    names its field; the fields of an object it holds are named in its meaning)."""
    names = set()
    for line in DOC.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([a-z_0-9]+)`", line))
    return names


def _keys(obj, skip=("probes", "props", "schedule")) -> set[str]:
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(k)
            if k not in skip:
                out |= _keys(v, skip)
    elif isinstance(obj, list):
        for v in obj:
            out |= _keys(v, skip)
    return out


def test_every_field_of_a_real_recover_report_is_documented():
    r = run("diff", T, "-m", tiny_target(), "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert (rep["format"], rep["version"]) == ("spec-replay-report", schema.REPORT_VERSION)
    undocumented = _keys(rep) - _documented()
    assert not undocumented, undocumented


def test_every_field_of_a_real_trace_report_is_documented():
    r = run("trace", T, "-m", tiny_target(), "-md", tiny_draft(), "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert (rep["format"], rep["version"]) == ("spec-replay-trace", schema.REPORT_VERSION)
    undocumented = _keys(rep, skip=("probes", "kernels", "divergence")) - _documented()
    assert not undocumented, undocumented


def test_a_failed_run_carries_its_reason_in_the_report(tmp_path):
    """--tolerance 0 on a first entry the bundled kernels compute 1e-7 apart still passes exactly or
    fails with failure.line; either way the file is strict JSON."""
    r = run("diff", T, "-m", tiny_target(), "--json", "--report", tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["records"][0]["model"]["compared"][0]["verdict"] == "same"
    assert rep["records"][0]["numerics"]["libllama"], "the libllama in use is always named"
    assert r.exit_code == 0


def _report_with(value: float) -> RecoverResult:
    rec = RecordReport("t.json", 1, "/completion", False, "prob", 3,
                       cpu={"variant": "zen4", "how": "matched", "probes": {"piledriver": value, "zen4": 0.0}})
    return RecoverResult([rec], "")


def test_non_finite_numbers_are_written_as_the_page_says():
    """The seed's case: a variant's probe distance is inf (the emitted token fell outside its
    post-sampling candidates); the report writer failed with "Out of range float values are not JSON
    compliant: inf" (exit 70). Now every writer goes through schema.dumps."""
    for value, text in ((math.inf, "inf"), (-math.inf, "-inf"), (math.nan, "nan")):
        out = schema.dumps(_report_with(value).to_json())
        back = json.loads(out)  # strict JSON: no Infinity/NaN tokens
        assert back["records"][0]["numerics"]["cpu"]["probes"]["piledriver"] == text
        assert "Infinity" not in out and "NaN" not in out
        got = schema.from_json_number(back["records"][0]["numerics"]["cpu"]["probes"]["piledriver"])
        assert (math.isnan(got) if value != value else got == value)


def test_the_page_of_a_report_with_inf_is_written_too():
    from replay.report.pages import recover_page
    html = recover_page(_report_with(math.inf))
    assert "Infinity" not in html and "</html>" in html


def test_recover_writes_a_report_whose_probe_distance_is_inf(tmp_path, monkeypatch):
    """The same through the command: the kernels chosen with one variant's distance inf, as the seed's
    default-flag Gemma 3 server gave (piledriver), and `--report` and `--json` both strict JSON."""
    import replay.run.engine as engine_mod
    from replay.run.kernels.policy import Kernels
    from replay.runtime.engine import KernelChoice
    choice = KernelChoice(None, "matched", 0.0, 0, diffs=(("zen4", 0.0), ("piledriver", math.inf)))
    monkeypatch.setattr(engine_mod, "choose_kernels", lambda *a, **k: Kernels(choice, None))
    r = run("recover", T, "-m", tiny_target(), "-o", tmp_path / "out.json", "--report", tmp_path / "r.json", "--json")
    assert r.exit_code == 0, r.output
    for text in ((tmp_path / "r.json").read_text(), r.stdout):
        assert json.loads(text)["records"][0]["numerics"]["cpu"]["probes"]["piledriver"] == "inf"


@pytest.mark.parametrize("shared,kernels,slots,kind", [
    ("a 4-slot server (/props total_slots)", None, 4, "batch composition"),
    (None, "the server computed on a GPU", None, "kernels"),  # unknown slots: still only kernels
    ("it ran at the same time as record 2 (their created and timings overlap)", "the server computed on a GPU", 1,
     "batch composition and kernels"),  # overlapping records on a server that says one slot
])
def test_numerics_cause_names_the_evidence_its_text_gives(shared, kernels, slots, kind):
    """numerics.cause and numerics.why come from the same evidence; the name was once re-derived from
    the slot count and could contradict the text (kernels on an unknown slot count read "batch
    composition and kernels")."""
    from replay.comparison.judgement import numerics_cause, numerics_kind
    rec = RecordReport("t.json", 1, "/completion", False, "logprob", 3, slots=slots, kernels=kernels,
                       cause=numerics_cause(shared, kernels), cause_kind=numerics_kind(shared, kernels), batched=True)
    num = rec.to_json()["numerics"]
    assert num["cause"] == kind and num["why"] == numerics_cause(shared, kernels)
