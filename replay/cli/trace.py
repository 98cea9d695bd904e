"""`spec-replay trace`: the server's speculative loop, step by step, checked against a transcript."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import click
from tabulate import tabulate

from replay.cli import main
from replay.cli.render import check_failed
from replay.cli.options import (
    BUILD,
    build_number,
    every_server_flag,
    json_option,
    libllama_option,
    local_flags,
    server_cpu_option,
    server_flags,
    stderr_say,
    verbose_option,
)
from replay.cli.render import shown
from replay.comparison.trace import TraceResult
from replay.report import schema as report_json
from replay.run.inputs import Inputs, Outputs
from replay.transcripts.readers import Record

if TYPE_CHECKING:
    from replay.run.trace import TraceTask
    from replay.run.tune import TuneTask


def start_loop(transcript: str | None, request_file: str | None, model: str, task: TraceTask | TuneTask, *,
               libllama: str | None, server_cpu: str | None, quiet: bool):
    """The front door of a run of the server's loop (trace, tune): its inputs read and checked in one line
    each, its engine chosen (the libllama and the CPU kernels, probed on this host) before any model
    loads. Returns (inputs, engine)."""
    from replay.run.engine import choose_engine
    inputs = Inputs.read(transcript, model, request_file=request_file, renamed=task.renamed)
    return inputs, choose_engine(inputs, flags=task.flags, options=task.options(), libllama=libllama,
                                 server_cpu=server_cpu, say=stderr_say(quiet))


@main.command()
@every_server_flag("trace")
@click.argument("transcript", required=False, type=click.Path())
@click.option("-m", "--model", metavar="FNAME", required=True, type=click.Path(), help="the target GGUF (-m)")
@click.option("--renamed-model", is_flag=True,
              help="-m (and -md) are the files the server loaded under other names: their names are not compared "
                   "with the transcript's (file type and size still are)")
@click.option("--request", "request_file", metavar="FILE", type=click.Path(dir_okay=False), help="request body for a bare response")
@click.option("--build", "build", type=BUILD,
              help="replay the loop of this llama.cpp build (b11434; default: the transcript's build_info)")
@click.option("--source", "source", type=click.Path(file_okay=False, exists=True),
              help="replay the loop of this llama.cpp checkout, recognised from its code")
@click.option("--prompt", help="without a transcript: run the loop from scratch on this prompt, as a /completion "
                              "request that sets nothing (llama-server's flags apply: --help-server-flags; --seed "
                              "defaults to 1 and -n to 32 there)")
@click.option("--steps", "steps_range", help="only show steps a:b")
@json_option("the full trace")
@click.option("--html", "html_file", type=click.Path(dir_okay=False),
              help="also write the trace as a self-contained page: the tokens coloured by where they came from")
@click.option("--force", is_flag=True, help="overwrite an existing --html file")
@verbose_option
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="trace a JSONL's records on N processes, each loading the models once (-t per worker "
                   "defaults to the cores shared out); records that share the server's state across "
                   "requests (n-gram tables, a slot's draft sampler) stay together, in order")
@click.option("--shared-batches", is_flag=True,
              help="the server ran these requests at the same time as others (several slots serving at once) "
                   "although the transcript does not show it: where every token matches and only the draft "
                   "totals differ, that is explained by the draft model's shared batches (numerics)")
@libllama_option
@server_cpu_option
@server_flags("speculative", "context", "sampling")
def trace(transcript, model, renamed_model, request_file, build, source, prompt, steps_range, as_json, html_file, force, verbose,
          libllama, server_cpu, workers, shared_batches, **flags) -> None:
    """Replay the server's speculative loop step by step.

    Shows what was drafted (with the draft's q), what the target thought (p), which
    draft tokens were accepted or rejected (with the uniform draw), the resampled
    and bonus tokens, and the logprob a fixed server would report for every
    emitted token. With a transcript it must reproduce every token and the
    draft_n/draft_n_accepted totals; the first divergence is flagged. The
    server's flags come from the transcript unless given here (spelled as
    llama-server spells them).

    \b
    spec-replay trace run.json -m target.gguf -md draft.gguf
    spec-replay trace run.json -m target.gguf -md draft.gguf --json | jq .reproduced
    spec-replay trace run.json -m target.gguf -md draft.gguf --html trace.html
    spec-replay trace -m target.gguf -md draft.gguf --spec-type draft-simple --prompt "Once upon a time" --seed 3 --temp 1
    """
    from replay.cli.render import progress_bar
    from replay.run.task import run_all
    from replay.run.trace import TraceTask, trace_report
    from replay.runtime.llama import set_verbose
    from replay.transcripts.files import write_atomic
    flags = local_flags(flags)
    set_verbose(verbose)
    if not transcript and not prompt:
        raise click.UsageError("give a TRANSCRIPT, or --prompt to run the loop from scratch")
    if transcript and prompt:
        raise click.UsageError("give a TRANSCRIPT or --prompt, not both")
    Outputs(html_file=html_file, force=force).check(transcript, request_file)
    build = build_number(build)
    task = TraceTask(flags, build, str(source) if source else None, renamed_model, shared_batches=shared_batches)
    inputs, engine = start_loop(transcript, request_file, model, task, libllama=libllama, server_cpu=server_cpu,
                                quiet=as_json)
    records = inputs.records
    session = task.open(inputs, engine)
    target = session.target
    results: list[tuple[Record | None, TraceResult]] = []
    if workers > 1 and len(records) < 2:
        click.echo("note: one record: --workers does not apply", err=True)
    if transcript and workers > 1 and len(records) > 1:
        results = _trace_on_workers(inputs, engine, task, target, workers)
    elif transcript:
        # records of one JSONL are requests to one server, in order
        with progress_bar(len(records), "tracing records") as advance:
            done = run_all(session, len(records), lambda d: advance(d.index + 1))
        results = [(records[d.index], d.result) for d in done]
    else:
        results.append((None, session.prompt(prompt)))
    for shape in dict.fromkeys(r.shape for _, r in results if r.shape is not None and r.shape.warning):
        click.echo(f"warning: {shape.warning}", err=True)
    piece = session.piece
    if html_file:  # before the report: a reader that stops early loses nothing
        from replay.report.pages import trace_page
        write_atomic(html_file, trace_page([(rec.where if rec else "--prompt", r) for rec, r in results], piece,
                                           prompt=prompt), force=force)
        click.echo(f"wrote {html_file}", err=True)
    if as_json:
        report = trace_report([(rec.index if rec else None, r) for rec, r in results], piece, engine.kernels)
        click.echo(report_json.dumps(report, indent=2))
    else:
        for rec, res in results:
            if len(results) > 1:
                click.echo(f"=== {rec.where}")
            show(res, piece, steps_range)
    bad = [(rec, r) for rec, r in results if r.reproduced is False]
    if bad:
        where = bad[0][0].where if bad[0][0] is not None else "the trace"
        first = bad[0][1].first_divergence
        at = f"token {first}" if first is not None else "the draft totals differ"
        check_failed(f"{len(bad)} of {len(results)} record(s) not reproduced (first: {where}, {at}); the report "
                     "above shows where")


def _trace_on_workers(inputs: Inputs, engine, task, target, workers: int) -> list[tuple[Record, TraceResult]]:
    """trace over `workers` processes (scale/pool.py), records that share server state kept together
    in order (commands/trace_state.py); the results in file order, the same as one process's."""
    from replay.cli.render import progress_bar
    from replay.commands.trace_state import trace_units
    from replay.scale.pool import run_units
    from replay.scale.worker import Job
    records = inputs.records
    units = trace_units(records, task.flags, target.meta)
    if len(units) < workers:
        click.echo(f"note: {len(records)} records form {len(units)} unit(s) of work (records that share the "
                   "server's state across requests stay together): fewer than --workers", err=True)
    job = Job(inputs, engine, task)
    got: dict[int, TraceResult] = {}
    with progress_bar(len(records), "tracing records") as advance:
        def on_done(d) -> None:
            got[d.index] = d.result
            advance(len(got))
        run_units(job, units, workers=workers, on_done=on_done)
    return [(rec, got[k]) for k, rec in enumerate(records)]


