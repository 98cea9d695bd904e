"""A run says little at the default verbosity: README command 1 prints one short `libllama:` line and at
most one short `kernels:` line on stderr (the candidates probed, one line each, only under -v), no stderr
line over 160 characters, and stdout carries only the report (notes go to stderr)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from replay.paths import FIXTURES

T = FIXTURES / "transcripts" / "tiny-draft-simple.json"
README_1 = ("recover", T, "-m", FIXTURES / "tiny-target.gguf", "--force")


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def _quiet(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stderr.splitlines()
    assert [line for line in lines if len(line) > 160] == []
    assert sum(line.startswith("libllama:") for line in lines) == 1, p.stderr
    assert sum(line.startswith("kernels:") for line in lines) <= 1, p.stderr
    assert not any(line.startswith("  ") for line in lines), p.stderr  # no candidate's line
    assert "note:" not in p.stdout


def test_readme_command_1_is_quiet_with_nothing_built(tmp_path):
    _quiet(_run(*README_1, "-o", tmp_path / "fixed.json", "--html", tmp_path / "page.html"))


@pytest.mark.build
def test_readme_command_1_is_quiet_where_every_cpu_variant_is_probed_and_says_them_under_v(b11434, tmp_path):
    """Before, this printed 5 stderr lines, two of 528 and 658 characters naming 26 candidates."""
    args = (*README_1, "-o", tmp_path / "fixed.json", "--libllama", b11434.bin_dir)
    _quiet(_run(*args))
    loud = _run(*args, "-v").stderr.splitlines()
    assert any(line.startswith("kernels: evaluating the first entry") for line in loud)
    assert any(line.startswith("  ") and "nats off (record 1)" in line for line in loud)
