"""`spec-replay tune`: the transcript's traffic replayed under other speculative settings (commands/tune.py)."""
from __future__ import annotations

from typing import Any

import click
from tabulate import tabulate

from replay.cli import main
from replay.cli.options import (
    BUILD,
    build_number,
    every_server_flag,
    json_option,
    libllama_option,
    local_flags,
    server_cpu_option,
    server_flags,
    verbose_option,
)
from replay.cli.trace import start_loop
from replay.errors import SettingsError, TranscriptError
from replay.report import schema as report_json
from replay.run.inputs import Outputs


@main.command()
@every_server_flag("trace")
@click.argument("transcript", type=click.Path())
@click.option("-m", "--model", metavar="FNAME", required=True, type=click.Path(), help="the target GGUF (-m)")
@click.option("--vary", "varies", multiple=True, required=True, metavar="FLAG=V1,V2,...",
              help="a loop setting and its values, spelled as llama-server spells it (--spec-draft-n-max=2,4,8; "
                   "--spec-type=draft-simple,ngram-mod, several types joined by +); repeat for a grid")
@click.option("--measure", is_flag=True,
              help="measure decode and sampling costs on this host with these models for the speed prediction "
                   "(scaled to the transcript's timings where it has usable ones); without it the costs are "
                   "fitted to the timings alone, where they allow")
@click.option("--samples", type=click.IntRange(min=1), default=1, show_default=True,
              help="passes over the file per setting, each record with the request's seed, then the next seeds "
                   "(records at temperature > 0 draw other text; at 0 only what earlier records left in the n-gram "
                   "tables can change): the mean over passes, with a 95% interval from 5 passes on")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="replay settings in this many processes (each loads the models)")
@click.option("--html", "html_file", type=click.Path(dir_okay=False),
              help="also write a self-contained page with plots (acceptance by position, predicted speed-up, "
                   "per-record spread)")
@click.option("--force", is_flag=True, help="overwrite an existing --html file")
@click.option("--renamed-model", is_flag=True,
              help="-m (and -md) are the files the server loaded under other names: their names are not compared "
                   "with the transcript's (file type and size still are)")
@click.option("--request", "request_file", metavar="FILE", type=click.Path(dir_okay=False), help="request body for a bare response")
@click.option("--build", "build", type=BUILD,
              help="replay the loop of this llama.cpp build (b11434; default: the transcript's build_info)")
@json_option("every setting's counts, record by record, and the speed model")
@verbose_option
@libllama_option(source=False)
@server_cpu_option
@server_flags("speculative", "context", "sampling")
def tune(transcript, model, varies, measure, samples, workers, html_file, force, renamed_model, request_file, build,
         as_json, verbose, libllama, server_cpu, **flags) -> None:
    """Replay the transcript's requests under other speculative settings.

    Every record is replayed with the server's own loop under the
    transcript's settings (which must reproduce its tokens and draft totals)
    and under every combination of the --vary lists, on a fresh server each,
    counting target and draft decodes by batch size, drafted and accepted
    tokens, acceptance by draft position, and the verifier's expected
    acceptance. At temperature 0 the counts are exact for this traffic; at
    temperature > 0 they are one sampled run's (--samples for more). A cost
    model (--measure, or fitted to the transcript's timings) predicts
    tokens per second and the speed-up against no speculation; settings are
    ranked by it.

    \b
    spec-replay tune evals.jsonl -m target.gguf -md draft.gguf --vary --spec-draft-n-max=2,4,8,16 --measure
    spec-replay tune evals.jsonl -m target.gguf --vary --spec-type=ngram-mod,ngram-simple --json
    """
    from replay.cli.render import progress_bar
    from replay.commands.tune import against_baseline, cost_table
    from replay.run.tune import TuneTask, run_sweep
    from replay.runtime.llama import set_verbose
    from replay.transcripts.files import write_atomic
    flags = local_flags(flags)
    set_verbose(verbose)
    task = TuneTask(flags, tuple(varies), build_number(build), renamed_model, samples)
    try:
        settings = task.settings()  # a bad --vary is a usage error, before anything loads
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    Outputs(html_file=html_file, force=force).check(transcript, request_file)
    inputs, engine = start_loop(transcript, request_file, model, task, libllama=libllama, server_cpu=server_cpu,
                                quiet=as_json)
    session = task.open(inputs, engine)
    session.check()
    prepared, target = session.prepared, session.target
    if samples > 1 and session.samples == 1:
        click.echo("note: every record samples at temperature 0: --samples adds nothing", err=True)
    total = len(settings) * len(inputs.records) * session.samples
    with progress_bar(total, "replaying settings x records") as advance:
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            advance(done[0])
        if workers > 1 and len(settings) > 1:
            runs = against_baseline(_tune_on_workers(inputs, engine, task, workers, progress=step))
        else:
            runs = run_sweep(session, progress=step)
    table, notes = None, []
    try:
        table, notes = cost_table(prepared, runs, target, how="measure" if measure else "timings",
                                  flags=session.flags, drafts=session.drafts)
    except TranscriptError as e:
        if measure:
            raise
        notes.append(f"no speed prediction: {e}")
    payload = {"format": "spec-replay-tune", "version": report_json.REPORT_VERSION,
               "speed_model": None if table is None else table.to_json(), "notes": notes,
               "settings": [r.to_json(table) for r in runs]}
    if html_file:
        from replay.report.pages import tune_page
        write_atomic(html_file, tune_page(payload), force=force)
    if as_json:
        click.echo(report_json.dumps(payload, indent=2))
        return
    show(runs, table, notes, session.samples)
    if html_file:
        click.echo(f"wrote {html_file}", err=True)


