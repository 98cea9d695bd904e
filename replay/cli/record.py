"""`spec-replay record`: requests to a running llama-server, kept as replayable transcripts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from replay.cli import main
from replay.cli.options import given_flags, server_flags, verbose_option
from replay.errors import Exit, SpecReplayError, TranscriptError, json_error
from replay.settings import flags_block
from replay.transcripts.format import ENDPOINTS


@main.command()
@click.argument("url")
@click.option("--request", "request_file", metavar="FILE", type=click.Path(dir_okay=False, allow_dash=True),
              help="JSON request body ('-' for stdin)")
@click.option("--requests", "requests_file", type=click.Path(dir_okay=False, exists=True),
              help="JSONL file, one request per line (a body, or {\"endpoint\":..., \"request\":...})")
@click.option("-e", "--endpoint", default="/v1/chat/completions", show_default=True,
              type=click.Choice(ENDPOINTS))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="transcript file (.json for one request, .jsonl for --requests)")
@click.option("--force", is_flag=True, help="overwrite an existing output file")
@server_flags("speculative", "context", "sampling")
@verbose_option
def record(url: str, request_file: str | None, requests_file: str | None, endpoint: str, output: str, force: bool,
           verbose: bool, **flags) -> None:
    """Record requests to a llama-server as replayable transcripts.

    The server's flags are not visible through its API: pass the ones it was
    started with (--spec-type, -md, --spec-draft-n-max, -c, ...), spelled as
    llama-server spells them, so a replay can use them. Requests need a fixed
    "seed". Adds "cache_prompt": false, "return_tokens": true and, on the
    OpenAI-style endpoints, "verbose": true (the server then returns the
    generated ids and the settings it used under "__verbose") unless the
    request sets them; the transcript lists what was added.

    \b
    spec-replay record http://127.0.0.1:8080 --request req.json -o t.json \\
        --spec-type draft-simple -md draft.gguf
    spec-replay record http://127.0.0.1:8080 --requests reqs.jsonl -e /completion -o runs.jsonl
    """
    from replay.cli.render import progress_bar
    from replay.commands.record import record_one, server_snapshot
    from replay.transcripts.files import check_writable, refuse_existing, write_atomic
    from replay.transcripts.format import dumps

    if bool(request_file) == bool(requests_file):
        raise click.UsageError("give exactly one of --request and --requests")
    out = Path(output)
    refuse_existing(out, force)
    check_writable(out)
    recorded = flags_block(given_flags(flags))
    items = _requests(request_file, requests_file, endpoint)  # before the server: a missing file is said so
    snapshot = server_snapshot(url)
    if request_file:
        t = record_one(url, items[0], recorded, snapshot=snapshot)
        write_atomic(out, dumps(t) + "\n", force=force)
        click.echo(f"recorded 1 request to {out}", err=True)
        return
    lines, failed = [], 0
    with progress_bar(len(items), "recording requests") as advance:
        for k, item in enumerate(items, 1):
            advance(k - 1)
            if isinstance(item, SpecReplayError):
                click.echo(f"Error: {item}", err=True)
                failed += 1
                continue
            try:
                lines.append(dumps(record_one(url, item, recorded, snapshot=snapshot), indent=None))
            except TranscriptError as e:
                click.echo(f"Error: {e}", err=True)
                failed += 1
        advance(len(items))
    if lines:
        write_atomic(out, "\n".join(lines) + "\n", force=force)
    click.echo(f"recorded {len(lines)} request(s) to {out}" + (f"; {failed} failed" if failed else ""), err=True)
    if failed:
        sys.exit(Exit.ERROR)


def _requests(request_file: str | None, requests_file: str | None, endpoint: str) -> list:
    """The requests `record` sends, read before it asks the server anything: --request's one body (checked
    as JSON) or --requests' lines (each a request item, or the SpecReplayError of a bad line)."""
    from replay.commands.record import make_item, parse_request_lines
    from replay.transcripts.files import read_text_file
    if request_file:
        text = sys.stdin.read() if request_file == "-" else read_text_file(request_file)
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise TranscriptError(f"invalid JSON ({json_error(e)})", source=request_file) from e
        return [make_item(obj, endpoint, request_file)]
    return list(parse_request_lines(read_text_file(requests_file), endpoint, requests_file))
