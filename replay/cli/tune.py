"""`spec-replay tune`: the transcript's traffic replayed under other speculative settings (commands/tune.py)."""
from __future__ import annotations

import click
from tabulate import tabulate

from replay.cli import main
from replay.cli.kernels import server_cpu_option
from replay.cli.options import (
    BUILD,
    build_number,
    every_server_flag,
    given_flags,
    json_option,
    libllama_option,
    server_flags,
    verbose_option,
)
from replay.cli.trace import load_for_loop
from replay.errors import SettingsError
from replay.report import schema as report_json


@main.command()
@every_server_flag("trace")
@click.argument("transcript", type=click.Path())
@click.option("-m", "--model", required=True, type=click.Path(), help="the target GGUF (-m)")
@click.option("--vary", "varies", multiple=True, required=True, metavar="FLAG=V1,V2,...",
              help="a loop setting and its values, spelled as llama-server spells it (--spec-draft-n-max=2,4,8; "
                   "--spec-type=draft-simple,ngram-mod, several types joined by +); repeat for a grid")
@click.option("--renamed-model", is_flag=True,
              help="-m (and -md) are the files the server loaded under other names: their names are not compared "
                   "with the transcript's (file type and size still are)")
@click.option("--request", "request_file", type=click.Path(dir_okay=False), help="request body for a bare response")
@click.option("--build", "build", type=BUILD,
              help="replay the loop of this llama.cpp build (b11434; default: the transcript's build_info)")
@json_option("every setting's counts, record by record")
@verbose_option
@libllama_option
@server_cpu_option
@server_flags("speculative", "context", "sampling")
def tune(transcript, model, varies, renamed_model, request_file, build, as_json, verbose, libllama, server_cpu,
         **flags) -> None:
    """Replay the transcript's requests under other speculative settings.

    Every record is replayed with the server's own loop under the
    transcript's settings (which must reproduce its tokens and draft totals)
    and under every combination of the --vary lists, on a fresh server each,
    counting target and draft decodes, drafted and accepted tokens, and
    acceptance by draft position. At temperature 0 the counts are exact for
    this traffic; at temperature > 0 they are one sampled run's. Settings are
    ranked by target decodes per emitted token (no speed prediction yet).

    \b
    spec-replay tune evals.jsonl -m target.gguf -md draft.gguf --vary --spec-draft-n-max=2,4,8,16
    spec-replay tune evals.jsonl -m target.gguf --vary --spec-type=ngram-mod,ngram-simple --json
    """
    from replay.cli.progress import progress_bar
    from replay.commands.trace import Drafts
    from replay.commands.tune import sweep
    from replay.commands.tune import tune as run_tune
    from replay.runtime.llama import model_params, set_verbose
    flags = given_flags(flags)
    set_verbose(verbose)
    try:
        n_settings = len(sweep(varies))  # a bad --vary is a usage error, before anything loads
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    build = build_number(build)
    records, target, _ = load_for_loop(transcript, request_file, model, flags, build=build, source=None,
                                       libllama=libllama, server_cpu=server_cpu, quiet=as_json)
    with progress_bar(n_settings * len(records), "replaying settings x records") as advance:
        runs = run_tune(records, target, varies, flags=flags, drafts=Drafts(model_params(flags)), build=build,
                        renamed=renamed_model, progress=lambda done, total: advance(done))
    if as_json:
        click.echo(report_json.dumps({"format": "spec-replay-tune", "version": report_json.REPORT_VERSION,
                                      "settings": [r.to_json() for r in runs]}, indent=2))
        return
    ranked = [runs[0]] + sorted(runs[1:], key=lambda r: (r.decodes_per_token is None, r.decodes_per_token or 0))
    rows = []
    for r in ranked:
        by_pos = r.by_position()
        rows.append([r.setting.spelled, r.tokens, r.total("drafted"), r.total("accepted"),
                     "-" if r.acceptance is None else f"{r.acceptance:.2f}", r.target_decodes,
                     "-" if r.decodes_per_token is None else f"{r.decodes_per_token:.3f}",
                     sum(x.draft[0] for x in r.records),
                     " ".join("-" if p is None else f"{p:.2f}" for p in by_pos[:8]) + (" ..." if len(by_pos) > 8 else "")])
    click.echo(tabulate(rows, headers=["setting", "tokens", "drafted", "accepted", "acceptance", "target decodes",
                                       "decodes/token", "draft decodes", "acceptance by position"]))
    sampled = [x.record for x in runs[0].records if not x.exact]
    if sampled:
        click.echo(f"note: records {', '.join(map(str, sampled[:10]))}{' ...' if len(sampled) > 10 else ''} sample at "
                   "temperature > 0: their counts are one run with the request's seed under each setting, not an "
                   "expectation")
    moved = sorted({x.record for r in runs[1:] for x in r.records if x.exact and x.same_tokens is False})
    if moved:
        click.echo(f"note: at temperature 0, records {', '.join(map(str, moved[:10]))} emit other tokens under some "
                   "setting: its verify batches moved a near-tie (batch numerics), so those counts are that "
                   "setting's own run")
