"""Long multi-record runs show a progress bar on a terminal, and nothing on a pipe or a log."""
from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

from replay.llamacpp.models import tiny_target
from replay.paths import FIXTURES


def _jsonl(tmp_path, n: int):
    one = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    src = tmp_path / "runs.jsonl"
    src.write_text("".join(json.dumps(one) + "\n" for _ in range(n)))
    return src


def _run(args, tty: bool) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "replay.cli", *map(str, args)]
    if not tty:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    out, err = p.communicate(timeout=300)[0], b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    return p.returncode, out, err.decode("utf-8", "replace")


def test_recover_and_trace_show_a_bar_on_a_terminal(tmp_path):
    src = _jsonl(tmp_path, 6)
    rc, _, err = _run(["recover", src, "-m", tiny_target(), "-o", tmp_path / "out.jsonl"], tty=True)
    assert rc == 0 and "recovering records" in err and "100%" in err
    rc, out, err = _run(["trace", src, "-m", tiny_target(), "-md", FIXTURES / "tiny-draft.gguf", "--json"], tty=True)
    assert rc == 0 and "tracing records" in err and "100%" in err
    assert len(json.loads(out)["records"]) == 6  # stdout stays clean JSON


def test_no_bar_text_when_stderr_is_not_a_terminal(tmp_path):
    src = _jsonl(tmp_path, 6)
    rc, out, err = _run(["trace", src, "-m", tiny_target(), "-md", FIXTURES / "tiny-draft.gguf", "--json"], tty=False)
    assert rc == 0 and "tracing records" not in err and "%" not in err
    assert len(json.loads(out)["records"]) == 6
