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


def server_flags_text() -> tuple[str, str]:
    """llama-server's flags, each listed once as the commands' --help-server-flags show it, in the settings
    table's order and groups; with which commands take them (a sentence)."""
    import click

    from replay.cli import help, main
    from replay.settings import SETTINGS
    takers: dict[str, list[str]] = {}  # attr -> the commands taking it
    flags: dict[str, help.ServerFlag] = {}
    taking = [n for n in sorted(main.commands) if help.server_flag_params(main.commands[n].params)]
    for name in taking:
        for p in help.server_flag_params(main.commands[name].params):
            flags.setdefault(p.name, p)
    for name in taking:  # a command takes a flag as its own option too (check's -md)
        spelled = {o for p in main.commands[name].params if not getattr(p, "hidden", False) for o in p.opts}
        for attr, p in flags.items():
            if p.opts[0] in spelled:
                takers.setdefault(attr, []).append(name)
    ctx = click.Context(main, info_name="spec-replay", terminal_width=WIDTH, max_content_width=WIDTH)
    formatter = ctx.make_formatter()
    for group, title in help.GROUP_TITLES.items():
        records = []
        for s in SETTINGS:
            if s.group == group and s.attr in flags:
                opts, text = flags[s.attr].get_help_record(ctx)
                missing = [n for n in taking if n not in takers[s.attr]]
                records.append((opts, text + (f" [not {', '.join(missing)}]" if missing else "")))
        with formatter.section(title):
            formatter.write_dl(records)
    return formatter.getvalue(), f"{', '.join(taking[:-1])} and {taking[-1]}"


def _others_taken() -> str:
    """Which commands take llama-server's other flags (cli/options.py every_server_flag), as a sentence."""
    from replay.cli import main
    names = [n for n in sorted(main.commands)
             if any((p.name or "").startswith("server_flag_") for p in main.commands[n].params)]
    return (f"{', '.join(names[:-1])} and {names[-1]} take every other llama-server flag too: each is ignored with "
            "a note on stderr where it does not change the values, or refused in one line, by name "
            "(replay/settings/server_flags.py).")


def reference() -> str:
    """The body of docs/cli.md: the exit codes, every command's --help, then llama-server's flags once."""
    from replay.cli import main
    out = ["## Exit codes\n\n", "The same for every command (`replay/errors.py`, `Exit`):\n\n", exit_table(),
           "\n## spec-replay\n\n", "```\n$ spec-replay --help\n" + help_text() + "```\n"]
    for name in sorted(main.commands):
        out += [f"\n## spec-replay {name}\n\n", f"```\n$ spec-replay {name} --help\n" + help_text(name) + "```\n"]
    text, takers = server_flags_text()
    out += ["\n## llama-server's flags\n\n",
            f"Each flag once, as `spec-replay COMMAND --help-server-flags` shows it: {takers} take them all, "
            "but where a flag says [not ...]. Spelled as llama-server spells them; give them as the server was "
            "started. One not given "
            "is what the transcript or the server says (its recorded command line, /props) where it says it, else "
            f"llama-server's default. {_others_taken()}\n\n",
            "```\n" + text + "```\n"]
    return "".join(out)
