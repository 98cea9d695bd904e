"""The `spec-replay` command line: thin commands over the library, one module per concern.

    recover.py   recover, diff          trace.py    trace
    tune.py      tune                   check.py    check, demo
    record.py    record                 llamacpp.py build, patch
    lab.py       dist
    options.py   llama-server's flags, generated from the settings table; the options every run takes
    help.py      how --help is laid out: sections, llama-server's flags behind --help-server-flags
    render.py    what a command shows: report tables, the progress bar, the one error line

Every run (recover, diff, trace, tune) starts at the front door (replay/run/: its inputs checked, its
engine chosen), as the Python API does; a command parses, calls it and renders what comes back.

Every failure prints one `Error: ...` line on stderr and exits with a documented code
(errors.Exit: 1 the check failed, 2 usage, 3 could not run, 70 a bug, 130 interrupted, 141 stdout closed);
set SPEC_REPLAY_RAISE_ERRORS=1 to see the traceback instead.
"""
from __future__ import annotations

import difflib
import os
import sys
import traceback
from pathlib import Path
from typing import Iterable

import click

from replay.version import __version__
from replay.errors import Exit, SpecReplayError, UsageError
from replay.cli import help
from replay.cli.render import fail


class OneLineUsage(click.UsageError):
    """A usage error (exit 2) shown as one line, with where to read the command's help."""

    def show(self, file=None) -> None:
        hint = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"Error: {self.format_message()}{hint}", err=True)


def nearest(word: str, choices: Iterable[str]) -> str | None:
    """The one of `choices` a mistyped `word` most likely meant (difflib's ratio, at least 0.6), or None.

    >>> nearest("recvoer", ["record", "recover", "trace"]), nearest("--tolerence", ["--force", "--tolerance"])
    ('recover', '--tolerance')
    >>> nearest("zzz", ["record", "recover"]) is None
    True
    """
    best = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return best[0] if best else None


def _one_line(e: click.UsageError) -> OneLineUsage:
    message = e.format_message()
    if isinstance(e, click.NoSuchOption):  # the nearest option shown in --help, not click's list of a few
        shown = [o for p in e.ctx.command.params if isinstance(p, click.Option) and not p.hidden
                 for o in (*p.opts, *p.secondary_opts)] if e.ctx is not None else list(e.possibilities or ())
        meant = nearest(e.option_name, shown)
        message = f"no such option {e.option_name}" + (f": did you mean {meant}?" if meant else "")
    out = OneLineUsage(message, ctx=e.ctx)
    out.exit_code = e.exit_code
    return out


class Command(click.Command):
    """A command whose failures end in one line and a documented exit code (errors.Exit): a known
    failure (SpecReplayError) exits 3, a bug 70 (SPEC_REPLAY_RAISE_ERRORS=1 re-raises both), Ctrl-C 130,
    a closed stdout (`| head`) quietly. Usage errors stay click's (exit 2)."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        """The command's parameters, with --help-server-flags before --help where it takes llama-server's flags."""
        params = super().get_params(ctx)
        if not help.server_flag_params(params):
            return params
        if "_help_server_flags" not in self.__dict__:
            self._help_server_flags = help.server_flags_help_option()
        return [*params[:-1], self._help_server_flags, params[-1]]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """--help: the command's own options in sections, llama-server's flags as one line (cli/help.py)."""
        help.format_sections(ctx, formatter, self.get_params(ctx))

    def make_context(self, info_name, args, parent=None, **extra):
        """Parsing: a value the OS refuses while an option's type checks it (a path holding a NUL
        byte, say) is a usage error, as a bad value is."""
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise _one_line(e) from None
        except (ValueError, OSError) as e:
            raise OneLineUsage(f"a bad argument: {e}", ctx=parent) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OneLineUsage:
            raise
        except click.UsageError as e:
            raise _one_line(e) from None
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except UsageError as e:  # found past parsing (run/inputs.py): shown as click's own usage errors
            raise OneLineUsage(str(e), ctx=ctx) from None
        except SpecReplayError as e:
            if os.environ.get("SPEC_REPLAY_RAISE_ERRORS"):
                raise
            fail(ctx, e.exit_code, str(e), e.detail, type(e).__name__)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(Exit.INTERRUPTED)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)  # the reader went away: no second error at exit
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(Exit.PIPE)
        except Exception as e:  # a bug: still one line, with what to report
            if os.environ.get("SPEC_REPLAY_RAISE_ERRORS"):
                raise
            where = traceback.extract_tb(e.__traceback__)[-1]
            fail(ctx, Exit.INTERNAL, f"internal error: {type(e).__name__}: {str(e)[:200]} "
                  f"(at {Path(where.filename).name}:{where.lineno}; SPEC_REPLAY_RAISE_ERRORS=1 shows the "
                  "traceback; please report it)", kind="internal")


class Group(click.Group):
    command_class = Command

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """A misspelled command is one line naming the command it most likely meant."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError:
            name = args[0] if args else ""
            meant = nearest(name, self.list_commands(ctx))
            raise OneLineUsage(f"no such command {name!r}" + (f": did you mean {meant!r}?" if meant else ""),
                               ctx=ctx) from None



