"""`spec-replay proxy`: real logprobs, live, in front of an unpatched speculating llama-server."""
from __future__ import annotations

from pathlib import Path

import click

from replay.cli import main
from replay.cli.options import libllama_option, local_flags, server_cpu_option, server_flags, verbose_option
from replay.errors import UsageError
from replay.settings import flags_block


@main.command()
@click.argument("url")
@click.option("-m", "--model", metavar="FNAME", required=True, type=click.Path(exists=True, dir_okay=False),
              help="the target GGUF the server runs (-m)")
@click.option("--host", default="127.0.0.1", show_default=True, help="the address the proxy listens on")
@click.option("--port", default=8090, show_default=True, type=click.IntRange(1, 65535), help="its port")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="replay worker processes, each with its own libllama and models")
@click.option("--backlog", default=64, show_default=True, type=click.IntRange(min=0),
              help="requests the proxy may hold beyond one per worker (at the server or waiting for a worker); "
                   "one more is answered 503")
@click.option("--on-failure", type=click.Choice(["error", "pass"]), default="error", show_default=True,
              help="a response whose values cannot be given exactly: an HTTP 500 with the reason, or the "
                   "server's response unchanged with the reason in the X-Spec-Replay-Unfilled header")
@click.option("--serial", is_flag=True,
              help="forward generation requests one at a time: the server then never decodes two of them in "
                   "one batch, so values that would be approximate (shared batches) are exact; the server's "
                   "throughput becomes one request's")
@server_flags("speculative", "context", "sampling")
@libllama_option(source=False)
@server_cpu_option
@verbose_option
def proxy(url: str, model: str, host: str, port: int, workers: int, backlog: int, on_failure: str, serial: bool,
          libllama: str | None, server_cpu: str | None, verbose: bool, **flags) -> None:
    """Serve the llama-server at URL with the real probabilities filled in.

    Every request is forwarded to URL. A /completion, /v1/completions or
    /v1/chat/completions response that carries probabilities (n_probs,
    logprobs/top_logprobs) comes back with every placeholder and missing value
    replaced by the value the server computed, as `recover` computes it, in the
    same schema, with the header X-Spec-Replay-Filled: N. Everything else
    passes through unchanged. Give the flags the server was started with
    (-md, --spec-type, -c, ...), spelled as llama-server spells them.

    \b
    spec-replay proxy http://127.0.0.1:8080 -m target.gguf -md draft.gguf --spec-type draft-simple
    OPENAI_BASE_URL=http://127.0.0.1:8090/v1 my-eval-harness ...
    """
    try:
        import pebble  # noqa: F401
        from aiohttp import web
    except ImportError as e:
        raise UsageError(f"spec-replay proxy needs {e.name}: pip install -e '.[proxy]'") from None
    from replay.commands.record import server_snapshot
    from replay.proxy.app import Proxy, Settings
    from replay.proxy.filler import Filler

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"URL must start with http:// or https://, got {url!r}")
    given = local_flags(flags)
    server_snapshot(url)  # the upstream is a llama.cpp server, now: else one line and exit 3
    recorded = flags_block(given)
    log = (lambda line: click.echo(line, err=True)) if verbose else None
    app = Proxy(Settings(url, recorded, workers=workers, backlog=backlog, on_failure=on_failure, serial=serial,
                         log=log),
                Filler(Path(model), libllama=libllama, server_cpu=server_cpu)).app()
    click.echo(f"proxy: http://{host}:{port} -> {url} (values filled by {workers} worker(s), backlog {backlog})",
               err=True)
    # SIGINT/SIGTERM: stop accepting, let the requests held finish (up to 60 s), then stop the workers
    web.run_app(app, host=host, port=port, print=None, handler_cancellation=True, shutdown_timeout=60.0)
