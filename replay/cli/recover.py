"""`spec-replay recover` and `diff`: the real logprobs of recorded transcripts."""
from __future__ import annotations

import math
from pathlib import Path

import click

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
from replay.commands.recover import RecoverOptions
from replay.comparison.values import DEFAULT_TOLERANCE
from replay.report import schema as report_json
from replay.report.recovery import RecoverResult
from replay.run.inputs import Inputs, Outputs


def _recover_options(fn):
    opts = [
        click.argument("transcript", type=click.Path()),
        click.option("-m", "--model", metavar="FNAME", required=True, type=click.Path(),
                     help="the target GGUF the server ran (-m)"),
        click.option("--renamed-model", is_flag=True,
                     help="-m is the file the server loaded under another name: its name is not compared with "
                          "the transcript's (its file type and size still are)"),
        click.option("--request", "request_file", metavar="FILE", type=click.Path(),
                     help="the request body, for a transcript that is a bare response"),
        click.option("--report", "report_file", type=click.Path(dir_okay=False),
                     help="also write the per-token report as JSON"),
        click.option("--tolerance", default=DEFAULT_TOLERANCE, show_default=True, type=TOLERANCE,
                     help="max |server - true| logprob for a real value to count as ok"),
        click.option("--no-prefix-reuse", is_flag=True,
                     help="evaluate every record's prompt from scratch (by default KV cells of a prompt prefix "
                          "shared with the previous record are kept where that is bit-exact: whole -ub blocks)"),
        click.option("--build", "build", type=BUILD,
                     help="the server's llama.cpp build (b11434), when the transcript's build_info does not say"),
        click.option("--source", "source", type=click.Path(file_okay=False, exists=True, path_type=Path),
                     help="the server's llama.cpp checkout: its loop shape is read from the code"),
        click.option("--server-backend", metavar="NAME",
                     help="what the server computed on, when its flags (-dev, -ngl) do not say and it was not "
                          "this machine's CPU kernels: a GPU (CUDA0, Metal, Vulkan0...) or another CPU (e.g. "
                          "\"arm64 NEON\"); its real values are then judged like batches (kept when within "
                          "the bound), placeholders get this replay's values"),
        click.option("--shared-batches", is_flag=True,
                     help="the server decoded these requests in batches shared with other requests (several slots "
                          "serving at once) although the transcript does not show it: its real values are then "
                          "judged like batches (kept when within the bound) instead of by --tolerance"),
        json_option("the report (every record and token)"),
        click.option("--html", "html_file", type=click.Path(dir_okay=False),
                     help="also write the report as a self-contained page: server vs true logprob per token"),
        click.option("--force", is_flag=True, help="overwrite existing output/report/page files"),
        verbose_option,
        server_flags("speculative", "context", "sampling"),
        libllama_option,
        server_cpu_option,
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


class _Tolerance(click.ParamType):
    """--tolerance: a finite number of nats, 0 or more (a negative or NaN one would call every value
    wrong, an infinite one every value right)."""

    name = "NATS"

    def convert(self, value, param, ctx):
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of nats", param, ctx)
        if not math.isfinite(x) or x < 0:
            self.fail(f"{value!r}: give a finite number of nats, 0 or more", param, ctx)
        return x


TOLERANCE = _Tolerance()


EVERY = 1 << 62  # _start's guess_up_to for a run of any number of records in _in_process (diff)


def _start(transcript: str, model: str, request_file: str | None, flags: dict, *, renamed_model: bool,
           tolerance: float, no_prefix_reuse: bool, build: str | None, source: Path | None,
           server_backend: str | None, shared_batches: bool, libllama: str | None, server_cpu: str | None,
           as_json: bool, verbose: bool, guess_up_to: int = 0):
    """The run's front door (run/): its inputs read and checked, its engine chosen; (inputs, engine, task).
    `guess_up_to`: a file of at most this many records runs in _in_process, which can start again on
    other kernels, so the best may be tried on the run itself (run/kernels/policy.py)."""
    from replay.run.engine import choose_engine
    from replay.run.recover import RecoverTask
    from replay.runtime.llama import set_verbose
    inputs = Inputs.read(transcript, model, request_file=request_file, renamed=renamed_model)
    options = RecoverOptions(tolerance=tolerance, reuse_prefix=not no_prefix_reuse, server_backend=server_backend,
                             build=build_number(build), source=source, shared_batches=shared_batches,
                             renamed_model=renamed_model)
    engine = choose_engine(inputs, flags=flags, options=options, libllama=libllama, server_cpu=server_cpu,
                           say=stderr_say(as_json, verbose), guess=len(inputs.records) <= guess_up_to)
    set_verbose(verbose)
    return inputs, engine, RecoverTask(flags, options)


def _in_process(inputs: Inputs, engine, task, started: dict) -> RecoverResult:
    """Every record recovered in this process. Where the kernels tried first (run/kernels/policy.py) do not
    reproduce the first entry, this process holds their ggml: the run starts again, kernels probed, in a
    fresh process of its own (`started`: _start's arguments)."""
    from replay.cli.render import progress_bar
    from replay.errors import KernelsRetry
    from replay.run.recover import recover_inputs
    try:
        with progress_bar(len(inputs.records), "recovering records") as advance:
            return recover_inputs(inputs, engine, task, progress=lambda done, total: advance(done))
    except KernelsRetry as e:
        if engine.tried is None:
            raise
        stderr_say(started["as_json"])(f"kernels: {e}", False)
    import concurrent.futures as cf
    import multiprocessing as mp
    from replay.errors import WorkerDied
    try:
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:  # its own probes run under it
            return pool.submit(_afresh, started).result()
    except cf.process.BrokenProcessPool:
        raise WorkerDied("the process that started the run again (kernels probed) died; nothing written") from None


def _afresh(started: dict) -> RecoverResult:  # pragma: no cover - in the fresh process
    """_in_process's run again, in a fresh process, with the kernels probed (nothing tried first)."""
    inputs, engine, task = _start(**started)
    return _in_process(inputs, engine, task, started)


def _show(res: RecoverResult, as_json: bool) -> None:
    from replay.cli.render import shown, summary_table, token_table
    if as_json:
        click.echo(report_json.dumps(res.to_json(), indent=2))
        return
    if len(res.records) == 1:
        click.echo(token_table(res.records[0]))
        click.echo()
        if res.records[0].settings:
            click.echo("settings: " + "; ".join(f"{k} {shown(v)} ({src})" for k, v, src in res.records[0].settings))
    click.echo(summary_table(res))
    shapes = dict.fromkeys((r.shape.era.describe(), r.shape.why, r.shape.warning, r.replay_backend, r.server_backend,
                            (r.cpu or {}).get("variant")) for r in res.records if r.shape is not None)
    for era, why, warning, ours, theirs, variant in shapes:
        click.echo(f"loop: {era}, chosen by {why}; values computed on {ours}" +
                   (f" ({variant} kernels)" if variant else "") +
                   (f" (the server's: {theirs})" if theirs != ours else ""))
        if warning:
            click.echo(f"warning: {warning}", err=True)
    for r in res.records:
        for note in r.notes:
            click.echo(f"note: {r.source}, record {r.record}: {note}", err=True)
    for r in res.records:
        approx = r.approximation() if r.recovered else None
        if approx is not None and approx[0] is not None:
            click.echo(f"approximate: {r.source}, record {r.record}: within {approx[0]:.3g} nats ({approx[1]})", err=True)


def _write(res: RecoverResult, outputs: Outputs, force: bool) -> None:
    """--report and --html, before anything is shown (report/recovery.py, report/pages.py)."""
    from replay.report.pages import write_page
    from replay.report.recovery import write_report
    write_report(outputs.report_file, res, force)
    if write_page(outputs.html_file, res, force):
        click.echo(f"wrote {outputs.html_file}", err=True)


def _wrote(out: Path, res: RecoverResult, n_records: int, extra: str = "") -> None:
    s = res.summary()
    click.echo(f"wrote {out}: {s['counts']['placeholder']} placeholder and {s['counts']['missing']} missing "
               f"value(s) recovered in {n_records} record(s){extra}", err=True)


@main.command()
@every_server_flag("recover")
@_recover_options
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="where to write the repaired transcript")
@click.option("--in-place", is_flag=True, help="replace the input file (atomically) with the repaired one")
@click.option("--resume", is_flag=True, help="continue an interrupted multi-record run (OUT.partial), with any "
                                             "number of workers")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="recover a JSONL's records on N processes, each loading the model once (-t per worker "
                   "defaults to the cores shared out); the output is the same bytes as one worker's")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="run the workers as Ray actors on this cluster (an address, or 'auto'); needs "
                   "pip install -e '.[ray]' in the checkout. --workers sets how many actors")
