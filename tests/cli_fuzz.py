"""The CLI fuzzer's driver, run by tests/test_cli_fuzz.py in a process of its own (an abort inside
libllama must not take the test run with it): hypothesis builds command lines from every option
of recover, diff, trace, check, record and patch, with values of every kind (numbers at and past
their limits, NaN, text, paths to good, garbage, missing and directory files, closed ports), runs
each through click in-process and requires a documented exit: 0, 1, 2, 3 or 130 with at most one
`Error:` line (of at most 220 characters besides what the user typed) and no traceback. An internal error (exit 70) is a bug and fails the run.

    python tests/cli_fuzz.py WORKDIR N     # N cases; WORKDIR/current.json holds the one running
                                           # (run it from a scratch directory: it types relative paths)
"""
from __future__ import annotations

import json
import shutil
import socket
import sys
from collections import Counter
from pathlib import Path

import click
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.cli import main
from replay.errors import Exit
from replay.paths import FIXTURES

COMMANDS = ("recover", "diff", "trace", "check", "record", "patch")
SKIP = {"--workers", "--ray", "--resume", "--libllama", "--help", "-h", "--verify", "--build"}  # own tests; builds
ALLOWED = {int(Exit.OK), int(Exit.FAILED), int(Exit.USAGE), int(Exit.ERROR), int(Exit.INTERRUPTED)}  # never 70


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pools(work: Path) -> dict[str, list[str]]:
    tx = work / "t"
    tx.mkdir(exist_ok=True)
    good = []
    for name in ("tiny-draft-simple.json", "tiny-v1-chat-stream.json", "tiny-completion-grammar.json"):
        shutil.copy(FIXTURES / "transcripts" / name, tx / name)  # copies: --in-place must never touch fixtures
        good.append(str(tx / name))
    (tx / "garbage.json").write_bytes(b"\x00\xff{not json")
    (tx / "empty.json").write_text("")
    (tx / "req.json").write_text(json.dumps({"prompt": "bcd", "seed": 1, "n_predict": 4}))
    (tx / "garbage.gguf").write_bytes(b"GGUF" + b"\x01" * 60)
    files = good + [str(tx / n) for n in ("garbage.json", "empty.json", "req.json", "garbage.gguf")]
    return {
        "file": good * 4 + files + [str(tx / "missing.json"), str(tx), "-", "/dev/null", "/proc/self/status"],
        "model": [str(FIXTURES / "tiny-target.gguf"), str(FIXTURES / "tiny-draft.gguf"), str(tx / "garbage.gguf"),
                  str(tx / "garbage.json"), str(tx / "nope.gguf"), str(tx)],
        "out": [str(work / "o" / "out.json"), str(tx / "garbage.json"), str(tx), str(work / "missing" / "x.json"),
                "/proc/nope"],
        "url": [f"http://127.0.0.1:{_closed_port()}", "not a url", "ftp://127.0.0.1/", "http://[::1", "",
                "http://127.0.0.1:0"],
        "dir": [str(tx), str(work / "nope"), str(FIXTURES)],
    }


def _value(o: click.Option, pool: dict[str, list[str]]) -> st.SearchStrategy[str]:
    names = " ".join(o.opts)
    numbers = st.one_of(st.integers(-3, 300), st.sampled_from(["0", "-1", "2147483648", "1e9", "nan", "inf", "0.5"]))
    text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
    if any(k in names for k in ("--model", "-md", "--spec-draft-model")):
        base = st.sampled_from(pool["model"])
    elif any(k in names for k in ("--output", "--report", "--html")):
        base = st.sampled_from(pool["out"])
    elif any(k in names for k in ("--request", "--requests")):
        base = st.sampled_from(pool["file"])
    elif "--source" in names:
        base = st.sampled_from(pool["dir"])
    elif isinstance(o.type, click.Choice):
        base = st.sampled_from(list(o.type.choices))
    elif isinstance(o.type, (click.types.IntParamType, click.types.FloatParamType, click.types.IntRange)) \
            or getattr(o.type, "name", "") in ("int", "float", "uint"):
        base = numbers.map(str)
    else:
        base = st.one_of(numbers.map(str), text)
    return st.one_of(*[base] * 6, text)  # mostly well-typed, sometimes anything


@st.composite
def command_lines(draw, pool: dict[str, list[str]]) -> list[str]:
    name = draw(st.sampled_from(COMMANDS))
    cmd = main.commands[name]
    argv = [name]
    for a in (p for p in cmd.params if isinstance(p, click.Argument)):
        pick = pool["url"] if a.name == "url" else pool["file"]
        if a.required or draw(st.booleans()):
            argv.append(draw(st.sampled_from(pick)))
    opts = [o for o in cmd.params if isinstance(o, click.Option) and not set(o.opts) & SKIP]
    for o in draw(st.lists(st.sampled_from(opts), max_size=3, unique_by=lambda o: o.name)):
        argv.append(draw(st.sampled_from(o.opts)))
        if not o.is_flag:
            argv.append(draw(_value(o, pool)))
    if name in ("recover", "diff", "trace") and draw(st.integers(0, 4)):  # mostly a real model, to get past the parser
        argv += ["-m", pool["model"][0]]
    if name == "recover" and draw(st.integers(0, 4)):
        argv += ["-o", pool["out"][0]] if draw(st.integers(0, 3)) else ["--in-place"]
    if name == "trace" and "--prompt" not in argv and draw(st.booleans()):
        argv += ["--prompt", draw(st.sampled_from(["bcd", "", "\u00e9<script>", "b" * 300]))]
    return argv


def main_(work: Path, n: int) -> int:
    pool = pools(work)
    current = work / "current.json"
    seen: Counter = Counter()

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(command_lines(pool))
    def case(argv: list[str]) -> None:
        current.write_text(json.dumps(argv))
        shutil.rmtree(work / "o", ignore_errors=True)
        r = CliRunner().invoke(main, argv, input="")
        seen[argv[0], r.exit_code] += 1
        out = r.output
        assert r.exit_code in ALLOWED, f"exit {r.exit_code}: {argv!r}\n{out[-800:]}"
        assert r.exception is None or isinstance(r.exception, SystemExit), f"{argv!r} raised {r.exception!r}"
        assert "Traceback" not in out, f"{argv!r} printed a traceback"
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) <= 1, f"{argv!r}: {r.stderr}"
        # short: the details are behind -v (paths the fuzzer typed are not the message's fault)
        assert not errors or r.exit_code == Exit.USAGE or \
            len(errors[0]) - sum(len(a) * errors[0].count(a) for a in set(argv) if len(a) > 3) <= 220, errors[0]
        if r.exit_code == Exit.USAGE:
            assert "Usage:" in r.stderr or "Error:" in r.stderr, argv

    case()
    current.unlink(missing_ok=True)
    print(json.dumps({f"{c} exit {code}": n for (c, code), n in sorted(seen.items())}))
    return 0


if __name__ == "__main__":
    sys.exit(main_(Path(sys.argv[1]), int(sys.argv[2])))
