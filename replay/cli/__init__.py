"""The `spec-replay` command line: thin commands over the library, one module per concern.

    recover.py   recover, diff          trace.py    trace
    record.py    record                 audit.py    check, demo
    llamacpp.py  build, patch           lab.py      dist
    options.py   llama-server's flags, generated from the settings table
    render.py    report tables          progress.py one progress bar on stderr

Known failures (SpecReplayError) print one `Error: ...` line and exit non-zero;
set SPEC_REPLAY_RAISE_ERRORS=1 to see the traceback instead.
"""
from __future__ import annotations

import functools
import os
import sys

import click

from replay import __version__
from replay.errors import SpecReplayError


def handle_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecReplayError as e:
            if os.environ.get("SPEC_REPLAY_RAISE_ERRORS"):
                raise
            click.echo(f"Error: {e}", err=True)
            sys.exit(e.exit_code if e.exit_code else 1)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)
    return wrapper


def _version_text() -> str:
    """spec-replay's version, the libllama it evaluates with, and the servers built so far."""
    lines = [f"spec-replay {__version__}"]
    try:
        import llama_cpp
        lines.append(f"in-process libllama: llama-cpp-python {llama_cpp.__version__}'s (vendored llama.cpp 0c1e570, "
                     "CPU), or a transcript's build's own once built and callable (see --libllama)")
    except ImportError as e:  # pragma: no cover - a broken install still prints a version
        lines.append(f"in-process libllama: unavailable ({e})")
    from replay.llamacpp.build import BuildSpec, find_built
    for profile in ("b11434", "0c1e570"):
        bins = find_built(BuildSpec(profile))
        state = f"built, build_info {bins.build_info}, {bins.bin_dir}" if bins else "not built yet (spec-replay build)"
        lines.append(f"llama-server {profile}: {state}")
    return "\n".join(lines)


def _show_version(ctx, _param, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(_version_text())
    ctx.exit()


@click.group()
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="show the version, the llama.cpp builds in use, and exit")
def main() -> None:
    """Tell the truth about llama.cpp's speculative decoding.

    \b
    spec-replay check URL                  does the server send placeholder logprobs?
    spec-replay record URL --request req.json -o t.json     record a replayable transcript
    spec-replay recover t.json -m target.gguf -o fixed.json   recover the real logprobs
    spec-replay trace t.json -m target.gguf -md draft.gguf    replay the loop step by step
    spec-replay patch --source ~/llama.cpp -o fix.patch       a server that reports real probs
    spec-replay dist                       which loops keep the target distribution
    spec-replay build                      build the real llama-server (cached)

    Commands that take llama-server's flags spell them as llama-server does
    (--spec-type, -md, --spec-draft-n-max, -c, -b, -ub, ...).
    """


from replay.cli import audit, lab, llamacpp, record, recover, trace  # noqa: E402,F401  (register the commands)
