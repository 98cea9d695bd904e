"""What a command shows on the terminal: recover/diff's report tables (tabulate), the one progress bar
of every long multi-item operation, and the one `Error:` line every failure ends in."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import click
from tabulate import tabulate

from replay.errors import Exit

from replay.report.recovery import RecordReport, RecoverResult


def shown(value) -> str:
    """A setting's value as a user would type it on llama-server's command line.

    >>> shown(("draft-simple",)), shown(["ngram-mod", "draft-simple"]), shown("greedy"), shown(0.8), shown(None)
    ('draft-simple', 'ngram-mod,draft-simple', "'greedy'", '0.8', 'None')
    """
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return repr(value)


def _f(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def token_table(r: RecordReport) -> str:
    rows = []
    for t in r.tokens:
        top = ", ".join(f"{x['piece']!r} {x['logprob']:.3f}" for x in t.true_top[:3])
        rows.append([t.index, t.id, repr(t.piece), _f(t.server_logprob), _f(t.true_logprob), t.status, top])
    return tabulate(rows, headers=["#", "id", "piece", "server", "true", "status", "true top"])


def summary_table(res: RecoverResult) -> str:
    rows = []
    for r in res.records:
        s = r.summary()
        c = s["counts"]
        rows.append([f"{r.source}#{r.record}", r.endpoint + (" (stream)" if r.stream else ""), s["tokens"], c["ok"],
                     c["placeholder"], c["missing"], c["mismatch"] + c["unaligned"], _f(s["server_mean_logprob"]),
                     _f(s["true_mean_logprob"]), _f(s["true_perplexity"], 3),
                     "-" if s["max_abs_diff_real"] is None else f"{s['max_abs_diff_real']:.1e}"])
    return tabulate(rows, headers=["record", "endpoint", "tokens", "ok", "placeholder", "missing", "bad",
                                   "server mean", "true mean", "true ppl", "max |diff| real"])


@contextmanager
def progress_bar(total: int, label: str, done: int = 0) -> Iterator[Callable[[int], None]]:
    """Yield `advance_to(n)`: the bar shows n of `total` items done. Nothing is drawn for a
    single item (its own output is the progress) or when stderr is not a terminal (logs and
    pipes get no bar text); `done` items finished earlier (--resume) start the bar there."""
    if total < 2 or not sys.stderr.isatty():
        yield lambda n: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        bar.update(done)
        yield lambda n: bar.update(n - bar.pos)


def fail(ctx: click.Context, code: int, line: str, detail: str | None = None, kind: str = "error") -> None:
    """End the command with one `Error: ...` line on stderr (and the detail with -v), or, under
    --json, that error as JSON on stdout; exit `code` (errors.Exit)."""
    if ctx.params.get("as_json"):
        click.echo(json.dumps({"error": {"kind": kind, "message": line, "detail": detail, "exit_code": int(code)}},
                              indent=2))
    error_line(line, detail, ctx.params)
    ctx.exit(int(code))


def error_line(line: str, detail: str | None, params: dict) -> None:
    """`Error: <line>` on stderr; the detail on a second line with -v, else a pointer to it."""
    more = bool(detail and detail != line)
    click.echo(f"Error: {line}" + (" (-v: details)" if more and "verbose" in params and not params["verbose"] else ""),
               err=True)
    if more and params.get("verbose"):
        click.echo(f"  {detail}", err=True)


def check_failed(line: str, detail: str | None = None, code: int = Exit.FAILED) -> None:
    """End a command whose check failed (exit 1, Exit.FAILED; `code` when it could not run): one
    `Error:` line on stderr, the detail with -v. Its report (tables or --json) is already out."""
    ctx = click.get_current_context()
    error_line(line, detail, ctx.params)
    ctx.exit(int(code))
