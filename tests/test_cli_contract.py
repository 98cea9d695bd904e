"""The command line's contract: one spelling per option (llama-server's where it has one), the same
exit codes everywhere (never click's usage code for anything but usage), -h/-v/examples on every
command, and one line, never a traceback, for a failure. No model or server needed."""
from __future__ import annotations

from collections import defaultdict

import click
import pytest
from cli_helpers import run

from replay.cli import main
from replay.cli.options import BUILD
from replay.errors import Exit
from replay.settings import rows

COMMANDS = sorted(main.commands)


def _options(cmd: click.Command) -> list[click.Option]:
    """The command's own options. Hidden ones are llama-server's other flags, spelled and taken as the
    server takes them (settings/server_flags.py, tests/test_server_flags.py): not part of this contract."""
    return [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]


def test_every_command_is_listed_in_the_top_level_help():
    r = run("--help")
    assert r.exit_code == 0
    for name in COMMANDS:
        assert f"spec-replay {name}" in r.output, name


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_examples_verbose_and_short_help(name):
    cmd = main.commands[name]
    r = run(name, "-h")
    assert r.exit_code == 0 and r.output == run(name, "--help").output
    examples = [line for line in r.output.splitlines() if line.strip().startswith("spec-replay ")]
    assert examples, f"{name} --help shows no example"
    assert any("--verbose" in o.opts for o in _options(cmd)), f"{name} has no -v/--verbose"
    assert cmd.get_short_help_str(80), name


def test_a_short_option_means_the_same_long_option_in_every_command():
    meaning: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for name in COMMANDS:
        for o in _options(main.commands[name]):
            longs = tuple(sorted(x for x in o.opts if x.startswith("--")))
            for short in (x for x in o.opts if not x.startswith("--")):
                meaning[short].add(longs)
    clashes = {s: m for s, m in meaning.items() if len(m) > 1}
    assert not clashes, clashes
    assert meaning["-n"] == {("--n-predict", "--predict")}      # llama-server's -n
    assert meaning["-m"] == {("--model",)} and meaning["-v"] == {("--verbose",)}
    assert "-j" not in meaning or meaning["-j"] == {("--json-schema",)}


def _kind(o: click.Option) -> str:
    """What an option takes: flag, int, float, path, choice, build or text (a settings-table type by its kind)."""
    if o.is_flag:
        return "flag"
    setting = getattr(o.type, "setting", None)
    if setting is not None:
        return {"str": "text", "strings": "text"}.get(setting.kind, setting.kind)
    for cls, kind in ((click.IntRange, "int"), (click.types.IntParamType, "int"), (click.FloatRange, "float"),
                      (click.types.FloatParamType, "float"), (click.Path, "path"), (click.Choice, "choice")):
        if isinstance(o.type, cls):
            return kind
    return "build" if o.type is BUILD else "text"


def test_a_long_option_has_one_meaning_in_every_command():
    """The same name takes the same kind of value everywhere: a llama.cpp build is `--build bN`
    (never --profile), a flag is a flag."""
    kinds: dict[str, set[str]] = defaultdict(set)
    for name in COMMANDS:
        for o in _options(main.commands[name]):
            for opt in (x for x in o.opts if x.startswith("--")):
                kinds[opt].add(_kind(o))
    assert not {k: v for k, v in kinds.items() if len(v) > 1}
    assert "--profile" not in kinds and "--draft" not in kinds and "--jobs" in kinds
    for name in ("build", "patch", "dist", "recover", "diff", "trace"):
        build = [o for o in _options(main.commands[name]) if "--build" in o.opts]
        assert build and build[0].type is BUILD, name


def test_server_flags_are_spelled_as_llama_server_spells_them():
    table = {n for s in rows("speculative", "context", "sampling") for n in s.names}
    trace = {x for o in _options(main.commands["trace"]) for x in o.opts}
    assert table <= trace
    assert {"-md", "--spec-draft-model", "--model-draft"} <= {x for o in _options(main.commands["demo"]) for x in o.opts}


@pytest.mark.parametrize("value,profile", [("b11434", "b11434"), ("11434", "b11434"), ("0c1e570", "0c1e570")])
def test_a_build_is_bN_a_number_or_0c1e570(value, profile):
    assert BUILD.convert(value, None, None) == profile


def test_a_bad_build_is_a_usage_error():
    r = run("build", "--build", "latest")
    assert r.exit_code == Exit.USAGE and "neither b<N>" in r.output


def test_exit_codes_are_distinct_and_usage_keeps_click_s_own():
    assert len({int(e) for e in Exit}) == len(Exit)
    assert Exit.USAGE == click.UsageError.exit_code
    r = run("recover", "--no-such-option")
    assert r.exit_code == Exit.USAGE


def test_a_failure_is_one_short_line_and_json_mode_says_it_as_json(tmp_path):
    import json
    r = run("diff", tmp_path / "none.json", "-m", tmp_path / "none.gguf", "--json")
    assert r.exit_code == Exit.ERROR
    err = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(err) == 1 and len(err[0]) < 200 and "Traceback" not in r.output
    assert json.loads(r.stdout)["error"]["exit_code"] == Exit.ERROR


def test_a_bug_is_one_line_with_exit_70_not_a_traceback(monkeypatch, tmp_path):
    """An exception nobody expected still ends in one line, naming where, with exit 70."""
    import replay.cli.recover as rc

    def boom(*a, **k):
        raise ZeroDivisionError("simulated bug")
    monkeypatch.setattr(rc, "_start", boom)
    r = run("diff", tmp_path / "t.json", "-m", tmp_path / "m.gguf")
    assert r.exit_code == Exit.INTERNAL and "Traceback" not in r.output
    line, = [x for x in r.stderr.splitlines() if x.startswith("Error:")]
    assert "internal error: ZeroDivisionError: simulated bug" in line and "SPEC_REPLAY_RAISE_ERRORS" in line


def test_a_reader_that_stops_early_loses_nothing(tmp_path):
    """`spec-replay recover ... | head`: the repaired file is written before the report is printed,
    and the closed pipe ends the run quietly with the shell's SIGPIPE code, 141."""
    import subprocess
    import sys

    from replay.llamacpp.models import tiny_target
    from replay.paths import FIXTURES
    out = tmp_path / "fixed.json"
    p = subprocess.Popen([sys.executable, "-m", "replay.cli", "recover", str(FIXTURES / "transcripts" / "tiny-draft-simple.json"),
                          "-m", str(tiny_target()), "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the report comes, as `| head -0` would be
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == Exit.PIPE, err
    assert out.is_file() and "Traceback" not in err and "BrokenPipe" not in err