def recover(transcript, model, renamed_model, request_file, report_file, tolerance, no_prefix_reuse, build, source,
            server_backend, shared_batches, as_json, html_file, force,
            verbose, libllama, server_cpu, output, in_place, resume, workers, ray_address, **flags) -> None:
    """Recover a transcript's real logprobs into a repaired copy.

    Replays the target model in-process with the server's decode schedule and
    puts the true values (and top-N alternatives) where the server sent
    placeholders or nothing, in the same file shape: a stream stays a stream,
    JSONL stays JSONL, every other field is kept. Values the server really
    sent are left as they were and checked. The server's context flags (-c,
    -b, -ub, -fa, -ctk, -ctv) come from the transcript unless given here.

    A JSONL of many records is written record by record to OUT.partial and
    moved to OUT at the end: an interrupted run keeps its finished records,
    and --resume continues after them (the result is byte-identical).

    \b
    spec-replay recover run.json -m SmolLM2-135M-Instruct.Q4_1.gguf -o run.fixed.json
    spec-replay recover evals.jsonl -m target.gguf -o evals.fixed.jsonl --report report.json
    spec-replay recover evals.jsonl -m target.gguf -o evals.fixed.jsonl --resume
    spec-replay recover response.json --request request.json -m target.gguf --in-place
    """
    from replay.transcripts.files import write_atomic
    flags = local_flags(flags)
    if bool(output) == bool(in_place):
        raise click.UsageError("give exactly one of -o/--output and --in-place")
    out = Path(transcript).resolve() if in_place else Path(output)
    outputs = Outputs(out, report_file, html_file, force, in_place, resume).check(transcript, request_file)
    started = dict(transcript=transcript, model=model, request_file=request_file, flags=flags,
                   renamed_model=renamed_model, tolerance=tolerance, no_prefix_reuse=no_prefix_reuse, build=build,
                   source=source, server_backend=server_backend, shared_batches=shared_batches, libllama=libllama,
                   server_cpu=server_cpu, as_json=as_json, verbose=verbose)
    # one record runs in this process, and may try the best kernels on itself; a JSONL goes through the journal
    inputs, engine, task = _start(**started, guess_up_to=1)
    if len(inputs.records) > 1:
        _journaled(inputs, engine, task, outputs, as_json, workers=workers, ray_address=ray_address)
        return
    if workers > 1 or ray_address:
        click.echo("note: one record: --workers/--ray do not apply", err=True)
    if resume:
        raise click.UsageError("--resume is for multi-record (JSONL) runs; this file has one record")
    res = _in_process(inputs, engine, task, started)
    # files first, then the report on stdout (a reader that stops early, `| head`, loses nothing)
    _write(res, outputs, force)
    reason = res.failure()
    if not reason:  # a replay that disagrees with the server's real values is suspect everywhere: write nothing
        write_atomic(out, res.repaired, force=force or in_place)
    _show(res, as_json)
    if reason:
        check_failed(f"{reason}; nothing written" + ("" if in_place else f" to {out}"), res.failure_detail(),
                     res.failure_code())
    _wrote(out, res, len(inputs.records))


