"""How a command's --help is laid out: its own options first, in sections (SECTIONS: inputs, outputs,
the server, numerics, running), then llama-server's flags behind one line that says how many there are
and where they are listed (`--help-server-flags`, added to every command that takes them).

A person reads `recover --help` in one screen or two; the 75 flags spelled as llama-server spells
them (settings/table.py) are one option away, grouped as the settings table groups them.
"""
from __future__ import annotations

from typing import Iterable

import click

# Which section each option of the commands is shown in, by its parameter name; an option not named here
# is the command's own (its first section, "Options"). tests/test_cli_help.py keeps this complete.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Inputs": ("url", "model", "renamed_model", "draft", "request_file", "requests_file", "prompt", "endpoint",
               "probe_tokens", "n_probs", "paths"),
    "Outputs": ("output", "in_place", "resume", "report_file", "html_file", "as_json", "force"),
    "The server": ("profile", "build", "source", "server_backend", "server_cpu", "shared_batches"),
    "Numerics": ("tolerance", "no_prefix_reuse", "libllama"),
    "Running": ("workers", "ray_address", "host", "port", "backlog", "on_failure", "serial", "jobs"),
    "Help": ("verbose", "quiet", "help_server_flags", "help"),
}
OWN = "Options"
SECTION_OF = {name: title for title, names in SECTIONS.items() for name in names}

# The settings table's groups (settings/table.py GROUPS), as --help-server-flags titles them.
GROUP_TITLES = {"speculative": "Speculative decoding", "context": "Context, memory and threads",
                "sampling": "Sampling"}
SHOWN_FIRST = ("-md", "--spec-type", "--spec-draft-n-max", "-c", "-ub", "-t", "-np", "--temp", "--seed")


class ServerFlag(click.Option):
    """An option that is one of llama-server's flags (a settings-table row): listed by
    --help-server-flags, behind one line in --help."""

    def __init__(self, *args, group: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


def server_flag_params(params: Iterable[click.Parameter]) -> list[ServerFlag]:
    return [p for p in params if isinstance(p, ServerFlag)]


def _examples(flags: list[ServerFlag]) -> str:
    names = {o for p in flags for o in p.opts}
    return ", ".join(n for n in SHOWN_FIRST if n in names)


def server_flags_line(command_path: str, flags: list[ServerFlag]) -> str:
    """The one line --help gives llama-server's flags."""
    return (f"{len(flags)} of llama-server's flags, spelled as llama-server spells them ({_examples(flags)}, "
            f"...): `{command_path} --help-server-flags` lists them with llama-server's defaults.")


def _place(p: click.Parameter) -> int:
    """Where an option goes within its section: SECTIONS' order (the command's own: as declared)."""
    title = SECTION_OF.get(p.name or "")
    return SECTIONS[title].index(p.name) if title else 0


def format_sections(ctx: click.Context, formatter: click.HelpFormatter, params: list[click.Parameter]) -> None:
    """Write the options of `params` in SECTIONS' order (the command's own first), llama-server's flags
    as one line."""
    records: dict[str, list[tuple[str, str]]] = {}
    for p in sorted((p for p in params if not isinstance(p, ServerFlag)), key=_place):
        record = p.get_help_record(ctx)
        if record is not None:
            records.setdefault(SECTION_OF.get(p.name or "", OWN), []).append(record)
    flags = server_flag_params(params)
    for title in (OWN, *SECTIONS):
        if title == "Help" and flags:
            with formatter.section("llama-server's flags"):
                formatter.write_text(server_flags_line(ctx.command_path, flags))
        if records.get(title):
            with formatter.section(title):
                formatter.write_dl(records[title])


def format_server_flags(ctx: click.Context, formatter: click.HelpFormatter, flags: list[ServerFlag]) -> None:
    """llama-server's flags a command takes, grouped as the settings table groups them."""
    for group, title in GROUP_TITLES.items():
        records = [r for p in flags if p.group == group and (r := p.get_help_record(ctx)) is not None]
        if records:
            with formatter.section(title):
                formatter.write_dl(records)


def server_flags_help(ctx: click.Context) -> str:
    """What `COMMAND --help-server-flags` prints."""
    formatter = ctx.make_formatter()
    formatter.write_usage(ctx.command_path, "[OPTIONS]")
    formatter.write_paragraph()
    formatter.write_text(f"llama-server's flags that {ctx.command_path} takes, spelled as llama-server spells "
                         "them: give them as the server was started. One not given is what the transcript or the "
                         "server says (its recorded command line, /props) where it says it, else llama-server's "
                         "default, shown here.")
    format_server_flags(ctx, formatter, server_flag_params(ctx.command.get_params(ctx)))
    return formatter.getvalue().rstrip("\n")


def _show_server_flags(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(server_flags_help(ctx))
    ctx.exit()


def server_flags_help_option() -> click.Option:
    """--help-server-flags: eager, as --help is."""
    return click.Option(["--help-server-flags", "help_server_flags"], is_flag=True, expose_value=False,
                        is_eager=True, callback=_show_server_flags,
                        help="list llama-server's flags this command takes, and exit")
