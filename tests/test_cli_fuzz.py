"""Fuzzing the command line (tests/cli_fuzz.py, in a process of its own): whatever a user types,
every command ends with a documented exit code and at most one `Error:` line, never a traceback,
an internal error or a crash of the process (an abort inside libllama)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CASES = int(os.environ.get("SPEC_REPLAY_CLI_FUZZ_CASES", "200"))


def test_no_command_line_crashes(tmp_path):
    work = tmp_path / "cwd"  # relative paths the fuzzer types land here, never in the checkout
    work.mkdir()
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("cli_fuzz.py")), str(tmp_path), str(CASES)],
                       capture_output=True, text=True, timeout=1800, cwd=work,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                                       os.environ.get("PYTHONPATH")]))})
    current = tmp_path / "current.json"
    running = json.loads(current.read_text()) if current.exists() else None
    assert p.returncode == 0, (f"exit {p.returncode} while running spec-replay {running!r}\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
