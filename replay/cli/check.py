"""`spec-replay check` (audit a running server) and `demo` (start one and audit it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from tabulate import tabulate

from replay.cli import main
from replay.cli.options import every_server_flag, given_flags, json_option, libllama_option, server_flags, verbose_option
from replay.errors import Exit, KernelsError, ServerError
from replay.report import schema as report_json
from replay.settings import BY_ATTR


def _token_rows(tokens: list[dict]) -> str:
    rows = [[r["index"], r["id"], repr(r["token"]), f"{r['logprob']:.4f}", r["n_top"],
             "PLACEHOLDER" if r["placeholder"] else "real"] for r in tokens]
    return tabulate(rows, headers=["#", "id", "token", "logprob", "top", "status"])


@main.command()
@every_server_flag("check")
@click.argument("url")
@json_option("the audit")
@click.option(*BY_ATTR["n_predict"].names, "probe_tokens", type=click.IntRange(min=1), default=48, show_default=True,
              help="tokens the probe request asks for")
@click.option("--n-probs", type=click.IntRange(min=1), default=3, show_default=True,
              help="alternatives the probe asks for per token (its n_probs)")
@click.option("--prompt", default=None, help="probe prompt (default: a repetitive sentence)")
@click.option("-m", "--model", metavar="FNAME", type=click.Path(dir_okay=False, exists=True),
              help="the server's target GGUF, here too: then say which CPU kernels the server computes with (the "
                   "variant of a release-style libllama that reproduces its first entry)")
@click.option(*BY_ATTR["draft_model"].names, "draft", type=click.Path(), metavar=BY_ATTR["draft_model"].metavar,
              help="the server's draft GGUF: taken as the server spells it, and not used (no endpoint of the "
                   "server names its draft, so there is nothing to check it against)")
@libllama_option(source=False)
@server_flags("speculative", exclude=("draft_model",))
@verbose_option
def check(url: str, as_json: bool, probe_tokens: int, n_probs: int, prompt: str | None, model: str | None,
          draft: str | None, libllama: str | None, verbose: bool, **flags) -> None:
    """Check a running llama-server for placeholder probabilities.

    Exit 0: every token carries real probabilities; 1: placeholders found;
    3: cannot tell (unreachable, not llama.cpp, no probabilities, no drafting).
    Warnings go to stderr.
    Give the speculative flags the server was started with (--spec-type ...) to
    have them checked against what its /slots report.

    \b
    spec-replay check http://127.0.0.1:8080
    spec-replay check http://127.0.0.1:8080 --spec-type ngram-mod
    spec-replay check http://127.0.0.1:8080 --json | jq .verdict
    """
    from replay.commands.check import PROBE_PROMPT
    from replay.commands.check import check as run_check
    res = run_check(url, n_predict=probe_tokens, n_probs=n_probs, prompt=prompt or PROBE_PROMPT,
                    expected=given_flags(flags))
    _unreachable(res, as_json)
    kernels = _server_kernels(url, model, libllama, prompt or PROBE_PROMPT, n_probs, as_json) if model else None
    if as_json:
        click.echo(report_json.dumps({**res.to_json(), **({"kernels": kernels} if model else {})}, indent=2))
    else:
        click.echo(f"server:      {res.url}  ({res.build_info or 'unknown build'})")
        shape = res.loop_shape
        click.echo(f"loop:        {shape.era.describe()}")
        if shape.warning:
            click.echo(f"warning: {shape.warning}", err=True)
        if res.props_speculative is not None or res.slots_speculative is not None:
            click.echo(f"/props:      speculative.types = {res.props_speculative!r}")
            click.echo(f"/slots:      speculative = {res.slots_speculative}")
        if res.contradiction:
            click.echo("warning: /props says speculation is off but /slots says it is on; "
                       "/props does not reflect --spec-type", err=True)
        for w in res.warnings:
            click.echo(f"warning: {w}", err=True)
        if res.draft_n is not None:
            click.echo(f"probe:       drafted {res.draft_n}, accepted {res.draft_n_accepted}")
        if res.tokens:
            click.echo(_token_rows(res.tokens))
        if model:
            click.echo(f"kernels:     {kernels['description']}")
            for line in kernels.get("crashes") or ():
                click.echo(f"             {line}")
        click.echo(f"verdict:     {res.verdict}")
    if res.exit_code == Exit.ERROR and not as_json:
        click.echo(f"Error: cannot tell: {res.verdict}", err=True)
    sys.exit(res.exit_code)


def _unreachable(res, as_json: bool) -> None:
    """A server that cannot be reached, or is no llama.cpp server, is a failure like any other: one line,
    or {"error": ...} under --json (an audit is for a server that answered)."""
    if res.exit_code == Exit.ERROR and res.build_info is None and not res.tokens:
        raise ServerError(f"cannot tell: {res.verdict}")


def _probe_say(quiet: bool):
    """check's probe says its kernel lines (unless quiet) and warnings, not which libllama it replays on
    (the audit is about the server)."""
    def say(line: str, warning: bool = False, detail: bool = False) -> None:
        from replay.runtime.llama import verbose
        if detail and not verbose():
            return
        if warning or not (quiet or line.startswith(("libllama:", "hint:"))):
            click.echo(line, err=True)
    return say


def _server_kernels(url: str, model: str, libllama: str | None, prompt: str, n_probs: int, quiet: bool) -> dict:
    """Which CPU variant computes the server's values: one single-token request recorded as a
    transcript, its first entry probed under every variant this host runs (run/engine.py)."""
    from replay.commands.record import make_item, record_one
    from replay.errors import SpecReplayError
    from replay.run.engine import choose_engine
    from replay.run.inputs import Inputs
    body = {"prompt": prompt, "n_predict": 2, "n_probs": max(1, n_probs), "temperature": 0.0, "seed": 1,
            "cache_prompt": False}
    try:
        text = json.dumps(record_one(url, make_item(body, "/completion", "check"), {}))
        inputs = Inputs(text, "<check probe>", None, str(Path(model).resolve()))
        engine = choose_engine(inputs, flags={}, libllama=libllama, say=_probe_say(quiet))
    except KernelsError as e:
        return {"variant": None, "how": "none", "description": str(e)}
    except SpecReplayError as e:
        return {"variant": None, "how": "error", "description": f"cannot tell: {e}"}
    if engine.kernels is None:
        return {"variant": None, "how": "none", "description": "cannot tell: the libllama here links one CPU backend "
                "in; `spec-replay build --build bN` builds every CPU variant of the server's build"}
    return engine.kernels.to_json()


@main.command()
@click.option("-m", "--model", metavar="FNAME", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="target GGUF (default: the committed tiny fixture)")
@click.option(*BY_ATTR["draft_model"].names, "draft", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="draft GGUF (default: the committed tiny noisy draft)")
@click.option("--prompt", default="bcdbcbcdbcbcdbc", show_default=True, help="the probe prompt")
@click.option(*BY_ATTR["n_predict"].names, "n_predict", type=click.IntRange(min=1), default=12, show_default=True,
              help="tokens the probe request asks for")
@click.option("--n-probs", type=click.IntRange(min=1), default=3, show_default=True,
              help="alternatives the probe asks for per token (its n_probs)")
@json_option("the audit (the shape of `check --json`)")
@verbose_option
def demo(model: Path | None, draft: Path | None, prompt: str, n_predict: int, n_probs: int, as_json: bool,
         verbose: bool) -> None:
    """Start a speculating llama-server on tiny models and check it.

    Builds llama-server on first use (a few minutes, cached), serves the
    committed tiny fixtures, and runs `check` against it: the table shows the
    placeholder logprobs of every token from the speculative loop.

    \b
    spec-replay demo
    spec-replay demo -m target.gguf -md draft.gguf --prompt "Once upon a time"
    spec-replay demo --json | jq .verdict
    """
    from replay.commands.check import check as run_check
    from replay.llamacpp.build import ensure_built
    from replay.llamacpp.models import tiny_draft, tiny_target
    from replay.llamacpp.process import LlamaServer, ServerConfig
    bins = ensure_built(log=lambda line: click.echo(line, err=True))  # a first build takes minutes: always say
    model, draft = model or tiny_target(), draft or tiny_draft()
    cfg = ServerConfig(model, draft_model=draft, spec_types=("draft-simple",))
    with LlamaServer(cfg, binary=bins.server) as srv:
        click.echo(f"started {bins.build_info} llama-server at {srv.url}: -m {model.name} -md {draft.name} "
                   f"--spec-type draft-simple, on {srv.kernels.describe()}", err=True)
        res = run_check(srv.url, n_predict=n_predict, n_probs=n_probs, prompt=prompt)
    if as_json:
        click.echo(report_json.dumps(res.to_json(), indent=2))
        return
    click.echo(_token_rows(res.tokens))
    click.echo(f"/props speculative.types = {res.props_speculative!r}, /slots speculative = {res.slots_speculative}")
    click.echo(f"verdict: {res.verdict}")
