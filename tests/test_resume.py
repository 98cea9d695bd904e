"""A killed or interrupted multi-record `recover` loses nothing, and `--resume` finishes it.

Finished records go to OUT.partial one whole line at a time; OUT appears only when
the run completes. A kill at a random record, then `--resume`, must give exactly the
bytes of an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay.errors import Exit
from replay.llamacpp.models import tiny_target
from replay.paths import FIXTURES

pytestmark = pytest.mark.processes

N_RECORDS = 120


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory) -> Path:
    one = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    post = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple-post.json").read_text())
    p = tmp_path_factory.mktemp("resume") / "evals.jsonl"
    p.write_text("".join(json.dumps(one if k % 2 == 0 else post) + "\n" for k in range(N_RECORDS)))
    return p


def _cmd(*args) -> list[str]:
    return [sys.executable, "-m", "replay.cli", *map(str, args)]


def _recover(src: Path, out: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd("recover", src, "-m", tiny_target(), "-o", out, *extra),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(big_jsonl, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("full") / "out.jsonl"
    r = _recover(big_jsonl, out)
    assert r.returncode == 0, r.stderr
    return out.read_bytes()


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_an_interrupted_run_resumes_to_the_same_bytes(big_jsonl, uninterrupted, tmp_path, sig):
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    stop_after = random.Random(sig).randrange(5, N_RECORDS - 20)
    # SIGINT as a terminal sends it, whatever the test runner inherited (a shell's background job
    # starts with SIGINT ignored, and Python then never installs its KeyboardInterrupt handler)
    p = subprocess.Popen(_cmd("recover", big_jsonl, "-m", tiny_target(), "-o", out),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while _lines(partial) < stop_after and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert p.poll() is None, "the run finished before it could be interrupted"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert p.returncode == Exit.INTERRUPTED and err.strip().splitlines()[-1] == "Interrupted."
    assert not out.exists()  # no output until the run completes
    kept = partial.read_bytes()
    assert kept.count(b"\n") >= stop_after
    assert uninterrupted.startswith(kept[:kept.rfind(b"\n") + 1])  # only whole, finished records

    again = _recover(big_jsonl, out)  # without --resume: refuses, keeps the partial run
    assert again.returncode == Exit.ERROR and "--resume" in again.stderr
    assert partial.read_bytes() == kept

    r = _recover(big_jsonl, out, "--resume")
    assert r.returncode == 0, r.stderr
    assert "finished earlier" in r.stderr
    assert out.read_bytes() == uninterrupted
    assert not partial.exists() and not (tmp_path / "out.jsonl.partial.json").exists()


def test_a_torn_last_line_is_cut_and_redone(big_jsonl, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    first = uninterrupted.split(b"\n")
    r = _recover(big_jsonl, out)
    assert r.returncode == 0
    # simulate a kill in the middle of writing record 4
    out.rename(tmp_path / "full.jsonl")
    meta_run = subprocess.Popen(_cmd("recover", big_jsonl, "-m", tiny_target(), "-o", out),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while _lines(tmp_path / "out.jsonl.partial") < 1 and meta_run.poll() is None:
        time.sleep(0.005)
    meta_run.kill()
    meta_run.communicate()
    (tmp_path / "out.jsonl.partial").write_bytes(b"\n".join(first[:3]) + b"\n" + first[3][:50])
    r = _recover(big_jsonl, out, "--resume")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == uninterrupted


def test_resume_refuses_a_partial_run_of_another_input(big_jsonl, tmp_path):
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(_cmd("recover", big_jsonl, "-m", tiny_target(), "-o", out),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while _lines(tmp_path / "out.jsonl.partial") < 2 and p.poll() is None:
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    other = tmp_path / "other.jsonl"
    other.write_text(big_jsonl.read_text().replace('"seed": 42', '"seed": 43', 1) + "\n")
    r = _recover(other, out, "--resume")
    assert r.returncode == Exit.ERROR
    assert r.stderr.strip().splitlines()[-1].startswith("Error: ") and "another input" in r.stderr
