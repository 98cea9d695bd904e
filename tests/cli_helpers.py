"""Running the command line in tests (click's CliRunner) and reading its errors.

CliRunner never prints a traceback: an exception that escapes a command is kept in
`result.exception`. A clean user-facing failure is a SystemExit with a non-zero code after
exactly one `Error: ...` line; anything else is a crash."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner, Result

from replay.cli import main


def run(*args, input: str | None = None) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def clean_exit(result: Result) -> bool:
    """The command ended through sys.exit / click's own exits, not an escaping exception."""
    return result.exception is None or isinstance(result.exception, SystemExit)


def one_error(result: Result) -> str:
    """The single `Error:` line of a failed command; fails on a crash or a zero exit."""
    assert clean_exit(result), f"crashed with {result.exception!r}\n{result.output}"
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def cli_command(*args) -> list[str]:
    """The command line that runs `spec-replay ARGS` in a fresh process (a process holds one libllama)."""
    return [sys.executable, "-m", "replay.cli", *map(str, args)]


def recover_in_subprocess(src: Path, model: Path, out: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command("recover", src, "-m", model, "-o", out, *extra),
                          capture_output=True, text=True, timeout=600)


def tiny_jsonl(path: Path, n: int) -> Path:
    """`n` independent records: the tiny fixture's committed draft-simple transcript, pre- and
    post-sampling, as one JSONL."""
    from replay.paths import FIXTURES
    one = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    post = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple-post.json").read_text())
    path.write_text("".join(json.dumps(one if k % 3 else post) + "\n" for k in range(n)))
    return path


# The committed repaired twins were written on an AVX-512 machine; on an AVX2 one the tiny f32
# fixtures' values differ by up to 5.2e-5 (measured 2026-12-01, every committed transcript; the CPU
# kernels of the two classes sum in other orders). Everything else must be byte for byte.
KERNEL_CLASS_DIFF = 1e-4
_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def same_repair(got: str, twin: str, tol: float = KERNEL_CLASS_DIFF) -> str | None:
    """None when `got` is `twin` byte for byte outside its decimal numbers and every number is within
    `tol`; else what differs."""
    if _NUMBER.sub("#", got) != _NUMBER.sub("#", twin):
        return "the files differ outside their numbers"
    a, b = [float(x) for x in _NUMBER.findall(got)], [float(x) for x in _NUMBER.findall(twin)]
    worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return None if worst <= tol else f"a value differs by {worst:.2e} (> {tol})"