def _journaled(inputs: Inputs, engine, task, outputs: Outputs, as_json: bool, *, workers: int,
               ray_address: str | None) -> None:
    """A JSONL's records through the journal (scale/journaled.py), then the report and its verdict."""
    from replay.cli.render import progress_bar
    from replay.scale.journaled import recover_journaled
    with progress_bar(len(inputs.records), "recovering records") as advance:
        run = recover_journaled(inputs, engine, task, outputs, workers=workers, ray_address=ray_address,
                                say=lambda line: click.echo(line, err=True), progress=advance)
    _show(run.result, as_json)
    if run.failure is not None:
        check_failed(*run.failure)
    _wrote(outputs.out, run.result, len(inputs.records), f" ({run.earlier} finished earlier)" if run.earlier else "")


@main.command()
@every_server_flag("recover")
@_recover_options
def diff(transcript, model, renamed_model, request_file, report_file, tolerance, no_prefix_reuse, build, source,
         server_backend, shared_batches, as_json, html_file, force,
         verbose, libllama, server_cpu, **flags) -> None:
    """Compare the server's values with the true ones; write nothing.

    \b
    spec-replay diff run.json -m SmolLM2-135M-Instruct.Q4_1.gguf
    spec-replay diff evals.jsonl -m target.gguf --json | jq .summary
    """
    flags = local_flags(flags)
    outputs = Outputs(None, report_file, html_file, force).check(transcript, request_file)
    started = dict(transcript=transcript, model=model, request_file=request_file, flags=flags,
                   renamed_model=renamed_model, tolerance=tolerance, no_prefix_reuse=no_prefix_reuse, build=build,
                   source=source, server_backend=server_backend, shared_batches=shared_batches, libllama=libllama,
                   server_cpu=server_cpu, as_json=as_json, verbose=verbose)
    # diff runs every record in this process and writes nothing until the end
    inputs, engine, task = _start(**started, guess_up_to=EVERY)
    res = _in_process(inputs, engine, task, started)
    res.repaired = ""  # diff writes nothing
    _write(res, outputs, force)
    _show(res, as_json)
    reason = res.failure()
    if reason:
        check_failed(reason, res.failure_detail(), res.failure_code())
