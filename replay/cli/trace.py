"""`spec-replay trace`: the server's speculative loop, step by step, checked against a transcript."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import click
from tabulate import tabulate

from replay.cli import check_failed, main
from replay.cli.kernels import choose_kernels, server_cpu_option
from replay.cli.options import (
    BUILD,
    build_number,
    choose_libllama,
    every_server_flag,
    given_flags,
    input_file,
    json_option,
    libllama_option,
    server_flags,
    verbose_option,
)
from replay.cli.render import shown
from replay.comparison.trace import TraceResult
from replay.errors import ModelError, TranscriptError
from replay.report import schema as report_json
from replay.transcripts.concurrency import shared_evidence
from replay.transcripts.readers import Record


def load_for_loop(transcript: str | None, request_file: str | None, model: str, flags: dict, *, build: int | None,
                  source: str | None, libllama: str | None, server_cpu: str | None, quiet: bool):
    """The records (none without a transcript) and the target, for a command that runs the server's loop
    (trace, tune): inputs checked in one line each, the libllama and the CPU kernels chosen (probed on this
    host) before the model loads. Returns (records, target Model, the kernels chosen)."""
    from replay.commands.recover import RecoverOptions
    from replay.runtime.gguf import check_gguf
    from replay.runtime.llama import Model, model_params
    from replay.transcripts.files import read_request
    from replay.transcripts.readers import read_file, read_source
    if transcript:
        input_file(transcript, "a transcript file", TranscriptError)
    input_file(model, "a model file", ModelError)
    check_gguf(model)
    request = read_request(request_file) if request_file else None
    records = read_file(transcript, request) if transcript else []
    choose_libllama(libllama, source, build, records, quiet=quiet)
    kernels = choose_kernels(records, text=read_source(transcript) if transcript else "", source=str(transcript),
                             request=request, model=str(Path(model).resolve()), flags=flags,
                             options=RecoverOptions(build=build, source=source and Path(source)),
                             server_cpu=server_cpu, quiet=quiet)
    return records, Model(model, **model_params(flags)), kernels


@main.command()
@every_server_flag("trace")
@click.argument("transcript", required=False, type=click.Path())
@click.option("-m", "--model", required=True, type=click.Path(), help="the target GGUF (-m)")
@click.option("--renamed-model", is_flag=True,
              help="-m (and -md) are the files the server loaded under other names: their names are not compared "
                   "with the transcript's (file type and size still are)")
@click.option("--request", "request_file", type=click.Path(dir_okay=False), help="request body for a bare response")
@click.option("--build", "build", type=BUILD,
              help="replay the loop of this llama.cpp build (b11434; default: the transcript's build_info)")
@click.option("--source", "source", type=click.Path(file_okay=False, exists=True),
              help="replay the loop of this llama.cpp checkout, recognised from its code")
@click.option("--prompt", help="without a transcript: run the loop from scratch on this prompt, as a /completion "
                              "request that sets nothing (the server flags below apply; --seed defaults to 1 and "
                              "-n to 32 there)")
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
@libllama_option
@server_cpu_option
@server_flags("speculative", "context", "sampling")
def trace(transcript, model, renamed_model, request_file, build, source, prompt, steps_range, as_json, html_file, force, verbose,
          libllama, server_cpu, workers, **flags) -> None:
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
    from replay.cli.progress import progress_bar
    from replay.commands.trace import Drafts, trace_prompt, trace_record
    from replay.commands.trace_state import ServerState
    from replay.runtime.llama import model_params, set_verbose
    from replay.transcripts.files import refuse_existing, write_atomic
    flags = given_flags(flags)
    set_verbose(verbose)
    if not transcript and not prompt:
        raise click.UsageError("give a TRANSCRIPT, or --prompt to run the loop from scratch")
    if transcript and prompt:
        raise click.UsageError("give a TRANSCRIPT or --prompt, not both")
    if html_file:
        if transcript and Path(html_file).resolve() == Path(transcript).resolve():
            raise click.UsageError("--html must not be the transcript")
        refuse_existing(html_file, force)
    build = build_number(build)
    records, target, kernels = load_for_loop(transcript, request_file, model, flags, build=build, source=source,
                                             libllama=libllama, server_cpu=server_cpu, quiet=as_json)
    drafts = Drafts(model_params(flags))
    results: list[tuple[Record | None, TraceResult]] = []
    if workers > 1 and len(records) < 2:
        click.echo("note: one record: --workers does not apply", err=True)
    if transcript and workers > 1 and len(records) > 1:
        results = _trace_on_workers(transcript, records, request_file, target, model, flags, build, source, workers,
                                    renamed_model)
    elif transcript:
        # records of one JSONL are requests to one server, in order
        with ServerState(flags.get("n_parallel")) as state, progress_bar(len(records), "tracing records") as advance:
            shared = shared_evidence(records, flags.get("n_parallel"), False)
            for rec in records:
                res = trace_record(rec, target, flags=flags, build=build, source=source and Path(source),
                                   slot_state=state.slot(rec), drafts=drafts, renamed=renamed_model,
                                   shared=shared.get(rec.index))
                results.append((rec, res.lighten()))
                advance(len(results))
    else:
        results.append((None, trace_prompt(target, prompt, flags=flags, build=build, source=source and Path(source),
                                           drafts=drafts)))
    for shape in dict.fromkeys(r.shape for _, r in results if r.shape is not None and r.shape.warning):
        click.echo(f"warning: {shape.warning}", err=True)
    piece = lambda i: target.piece(i).decode("utf-8", "replace")  # noqa: E731
    cpu = {} if kernels is None else {"kernels": kernels.to_json()}
    if html_file:  # before the report: a reader that stops early loses nothing
        from replay.report.pages import trace_page
        write_atomic(html_file, trace_page([(rec.where if rec else "--prompt", r) for rec, r in results], piece,
                                           prompt=prompt), force=force)
        click.echo(f"wrote {html_file}", err=True)
    if as_json:
        head = {"format": report_json.TRACE_FORMAT, "version": report_json.REPORT_VERSION}
        if len(results) == 1:
            click.echo(report_json.dumps({**head, **results[0][1].to_json(piece), **cpu}, indent=2))
        else:
            click.echo(report_json.dumps({**head, "records": [dict(r.to_json(piece), record=rec.index)
                                                              for rec, r in results], **cpu}, indent=2))
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


def _trace_on_workers(transcript: str, records: list[Record], request_file: str | None, target, model: str,
                      flags: dict, build: int | None, source: str | None,
                      workers: int, renamed: bool = False) -> list[tuple[Record, TraceResult]]:
    """trace over `workers` processes (scale/local.py), records that share server state kept together
    in order (commands/trace_state.py); the results in file order, the same as one process's."""
    from replay.cli.progress import progress_bar
    from replay.commands.trace_state import trace_units
    from replay.scale.local import run_local
    from replay.scale.worker import Job, TraceOptions
    units = trace_units(records, flags, target.meta)
    if len(units) < workers:
        click.echo(f"note: {len(records)} records form {len(units)} unit(s) of work (records that share the "
                   "server's state across requests stay together): fewer than --workers", err=True)
    job = Job.from_files(transcript, request_file, model, flags, workers,
                         trace=TraceOptions(build, str(Path(source).resolve()) if source else None, renamed))
    got: dict[int, TraceResult] = {}
    with progress_bar(len(records), "tracing records") as advance:
        def on_event(kind: str, what) -> None:
            if kind == "done":
                got[what.index] = what.result
                advance(len(got))
        run_local(job, units, workers, on_event)
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
        click.echo(f"note: {note}")