def show(res: TraceResult, piece: Callable[[int], str], steps_range: str | None) -> None:
    """The step table, the emitted-token table, the draft totals and the verdict."""
    a, b = 0, len(res.steps)
    if steps_range:
        x, _, y = steps_range.partition(":")
        try:
            a, b = int(x or 0), int(y or len(res.steps))
        except ValueError:
            raise click.UsageError(f"--steps takes a:b (step numbers), got {steps_range!r}") from None
    rows = []
    for s in res.steps[a:b]:
        draft = " ".join(f"{piece(t)!r}" + (f" q={s.draft_q[i]:.3f}" if s.draft_q else "") +
                         (f" p={s.target_p[i]:.3f}" if i < len(s.target_p) else "") for i, t in enumerate(s.draft))
        draws = " ".join("-" if u is None else f"{u:.3f}" for pair in s.uniforms for u in pair[:1]) if s.uniforms else ""
        rows.append([s.index, s.pos0, repr(piece(s.sampled)), s.drafter or "-", draft or "-", s.rule,
                     f"{s.accepted}/{len(s.draft)}", draws or "-",
                     repr(piece(s.resampled)) if s.resampled is not None else "-",
                     repr(piece(s.bonus)) if s.bonus is not None else "-",
                     "".join(piece(t) for t in s.emitted)])
    click.echo(tabulate(rows, headers=["step", "pos", "sampled", "drafter", "draft (q, p)", "rule", "accepted",
                                       "u", "resampled", "bonus", "emitted"]))
    click.echo()
    rows = [[e.index, e.id, repr(res.pieces[e.index]), e.step, f"{e.logprob:.4f}",
             f"{math.log(e.post_prob):.4f}" if e.post_prob > 0 else "-inf",
             ", ".join(f"{piece(i)!r} {lp:.3f}" for i, lp in e.top[:3])] for e in res.emitted]
    click.echo(tabulate(rows, headers=["#", "id", "piece", "step", "logprob", "post logprob", "top (pre)"]))
    click.echo()
    if res.shape is not None:
        click.echo(f"loop: {res.shape.era.describe()}, chosen by {res.shape.why}")
    click.echo(f"drafted {res.draft_n}, accepted {res.draft_n_accepted}" +
               (f" (server: {res.server_draft_n}, {res.server_draft_n_accepted})" if res.server_draft_n is not None else ""))
    if res.compared is not None:
        basis = "" if res.compared == "token ids" else \
            " (compared the text, chunk by chunk in a stream: the transcript lacks some token ids)"
        if res.reproduced:
            click.echo(f"reproduced: all {len(res.emitted)} tokens and the draft totals match the transcript{basis}")
        elif res.first_divergence is not None:
            i = res.first_divergence
            ours = res.emitted[i] if i < len(res.emitted) else None
            theirs = res.recorded[i] if res.recorded is not None and i < len(res.recorded) else None
            where = f"transcript {piece(theirs) if theirs is not None else '(ended)'!r}" if res.recorded is not None \
                else "the transcript's text differs there"
            click.echo(f"first divergence at token {i}: trace {piece(ours.id) if ours else '(ended)'!r}, {where}{basis}")
            if ours:
                click.echo("  trace candidates (post-sampling p): " +
                           ", ".join(f"{piece(t)!r} {p:.3f}" for t, p in ours.post_top[:5]))
            if res.server_candidates:
                click.echo("  server candidates (logprob):        " +
                           ", ".join(f"{piece(t)!r} {lp:.3f}" for t, lp in res.server_candidates[:5]))
            elif theirs is not None:
                click.echo("  server candidates: none sent for that token (placeholder or missing)")
            if res.explanation is not None:
                click.echo(f"  divergence: {res.explanation.text}")
        else:
            click.echo("tokens reproduced, but the draft totals differ from the server's timings")
            if res.explanation is not None:
                click.echo(f"  why: {res.explanation.text}")
    described = res.described()
    if described:
        click.echo("settings: " + "; ".join(f"{k} {shown(v)} ({src})" for k, v, src in described))
    for note in res.notes:
        click.echo(f"note: {note}", err=True)
