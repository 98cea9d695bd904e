"""`spec-replay recover` and `diff`: the real logprobs of recorded transcripts."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import click

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
from replay.commands.recover import RecoverOptions
from replay.comparison.values import DEFAULT_TOLERANCE
from replay.errors import Exit, SpecReplayError
from replay.report import schema as report_json
from replay.report.recovery import RecoverResult


def _recover_options(fn):
    opts = [
        click.argument("transcript", type=click.Path()),
        click.option("-m", "--model", required=True, type=click.Path(),
                     help="the target GGUF the server ran (-m)"),
        click.option("--renamed-model", is_flag=True,
                     help="-m is the file the server loaded under another name: its name is not compared with "
                          "the transcript's (its file type and size still are)"),
        click.option("--request", "request_file", type=click.Path(),
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
        server_flags("context", "sampling"),
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


def _load(transcript: str, request_file: str | None, model: str, *, renamed: bool = False):
    """(records, the file's text, the --request body), after checking the files (a wrong model is
    reported first, by name where the transcript names its model: reading/identity.py)."""
    from replay.reading.identity import file_name, model_names
    from replay.errors import ModelError, TranscriptError
    from replay.runtime.gguf import check_gguf
    from replay.transcripts.files import read_request
    from replay.transcripts.readers import read_source, read_text
    input_file(transcript, "a transcript file", TranscriptError)
    input_file(model, "a model file", ModelError)
    check_gguf(model)
    request = read_request(request_file) if request_file else None
    original = read_source(transcript)
    records = read_text(original, str(transcript), request)
    for rec in records if not renamed else ():
        for where, name in model_names(rec):
            if file_name(name) not in (None, Path(model).name):
                raise ModelError(f"{rec.where}: the server loaded {file_name(name)} ({where}), -m is "
                                 f"{Path(model).name}: give the file the server loaded (--renamed-model if it is "
                                 "that file renamed)")
    return records, original, request


def _not_an_input(out: Path, transcript: str, request_file: str | None, what: str) -> None:
    """The output must never be an input: -o equal to the transcript would overwrite it (--in-place says
    that on purpose)."""
    for src in filter(None, (transcript, request_file)):
        s = Path(src)
        if out.resolve() == s.resolve() or (out.exists() and s.exists() and out.samefile(s)):
            raise click.UsageError(f"{what} {out} is the input {src}: write elsewhere, or give --in-place to "
                                   "replace the transcript on purpose")


def _run(records, model: str, flags: dict, options: RecoverOptions, verbose: bool, *, skip: int = 0,
         on_record=None):
    from replay.cli.progress import progress_bar
    from replay.commands.recover import recover_records
    from replay.runtime.llama import set_verbose
    set_verbose(verbose)
    with progress_bar(len(records), "recovering records", done=skip) as advance:
        return recover_records(records, model, flags=flags, options=options,
                               progress=lambda done, total: advance(done), skip=skip, on_record=on_record)


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
            click.echo(f"note: {r.source}, record {r.record}: {note}")


def _write_report(report_file: str | None, res: RecoverResult, force: bool) -> None:
    from replay.transcripts.files import write_atomic
    if report_file:
        write_atomic(report_file, report_json.dumps(res.to_json(), indent=2) + "\n", force=force)


def _write_page(html_file: str | None, res: RecoverResult, force: bool) -> None:
    """--html: the report as one self-contained page (report/pages.py)."""
    from replay.report.pages import recover_page
    from replay.transcripts.files import write_atomic
    if html_file:
        write_atomic(html_file, recover_page(res), force=force)
        click.echo(f"wrote {html_file}", err=True)


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
    from replay.commands.recover import result_of
    from replay.transcripts.files import refuse_existing, write_atomic
    flags = given_flags(flags)
    if bool(output) == bool(in_place):
        raise click.UsageError("give exactly one of -o/--output and --in-place")
    out = Path(transcript).resolve() if in_place else Path(output)
    if not in_place:
        _not_an_input(out, transcript, request_file, "-o")
    if not in_place and not resume:
        refuse_existing(out, force)
    for name, extra in (("--report", report_file), ("--html", html_file)):
        if extra:
            _not_an_input(Path(extra), transcript, request_file, name)
            if Path(extra).resolve() == out.resolve():
                raise click.UsageError(f"{name} must not be the output file")
            refuse_existing(extra, force)
    if report_file and html_file and Path(report_file).resolve() == Path(html_file).resolve():
        raise click.UsageError("--report and --html must be different files")
    build = build_number(build)
    records, original, request = _load(transcript, request_file, model, renamed=renamed_model)
    choose_libllama(libllama, source, build, records, quiet=as_json)
    options = RecoverOptions(tolerance=tolerance, reuse_prefix=not no_prefix_reuse, server_backend=server_backend,
                             build=build, source=source, shared_batches=shared_batches,
                             renamed_model=renamed_model)
    options = replace(options, cpu=choose_kernels(records, text=original, source=str(transcript), request=request,
                                                  model=str(Path(model).resolve()), flags=flags, options=options,
                                                  server_cpu=server_cpu, quiet=as_json))
    if len(records) > 1:
        _recover_journaled(Inputs(records, original, request, str(transcript), model, flags, options, verbose),
                           Outputs(out, force or in_place, resume, as_json, report_file, html_file),
                           workers=workers, ray_address=ray_address)
        return
    if workers > 1 or ray_address:
        click.echo("note: one record: --workers/--ray do not apply", err=True)
    if resume:
        raise click.UsageError("--resume is for multi-record (JSONL) runs; this file has one record")
    res = result_of(records, _run(records, model, flags, options, verbose), original)
    # files first, then the report on stdout (a reader that stops early, `| head`, loses nothing)
    _write_report(report_file, res, force)
    _write_page(html_file, res, force)
    reason = res.failure()
    if not reason:  # a replay that disagrees with the server's real values is suspect everywhere: write nothing
        write_atomic(out, res.repaired, force=force or in_place)
    _show(res, as_json)
    if reason:
        check_failed(f"{reason}; nothing written" + ("" if in_place else f" to {out}"), res.failure_detail(),
                     res.failure_code())
    _wrote(out, res, len(records))


@dataclass(frozen=True)
class Inputs:
    """What a recover run reads: the transcript's records (and its text, for the journal's fingerprint and
    the workers), the model, the server flags given here (settings attrs) and the options."""

    records: list
    original: str
    request: dict | None
    transcript: str
    model: str
    flags: dict
    options: RecoverOptions
    verbose: bool


@dataclass(frozen=True)
class Outputs:
    """Where a recover run writes: the repaired file (through its journal), the report and the page."""

    out: Path
    force: bool
    resume: bool
    as_json: bool
    report_file: str | None
    html_file: str | None


def _recover_journaled(inp: Inputs, outs: Outputs, *, workers: int = 1, ray_address: str | None = None) -> None:
    """A JSONL's records through the journal (OUT.partial), on one process or many (scale/)."""
    from replay.cli.progress import progress_bar
    from replay.runtime.binding import loaded_path
    from replay.runtime.llama import set_verbose
    from replay.scale.ordered import InOrder, run_units
    from replay.scale.worker import Done, Job, default_threads
    from replay.transcripts.chains import plan_units
    from replay.transcripts.journal import Journal
    if outs.resume and outs.out.exists() and not outs.force and not Path(str(outs.out) + ".partial").exists():
        raise click.UsageError(f"{outs.out} exists and there is no interrupted run to resume")
    if ray_address is not None:
        from replay.scale.ray_pool import check_cluster
        check_cluster(ray_address)
    fingerprint = {"input": str(Path(inp.transcript).resolve()),
                   "input_sha256": hashlib.sha256(inp.original.encode("utf-8")).hexdigest(),
                   "model": str(Path(inp.model).resolve()), "tolerance": inp.options.tolerance,
                   "libllama": str(loaded_path() or "bundled"),
                   **({"cpu": inp.options.cpu.variant} if inp.options.cpu is not None else {}),
                   "flags": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(inp.flags.items())}}
    journal = Journal(outs.out, fingerprint)
    done = journal.open(resume=outs.resume, force=outs.force)
    if done > len(inp.records):
        raise click.UsageError(f"{journal.path} has {done} records but the input only {len(inp.records)}")
    set_verbose(inp.verbose)
    finished = set(range(done)) | set(journal.ahead)
    units = plan_units(inp.records, finished)
    parallel = workers > 1 or ray_address is not None
    threads = inp.flags.get("threads") or (default_threads(workers) if parallel and not ray_address else None)
    job = Job(inp.original, str(inp.transcript), inp.request, str(Path(inp.model).resolve()), inp.flags, inp.options,
              threads, None if loaded_path() is None else str(loaded_path()))
    writer = InOrder(journal, done)
    results: list[Done] = []
    failed: list[Done] = []
    if parallel and len(units) < workers:
        click.echo(f"note: {len(inp.records) - len(finished)} records form {len(units)} unit(s) of work (records the "
                   "server served from the previous one's cache stay together): fewer than --workers", err=True)
    try:
        with progress_bar(len(inp.records), "recovering records", done=len(finished)) as advance:
            def on_done(d: Done) -> bool:
                results.append(d)
                advance(len(finished) + len(results))
                if d.line is None or not d.report.recovered:
                    failed.append(d)
                    return False
                writer.add(d.index, d.line)
                return True
            run_units(job, units, workers=workers, ray_address=ray_address, on_done=on_done,
                      on_note=lambda text: click.echo(f"note: {text}", err=True))
    except SpecReplayError:
        if not outs.resume:
            journal.discard_if_empty()
        raise
    finally:
        journal.close()
    res = RecoverResult([d.report for d in sorted(results, key=lambda d: d.index)], "")
    _write_report(outs.report_file, res, outs.force)
    _write_page(outs.html_file, res, outs.force)
    wrong = None if failed else res.failure()  # the transcript judged as a whole (comparison/values.py)
    if not failed and not wrong:
        journal.finish(force=outs.force)
    _show(res, outs.as_json)
    if wrong:
        check_failed(f"{wrong}; {outs.out} not written (the records are kept in {journal.path})", res.failure_detail(),
                     res.failure_code())
    if failed:
        kept = f"the {writer.next} records before it are kept in {journal.path}"
        if journal.ahead_path.exists():
            kept += f" (and those finished after it in {journal.ahead_path.name})"
        check_failed(f"{res.failure() or failed[0].report.source + ': record could not be repaired'}; "
                     f"{outs.out} not written ({kept})", res.failure_detail(),
                     res.failure_code() if res.failure() else Exit.ERROR)
    earlier = len(finished)
    _wrote(outs.out, res, len(inp.records), f" ({earlier} finished earlier)" if earlier else "")


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
    from replay.transcripts.files import refuse_existing
    for name, extra in (("--report", report_file), ("--html", html_file)):
        if extra:
            _not_an_input(Path(extra), transcript, request_file, name)
            refuse_existing(extra, force)
    if report_file and html_file and Path(report_file).resolve() == Path(html_file).resolve():
        raise click.UsageError("--report and --html must be different files")
    build = build_number(build)
    records, original, request = _load(transcript, request_file, model, renamed=renamed_model)
    choose_libllama(libllama, source, build, records, quiet=as_json)
    options = RecoverOptions(tolerance=tolerance, reuse_prefix=not no_prefix_reuse, server_backend=server_backend,
                             build=build, source=source, shared_batches=shared_batches,
                             renamed_model=renamed_model)
    flags = given_flags(flags)
    options = replace(options, cpu=choose_kernels(records, text=original, source=str(transcript), request=request,
                                                  model=str(Path(model).resolve()), flags=flags, options=options,
                                                  server_cpu=server_cpu, quiet=as_json))
    done = _run(records, model, flags, options, verbose)
    res = RecoverResult([d.report for d in done], "")
    _write_report(report_file, res, force)
    _write_page(html_file, res, force)
    _show(res, as_json)
    reason = res.failure()
    if reason:
        check_failed(reason, res.failure_detail(), res.failure_code())
