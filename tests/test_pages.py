"""`trace --html` and `recover --html`: what the pages carry, checked against the same runs' --json
reports and the transcripts themselves (tiny committed fixtures, the real b11434 server's output).
The pages in a browser: tests/test_pages_browser.py."""
from __future__ import annotations

import json
import math
import re

import pytest
from cli_helpers import run

from replay.errors import Exit
from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES
from replay.transcripts.entries import sent_entries

TRANSCRIPTS = FIXTURES / "transcripts"
NOT_STREAMED = ["tiny-draft-simple.json", "tiny-draft-simple-post.json", "tiny-v1-chat.json",
                "tiny-v1-completions.json", "tiny-completion-grammar.json"]


def page_data(html: str) -> dict:
    """The JSON a page draws itself from (its only data)."""
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', html, re.S)
    assert m, "no data block"
    return json.loads(m.group(1))


def test_the_recover_page_carries_the_report_s_values(tmp_path):
    page, report = tmp_path / "r.html", tmp_path / "r.json"
    r = run("recover", TRANSCRIPTS / "tiny-draft-simple.json", "-m", tiny_target(), "-o", tmp_path / "out.json",
            "--html", page, "--report", report)
    assert r.exit_code == 0, r.output
    data = page_data(page.read_text())
    rec, want = data["records"][0], json.loads(report.read_text())["records"][0]
    assert rec["counts"] == want["summary"]["counts"] and rec["counts"]["placeholder"] == 19
    assert rec["true_mean"] == pytest.approx(want["summary"]["true_mean_logprob"], abs=1e-6)
    assert rec["server_mean"] == pytest.approx(want["summary"]["server_mean_logprob"], abs=1e-6)
    assert rec["server_ppl"] == pytest.approx(math.exp(-rec["server_mean"]), rel=1e-5)
    assert rec["true_ppl"] == pytest.approx(math.exp(-rec["true_mean"]), rel=1e-5)
    assert [(t["status"], t["server"], t["true"]) for t in rec["tokens"]] == [
        (t["status"], pytest.approx(t["server_logprob"], abs=1e-6) if t["server_logprob"] is not None else None,
         pytest.approx(t["true_logprob"], abs=1e-6)) for t in want["tokens"]]


@pytest.mark.parametrize("name", NOT_STREAMED)
def test_the_trace_page_marks_as_inside_the_loop_exactly_the_tokens_the_server_sent_placeholders_for(tmp_path, name):
    """Provenance is the loop's, placeholders are the server's: they must be the same tokens."""
    src = TRANSCRIPTS / name
    page = tmp_path / "t.html"
    r = run("trace", src, "-m", tiny_target(), "-md", tiny_draft(), "--html", page, "--json")
    assert r.exit_code == 0, r.output
    trace = json.loads(r.stdout)
    rec = page_data(page.read_text())["records"][0]
    assert rec["reproduced"] is True and len(rec["tokens"]) == len(trace["emitted"])
    kinds = [t["kind"] for t in rec["tokens"]]
    assert kinds.count("accepted") == trace["draft_n_accepted"]
    assert sum(s["drafted"] for s in rec["steps"]) == trace["draft_n"]
    t = json.loads(src.read_text())
    entries = sent_entries(t["endpoint"], t["response"])
    sent = [e.is_placeholder for e in entries]
    assert sent == [k != "outside" for k in kinds[:len(sent)]], (sent, kinds)


def test_a_resampled_token_carries_the_rejected_draft_and_its_values(tmp_path):
    page = tmp_path / "t.html"
    r = run("trace", TRANSCRIPTS / "tiny-draft-simple.json", "-m", tiny_target(), "-md", tiny_draft(),
            "--html", page, "--json")
    trace = json.loads(r.stdout)
    rec = page_data(page.read_text())["records"][0]
    steps = {s["index"]: s for s in trace["steps"]}
    resampled = [t for t in rec["tokens"] if t["kind"] == "resampled"]
    assert resampled
    for t in resampled:
        s = steps[t["step"]]
        assert t["id"] == s["resampled"] and t["rejected"] == s["draft"][s["accepted"]]
        assert t["p"] == pytest.approx(s["target_p"][s["accepted"]], abs=1e-6)


def test_an_existing_page_is_not_overwritten_and_a_page_is_never_the_transcript(tmp_path):
    page = tmp_path / "t.html"
    page.write_text("mine")
    r = run("trace", TRANSCRIPTS / "tiny-draft-simple.json", "-m", tiny_target(), "--html", page)
    assert r.exit_code == Exit.ERROR and "exists" in r.output and page.read_text() == "mine"
    src = tmp_path / "t.json"
    src.write_text((TRANSCRIPTS / "tiny-draft-simple.json").read_text())
    r = run("recover", src, "-m", tiny_target(), "-o", tmp_path / "o.json", "--html", src)
    assert r.exit_code == Exit.USAGE and json.loads(src.read_text())


def test_transcript_text_cannot_close_the_data_block(tmp_path):
    """A file name is transcript data too: `</script>` in it reaches the page only escaped."""
    (tmp_path / "<").mkdir()
    src = tmp_path / "<" / "script><img src=x onerror=alert(1)>.json"  # its path holds "</script><img ..."
    src.write_text((TRANSCRIPTS / "tiny-draft-simple.json").read_text())
    page = tmp_path / "r.html"
    r = run("diff", src, "-m", tiny_target(), "--html", page)
    assert r.exit_code == 0, r.output
    html = page.read_text()
    assert "<img" not in html and html.count("</script>") == 2  # the data block's and the script's own
    assert page_data(html)["records"][0]["where"].startswith(str(tmp_path) + "/</script><img")


def test_a_failed_recover_still_writes_its_page_to_show_where(tmp_path):
    """The replay disagrees with a real value the server sent: no repaired file, but the page shows
    the disagreeing token (exit 1)."""
    t = json.loads((TRANSCRIPTS / "tiny-draft-simple.json").read_text())
    t["response"]["completion_probabilities"][0]["logprob"] = -0.5
    src, out, page = tmp_path / "t.json", tmp_path / "out.json", tmp_path / "r.html"
    src.write_text(json.dumps(t))
    r = run("recover", src, "-m", tiny_target(), "-o", out, "--html", page)
    assert r.exit_code == Exit.FAILED and not out.exists()
    data = page_data(page.read_text())
    assert data["failure"].startswith("1 token(s) disagree with the server's real values")
    assert data["records"][0]["tokens"][0]["status"] == "mismatch" and data["records"][0]["tokens"][0]["server"] == -0.5
