"""The CLI reference (docs/cli.md), generated from the real --help of every command with cog:

    cog -r docs/cli.md          # regenerate
    cog --check docs/cli.md     # tests/test_cli_reference.py: fails when it is stale
"""
from __future__ import annotations

from click.testing import CliRunner

from replay.errors import EXIT_MEANINGS

WIDTH = 100  # columns the help is wrapped to, whatever the terminal


def help_text(*args: str) -> str:
    """`spec-replay ARGS --help` as a user sees it, at WIDTH columns."""
    from replay.cli import main
    r = CliRunner().invoke(main, [*args, "--help"], prog_name="spec-replay", terminal_width=WIDTH)
    if r.exit_code != 0:
        raise RuntimeError(f"spec-replay {' '.join(args)} --help exited {r.exit_code}: {r.output}")
    return r.output


def exit_table() -> str:
    """The exit codes, as a Markdown table."""
    rows = ["| code | meaning |", "|---|---|"]
    rows += [f"| {int(code)} | {meaning} |" for code, meaning in EXIT_MEANINGS.items()]
    return "\n".join(rows) + "\n"


def reference() -> str:
    """The body of docs/cli.md: the exit codes, then every command's --help."""
    from replay.cli import main
    out = ["## Exit codes\n\n", "The same for every command (`replay/errors.py`, `Exit`):\n\n", exit_table(),
           "\n## spec-replay\n\n", "```\n$ spec-replay --help\n" + help_text() + "```\n"]
    for name in sorted(main.commands):
        out += [f"\n## spec-replay {name}\n\n", f"```\n$ spec-replay {name} --help\n" + help_text(name) + "```\n"]
    return "".join(out)