def _tune_on_workers(inputs, engine, task, workers: int, progress) -> list:
    """Settings over `workers` processes (scale/pool.py), each loading the models and reading the records
    once; the baseline is checked wherever it runs (its error stops the run)."""
    from replay.scale.pool import run_units
    from replay.scale.worker import Job
    from replay.transcripts.chains import Unit
    n = len(task.settings())
    job = Job(inputs, engine, task)
    got: dict[int, Any] = {}
    run_units(job, [Unit((k,)) for k in range(n)], workers=workers,
              on_done=lambda d: got.__setitem__(d.index, d.result), on_progress=progress)
    return [got[k] for k in range(n)]


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def show(runs, table, notes: list[str], samples: int) -> None:
    """The ranked table and what its numbers are."""
    if table is not None:
        ranked = sorted(runs, key=lambda r: -(r.speed(table)[0] or 0.0))
    else:
        ranked = [runs[0]] + sorted(runs[1:], key=lambda r: (r.decodes_per_token is None, r.decodes_per_token or 0))
    rows = []
    for r in ranked:
        by_pos = r.by_position()
        exp = r.expected
        partial = exp is not None and r.expected_records < len(r.records)
        over = r.sampled() if samples > 1 else None
        acc = over["acceptance"].describe("{:.2f}") if over and "acceptance" in over else _f(r.acceptance)
        row = [r.setting.spelled, r.tokens, r.total("drafted"), r.total("accepted"), acc,
               _f(None if exp is None else exp.acceptance) + ("*" if partial else ""), _f(r.decodes_per_token, "{:.3f}"),
               sum(x.draft[0] for x in r.records),
               " ".join(_f(p) for p in by_pos[:8]) + (" ..." if len(by_pos) > 8 else "")]
        if table is not None:
            tps, up = r.speed(table)
            samp = r.sampled(table) if samples > 1 and tps is not None else None
            if samp and "tokens_per_second" in samp and "speedup" in samp:
                row += [samp["tokens_per_second"].describe("{:.1f}"), samp["speedup"].describe("{:.2f}") + "x"]
            else:
                row += [_f(tps, "{:.1f}"), _f(up, "{:.2f}x")]
        rows.append(row)
    headers = ["setting", "tokens", "drafted", "accepted", "acceptance", "expected", "decodes/token", "draft decodes",
               "acceptance by position"] + (["predicted tok/s", "speed-up"] if table is not None else [])
    click.echo(tabulate(rows, headers=headers))
    if table is not None:
        click.echo(f"speed model: {table.source}; speed-up is against the same tokens without speculation; "
                   "ranked by predicted tok/s")
    else:
        click.echo("ranked by target decodes per token (no speed model: give --measure)")
    if samples > 1:
        click.echo(f"acceptance{', predicted tok/s and speed-up' if table is not None else ''}: the mean over "
                   f"{samples} passes{' [95% interval]' if samples >= 5 else ''}; tokens, drafted, accepted and "
                   "decodes: the request's own seeds")
        unpriced = [r.setting.spelled for r in runs if not r.priced(table)]
        if unpriced:
            click.echo(f"note: no prediction for {', '.join(unpriced)}: the timings fit saw no draft-model decodes to "
                       "price theirs (--measure times them)", err=True)
    for n in notes:
        click.echo(f"note: {n}", err=True)
    base = runs[0].records
    sampled = [x.record for x in base if not x.exact]
    if sampled:
        how = (f"{samples} runs each (the request's seed and the next {samples - 1}): mean [95% interval]"
               if samples >= 5 else f"{samples} runs each (the request's seed and the next {samples - 1}): their mean "
               "(an interval needs 5)" if samples > 1 else "one run with the request's seed")
        click.echo(f"note: records {', '.join(map(str, sampled[:10]))}{' ...' if len(sampled) > 10 else ''} sample at "
                   f"temperature > 0: their counts are {how}; 'expected' is the verifier's expectation given each "
                   "draft (exact over its draws)", err=True)
    moved = sorted({x.record for r in runs[1:] for x in r.records if x.exact and x.same_tokens is False})
    if moved:
        click.echo(f"note: at temperature 0, records {', '.join(map(str, moved[:10]))} emit other tokens under some "
                   "setting: its verify batches moved a near-tie (batch numerics), so those counts are that "
                   "setting's own run", err=True)
    why = sorted({x.no_expectation for r in runs for x in r.records if x.no_expectation})
    if why:
        click.echo(f"note: no expected acceptance for records where {'; '.join(why)}"
                   + (" (*: over the other records)" if any(r.expected is not None for r in runs) else ""), err=True)
