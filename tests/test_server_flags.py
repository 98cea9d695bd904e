"""Any llama-server command line is taken (settings/server_flags.py): every flag b11434's server has is
accepted by recover, diff and trace, and is used (a settings row), ignored with a note on stderr (it
changes nothing the command computes), or refused in one line that names it. The quick tier checks the
table against the commands; the `build` test walks the built server's own --help."""
from __future__ import annotations

import re
import subprocess

import click
import pytest
from cli_helpers import one_error, run

from replay.cli import main
from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES
from replay.settings import BY_FLAG
from replay.settings.server_flags import BY_NAME, SERVER_FLAGS, judge
from replay.settings.table import UNREPLAYED_BY_FLAG

T = FIXTURES / "transcripts" / "tiny-draft-simple.json"


ARGS = {"recover": [str(T), "-o", "x.json"], "diff": [str(T)], "trace": [str(T)], "tune": [str(T), "--vary",
        "--spec-draft-n-max=2"], "check": ["http://127.0.0.1:9"]}


def _accepted(command: str, argv: list[str]) -> None:
    """Parse `argv` as the command would (no run): raises click.UsageError on an unknown option or a
    value the option does not take."""
    cmd = main.commands[command]
    parent = main.make_context("spec-replay", [command], resilient_parsing=True)  # the group's context settings
    model = [] if command == "check" else ["-m", str(tiny_target())]
    cmd.make_context(command, [*ARGS[command][:1], *model, *argv, *ARGS[command][1:]], parent=parent)


OURS = ("-h", "--help")  # every command's own help


def _sample(name: str) -> list[str]:
    """The flag with a value it takes (a settings row's first choice, a number, a path)."""
    f = BY_NAME.get(name)
    s = BY_FLAG.get(name)
    if name in ("-m", "--model"):  # the commands' own, a file that must exist
        return [name, str(tiny_target())]
    if s is not None and (f is None or not f.value or s.kind != "flag"):
        if s.kind == "flag":
            return [name]
        if s.choices:
            return [name, s.choices[0]]
        for value in ("1", "x", "auto", "on"):
            try:
                s.parse(value)
                return [name, value]
            except ValueError:
                pass
        raise AssertionError(f"{name}: no sample value parses")
    return [name, "1"] if f.value else [name]


@pytest.mark.parametrize("command", sorted(ARGS))
def test_every_flag_of_the_table_parses_on_every_command(command):
    """A user pastes the server's command line: every flag b11434's server has parses, with a value it
    takes, on every command that takes server flags (what each then does with it: the tests below)."""
    wrong = []
    for f in SERVER_FLAGS:
        for name in (n for n in f.names if n not in OURS):
            try:
                _accepted(command, _sample(name))
            except click.UsageError as e:
                wrong.append(f"{name}: {e.format_message()}")
    assert not wrong, f"{command}: {wrong[:5]} ({len(wrong)} in all)"


def test_the_refusals_recorded_transcripts_get_are_the_command_lines_too():
    """settings/table.py UNREPLAYED_FLAGS judges recorded flags; a flag given on our command line is
    judged alike: refused by recover exactly where recover cannot reproduce it."""
    for name, u in UNREPLAYED_BY_FLAG.items():
        value = True if not BY_NAME[name].value else "7"
        assert (judge(name, value, "recover")[0] == "refused") == (not u.recover_ok), name
        assert judge(name, value, "trace")[0] == "refused", name


def test_an_ignored_flag_is_said_on_stderr_and_changes_nothing(tmp_path):
    """The speculative flags are recover's own (it replays the loop where a target's values need its
    batches: docs/recover.md); on a transcript whose values do not, they change nothing, and no word is said
    of them. A flag that changes nothing recover computes is said to be ignored."""
    plain = run("diff", T, "-m", tiny_target(), "--json")
    r = run("diff", T, "-m", tiny_target(), "--json", "--port", "8081", "--host", "0.0.0.0", "--metrics",
            "-md", tiny_draft(), "--spec-type", "draft-simple", "--log-colors", "off", "-kvo", "-td", "3")
    assert r.exit_code == 0, r.output
    assert plain.stdout == r.stdout
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert "note: --port 8081: ignored (HTTP server setting)" in notes
    assert "note: -kvo: ignored (the server's default)" in notes
    assert not [line for line in notes if "-md" in line or "--spec-type" in line or "--spec-draft-model" in line
                or "-td" in line or "--spec-draft-threads" in line], notes