def _version_text() -> str:
    """spec-replay's version, the libllama it evaluates with, the servers built so far, and which of
    their kernels run on this host (runtime/health.py: probed once per host and library)."""
    from replay.runtime import health
    from replay.runtime.binding import bundled_dir
    lines = [f"spec-replay {__version__}"]
    try:
        import importlib.metadata
        version = importlib.metadata.version("llama_cpp_python")
        verdict = health.health(bundled_dir(), health.NATIVE, bundled=True)
        runs = "runs on this host" if verdict is None or verdict.runs() else verdict.describe("it").split(": ", 1)[1]
        lines.append(f"in-process libllama: llama-cpp-python {version}'s (vendored llama.cpp 0c1e570, CPU; {runs}), "
                     "or a transcript's build's own once built and callable (see --libllama)")
    except Exception as e:  # pragma: no cover - a broken install still prints a version
        lines.append(f"in-process libllama: unavailable ({e})")
    from replay.llamacpp.build import BuildSpec, find_built
    from replay.runtime.variants import host_cpu_flags, runnable
    for profile in ("b11434", "0c1e570"):
        bins = find_built(BuildSpec(profile))
        if bins is None:
            lines.append(f"llama-server {profile}: not built yet (spec-replay build --build {profile})")
            continue
        lines.append(f"llama-server {profile}: built, build_info {bins.build_info}, {bins.bin_dir}")
        can = runnable(bins.cpu_variants, host_cpu_flags())
        if can:
            verdicts = health.verdicts(bins.bin_dir, can)
            ok = [v for v in can if verdicts[v].runs()]
            lines.append(f"  CPU variants that run on this host, best first: {', '.join(ok) or 'none'}")
            lines += [f"  {verdicts[v].describe()}" for v in can if not verdicts[v].runs()]
    return "\n".join(lines)


def _show_version(ctx, _param, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(_version_text())
    ctx.exit()


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="show the version, the llama.cpp builds in use, and exit")
def main() -> None:
    """Tell the truth about llama.cpp's speculative decoding.

    \b
    spec-replay check URL                  does the server send placeholder logprobs?
    spec-replay record URL --request req.json -o t.json     record a replayable transcript
    spec-replay recover t.json -m target.gguf -o fixed.json   recover the real logprobs
    spec-replay diff t.json -m target.gguf                    the same comparison; writes nothing
    spec-replay proxy URL -m target.gguf                      real logprobs, live, from a server
    spec-replay trace t.json -m target.gguf -md draft.gguf    replay the loop step by step
    spec-replay tune t.jsonl -m target.gguf --vary --spec-draft-n-max=2,8   other loop settings
    spec-replay patch --source ~/llama.cpp -o fix.patch       a server that reports real probs
    spec-replay dist                       which loops keep the target distribution
    spec-replay build                      build the real llama-server (cached)
    spec-replay demo                       start a speculating server and check it

    Options that llama-server has are spelled as llama-server spells them
    (--spec-type, -md, --spec-draft-n-max, -c, -b, -ub, -n, ...); a llama.cpp
    build is --build bN. Exit codes: 0 done, 1 the check failed, 2 usage,
    3 could not run, 70 a bug (please report), 130 interrupted, 141 stdout closed.
    `spec-replay COMMAND -h` for a command's options and examples.
    """


from replay.cli import check, lab, llamacpp, proxy, record, recover, trace, tune  # noqa: E402,F401  (register the commands)
