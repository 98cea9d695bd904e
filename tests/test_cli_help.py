"""A command's --help is read by a person: its own options first, in sections (inputs, outputs, the
server, numerics, running, help), llama-server's flags behind one line naming `--help-server-flags`,
which lists them grouped as the settings table groups them; docs/cli.md lists each of those flags once.
Quick tier: nothing is built or loaded."""
from __future__ import annotations

import re

import pytest
from cli_helpers import one_error, run

from replay.cli import help as cli_help
from replay.cli import main
from replay.cli.reference import help_text
from replay.paths import REPO_ROOT
from replay.settings import rows

TAKING = ("check", "diff", "proxy", "record", "recover", "trace", "tune")


def _sections(text: str) -> list[str]:
    return re.findall(r"^([A-Z][^\n:]*):$", text, flags=re.M)


ORDER = [cli_help.OWN, *[t for t in cli_help.SECTIONS if t != "Help"], "llama-server's flags", "Help"]


@pytest.mark.parametrize("command", sorted(main.commands))
def test_every_help_fits_a_reader_with_its_own_options_first_and_help_last(command):
    """recover --help was 301 lines, its own dozen options among 75 llama-server flags."""
    text = help_text(command)
    assert len(text.splitlines()) <= 120, (command, len(text.splitlines()))
    titles = _sections(text)
    assert titles == [t for t in ORDER if t in titles] and titles[-1] == "Help", titles


@pytest.mark.parametrize("command", TAKING)
def test_llama_servers_flags_are_one_line_in_help_and_listed_by_help_server_flags(command):
    short = help_text(command)
    assert "--spec-draft-n-min N" not in short and "--top-nsigma" not in short
    assert f"`spec-replay {command} --help-server-flags` lists them" in " ".join(short.split())
    r = run(command, "--help-server-flags")
    assert r.exit_code == 0, r.output
    taken = rows("speculative") if command == "check" else rows("speculative", "context", "sampling")
    for s in taken:
        if s.attr == "draft_model" and command == "check":
            continue  # check's -md is its own option (the draft it starts a server with)
        assert re.search(rf"^  (-\S+, )*{re.escape(s.flag)}\b", r.output, flags=re.M), (command, s.flag)
    assert _sections(r.output) == (["Speculative decoding"] if command == "check" else
                                   ["Speculative decoding", "Context, memory and threads", "Sampling"])


def test_a_misspelled_llama_server_flag_is_still_named():
    r = run("recover", "t.json", "-m", "x.gguf", "--spec-draft-n-mxa", "4")
    assert r.exit_code == 2
    assert one_error(r).startswith("Error: no such option --spec-draft-n-mxa: did you mean --spec-draft-n-max?")


def test_every_sectioned_name_is_an_option_of_some_command():
    names = {p.name for c in main.commands.values() for p in c.params} | {"help", "help_server_flags"}
    assert set(cli_help.SECTION_OF) <= names, set(cli_help.SECTION_OF) - names


def test_the_cli_reference_lists_each_llama_server_flag_once():
    """docs/cli.md was 1,441 lines: the 75 flags repeated in seven commands. Only check's and demo's own -md
    (the draft they start a server with) is also among a command's options."""
    commands, flags = (REPO_ROOT / "docs" / "cli.md").read_text().split("\n## llama-server's flags\n")
    for s in rows("speculative", "context", "sampling"):
        names = rf"(?:-[^\s,]+, )*{re.escape(s.flag)}(?:, -[^\s,]+)*"
        pattern = rf"^  {names}(?: \S+)?(?:  |$)"  # an option's record (names, metavar), not prose
        assert len(re.findall(pattern, flags, flags=re.M)) == 1, s.flag
        assert len(re.findall(pattern, commands, flags=re.M)) == (2 if s.attr == "draft_model" else 0), s.flag