@pytest.mark.parametrize("argv,expected", [
    (["--lora", "a.gguf"], "--lora a.gguf: applies a LoRA adapter"),
    (["--rope-freq-base", "50000"], "--rope-freq-base 50000:"),
    (["--context-shift"], "--context-shift: shifts the KV cache"),
    (["-hf", "ggml-org/gemma-3-270m-GGUF"], "give the model file itself (-m)"),
    (["--chat-template", "chatml"], "chat prompts are rebuilt with the template the transcript recorded"),
])
def test_a_flag_whose_effect_is_not_replayed_is_refused_by_name(argv, expected):
    r = run("diff", T, "-m", tiny_target(), *argv)
    assert r.exit_code == 3
    assert expected in one_error(r)


def test_trace_refuses_what_changes_the_loop_and_recover_takes_it():
    """--spec-synth-len (copied from a benchmarking server's command line) accepts drafts at random:
    trace cannot reproduce the loop; recover replays it only where a target's values need its batches,
    and there the draft totals show other batches."""
    r = run("trace", T, "-m", tiny_target(), "--spec-synth-len", "4")
    assert r.exit_code == 3 and one_error(r) == (
        "Error: --spec-synth-len 4: accepts drafts at random for benchmarking (server_sample_and_accept_synth): the "
        "loop's choices are not the rejection rule's; not replayed by trace")
    r = run("diff", T, "-m", tiny_target(), "--spec-synth-len", "4")
    assert r.exit_code == 0 and "note: --spec-synth-len 4: ignored" in r.stderr


def _help_names(text: str) -> set[str]:
    """Every option name of `llama-server --help`: the names that open an option line."""
    names = set()
    for line in text.splitlines():
        m = re.match(r"^((?:-{1,2}[A-Za-z0-9][\w.-]*(?:,\s*)?)+)", line)
        if m:
            names |= {n.strip() for n in m.group(1).split(",") if n.strip()}
    return names


@pytest.mark.build
def test_every_option_of_the_built_servers_help_is_taken(b11434):
    """b11434's own list: every name `llama-server --help` prints is a settings row or an entry of
    settings/server_flags.py, and parses on recover, diff and trace."""
    text = subprocess.run([str(b11434.server), "--help"], capture_output=True, text=True, timeout=60).stdout
    names = _help_names(text)
    assert len(names) > 300, len(names)
    missing = sorted(n for n in names if n not in BY_NAME and n not in BY_FLAG)
    assert not missing, missing
    stale = sorted(n for n in BY_NAME if n not in names)
    assert not stale, stale
    for command in ("recover", "diff", "trace"):
        for name in sorted(names - set(OURS)):
            try:
                _accepted(command, _sample(name))
            except click.UsageError as e:
                assert "no such option" not in e.format_message().lower(), (command, name, e.format_message())


def test_check_sets_the_servers_other_flags_aside_with_a_note():
    """A server's whole command line given to check: its speculative flags are checked against /slots,
    the rest said to be set aside, one note each, and the audit goes on (here: to an unreachable server)."""
    r = run("check", "http://127.0.0.1:9", "--lora", "a.gguf", "-c", "4096", "--spec-type", "ngram-mod")
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert notes == ["note: --lora a.gguf: ignored (check asks the running server what it does)",
                     "note: -c 4096: ignored (check asks the running server what it does)"]
    assert one_error(r) == ("Error: cannot tell: cannot reach http://127.0.0.1:9/props: [Errno 111] Connection "
                            "refused")
