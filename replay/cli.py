"""The `spec-replay` command line: a thin dispatcher over the library modules.

Known failures (SpecReplayError) print one `Error: ...` line and exit non-zero;
set SPEC_REPLAY_RAISE_ERRORS=1 to see the traceback instead.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click
from tabulate import tabulate

from . import __version__
from .errors import SpecReplayError


def handle_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecReplayError as e:
            if os.environ.get("SPEC_REPLAY_RAISE_ERRORS"):
                raise
            click.echo(f"Error: {e}", err=True)
            sys.exit(e.exit_code if e.exit_code else 1)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)
    return wrapper


def _version_text() -> str:
    """spec-replay's version, the libllama it evaluates with, and the servers built so far."""
    lines = [f"spec-replay {__version__}"]
    try:
        import llama_cpp
        lines.append(f"in-process libllama: llama-cpp-python {llama_cpp.__version__} "
                     "(vendored llama.cpp 0c1e570, CPU)")
    except Exception as e:  # pragma: no cover - a broken install still prints a version
        lines.append(f"in-process libllama: unavailable ({type(e).__name__})")
    from .build import BuildSpec, find_built
    for profile in ("b11434", "0c1e570"):
        bins = find_built(BuildSpec(profile))
        state = f"built, build_info {bins.build_info}, {bins.bin_dir}" if bins else "not built yet (spec-replay build)"
        lines.append(f"llama-server {profile}: {state}")
    return "\n".join(lines)


def _show_version(ctx, _param, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(_version_text())
    ctx.exit()


@click.group()
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="show the version, the llama.cpp builds in use, and exit")
def main() -> None:
    """Tell the truth about llama.cpp's speculative decoding.

    \b
    spec-replay check URL                  does the server send placeholder logprobs?
    spec-replay record URL -r req.json -o t.json     record a replayable transcript
    spec-replay recover t.json -m target.gguf -o fixed.json   recover the real logprobs
    spec-replay trace t.json -m target.gguf -md draft.gguf    replay the loop step by step
    spec-replay patch --source ~/llama.cpp -o fix.patch       a server that reports real probs
    spec-replay dist                       which loops keep the target distribution
    spec-replay build                      build the real llama-server (cached)
    """


@main.command()
@click.option("--profile", default="b11434", type=click.Choice(["b11434", "0c1e570"]), show_default=True,
              help="pinned llama.cpp source to build")
@click.option("--source", type=click.Path(file_okay=False, path_type=Path), envvar="LLAMA_CPP_SOURCE_DIR",
              help="build this llama.cpp tree instead (env LLAMA_CPP_SOURCE_DIR)")
@click.option("--patch", type=click.Path(dir_okay=False, path_type=Path), help="apply this -p1 patch to a copy first")
@click.option("-j", "--jobs", default=2, show_default=True)
@click.option("-q", "--quiet", is_flag=True)
@handle_errors
def build(profile: str, source: Path | None, patch: Path | None, jobs: int, quiet: bool) -> None:
    """Fetch and build llama-server, llama-speculative and llama-quantize.

    Binaries go to ~/.cache/spec-replay/trees/<key>/build/bin (printed at the end);
    a second run is a no-op.

    \b
    spec-replay build
    spec-replay build --profile 0c1e570
    spec-replay build --source ~/llama.cpp --patch fix.patch
    """
    from .build import BuildSpec, ensure_built
    bins = ensure_built(BuildSpec(profile=profile, source_dir=source, patch=patch), jobs=jobs,
                        log=None if quiet else (lambda line: click.echo(line, err=True)))
    click.echo(str(bins.bin_dir))


@main.command()
@click.argument("url")
@click.option("-r", "--request", "request_file", type=click.Path(dir_okay=False, allow_dash=True),
              help="JSON request body ('-' for stdin)")
@click.option("--requests", "requests_file", type=click.Path(dir_okay=False, exists=True),
              help="JSONL file, one request per line (a body, or {\"endpoint\":..., \"request\":...})")
@click.option("-e", "--endpoint", default="/v1/chat/completions", show_default=True,
              type=click.Choice(["/v1/chat/completions", "/v1/completions", "/completion"]))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="transcript file (.json for one request, .jsonl for --requests)")
@click.option("--force", is_flag=True, help="overwrite an existing output file")
@click.option("--spec-type", "spec_types", multiple=True, help="the server's --spec-type values (repeatable)")
@click.option("--draft-model", "-md", help="the server's draft model path (-md)")
@click.option("--spec-draft-sampling", type=click.Choice(["greedy", "probabilistic"]))
@click.option("--spec-draft-n-max", type=int)
@click.option("--spec-draft-n-min", type=int)
@click.option("--spec-draft-p-min", type=float)
@click.option("--spec-ngram", "ngram", multiple=True, metavar="NAME=VALUE",
              help="an n-gram option as the server got it, e.g. --spec-ngram mod-n-match=24")
@handle_errors
def record(url, request_file, requests_file, endpoint, output, force, spec_types, draft_model,
           spec_draft_sampling, spec_draft_n_max, spec_draft_n_min, spec_draft_p_min, ngram) -> None:
    """Send requests to a llama-server and write replayable transcripts.

    The server's speculative settings are not visible through its API: pass the
    ones it was started with (--spec-type, --draft-model, ...) so a replay can
    use them. Requests need a fixed "seed". Adds "cache_prompt": false (and
    "return_tokens": true on /completion) unless the request sets them.

    \b
    spec-replay record http://127.0.0.1:8080 -r req.json -o t.json \\
        --spec-type draft-simple --draft-model draft.gguf
    spec-replay record http://127.0.0.1:8080 --requests reqs.jsonl -e /completion -o runs.jsonl
    """
    from .errors import TranscriptError
    from .fileio import write_atomic
    from .record import default_speculative, make_item, parse_request_lines, record_one, server_snapshot
    from .transcript import dumps

    if bool(request_file) == bool(requests_file):
        raise click.UsageError("give exactly one of --request and --requests")
    from .fileio import refuse_existing
    out = Path(output)
    refuse_existing(out, force)
    ng = {}
    for kv in ngram:
        if "=" not in kv:
            raise click.UsageError(f"--spec-ngram takes NAME=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        ng[k] = v
    spec = default_speculative(types=spec_types, draft_model=draft_model, draft_sampling=spec_draft_sampling,
                               draft_n_max=spec_draft_n_max, draft_n_min=spec_draft_n_min,
                               draft_p_min=spec_draft_p_min, ngram=ng)
    snapshot = server_snapshot(url)
    if request_file:
        text = sys.stdin.read() if request_file == "-" else _read(request_file)
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise TranscriptError(f"invalid JSON ({e})", source=request_file) from None
        t = record_one(url, make_item(obj, endpoint, request_file), spec, snapshot=snapshot)
        write_atomic(out, dumps(t) + "\n", force=force)
        click.echo(f"recorded 1 request to {out}", err=True)
        return
    from .progress import progress_bar
    lines, failed = [], 0
    items = list(parse_request_lines(_read(requests_file), endpoint, requests_file))
    with progress_bar(len(items), "recording requests") as advance:
        for k, item in enumerate(items, 1):
            advance(k - 1)
            if isinstance(item, SpecReplayError):
                click.echo(f"Error: {item}", err=True)
                failed += 1
                continue
            try:
                lines.append(dumps(record_one(url, item, spec, snapshot=snapshot), indent=None))
            except TranscriptError as e:
                click.echo(f"Error: {e}", err=True)
                failed += 1
        advance(len(items))
    if lines:
        write_atomic(out, "\n".join(lines) + "\n", force=force)
    click.echo(f"recorded {len(lines)} request(s) to {out}" + (f"; {failed} failed" if failed else ""), err=True)
    if failed:
        sys.exit(1)


def _read(path: str) -> str:
    from .errors import TranscriptError
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TranscriptError(f"cannot read: {e}", source=path) from None


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--n-predict", default=48, show_default=True)
@click.option("--n-probs", default=3, show_default=True)
@click.option("--prompt", default=None, help="probe prompt (default: a repetitive sentence)")
@handle_errors
def check(url: str, as_json: bool, n_predict: int, n_probs: int, prompt: str | None) -> None:
    """Audit a running llama-server for placeholder probabilities.

    Exit 0: every token carries real probabilities; 1: placeholders found;
    2: cannot tell (unreachable, not llama.cpp, no probabilities, no drafting).

    \b
    spec-replay check http://127.0.0.1:8080
    spec-replay check http://127.0.0.1:8080 --json | jq .verdict
    """
    from .check import PROBE_PROMPT, check as run_check
    res = run_check(url, n_predict=n_predict, n_probs=n_probs, prompt=prompt or PROBE_PROMPT)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
    else:
        click.echo(f"server:      {res.url}  ({res.build_info or 'unknown build'})")
        if res.props_speculative is not None or res.slots_speculative is not None:
            click.echo(f"/props:      speculative.types = {res.props_speculative!r}")
            click.echo(f"/slots:      speculative = {res.slots_speculative}")
        if res.contradiction:
            click.echo("warning:     /props says speculation is off but /slots says it is on; "
                       "/props does not reflect --spec-type")
        if res.draft_n is not None:
            click.echo(f"probe:       drafted {res.draft_n}, accepted {res.draft_n_accepted}")
        if res.tokens:
            rows = [[r["index"], r["id"], repr(r["token"]), f"{r['logprob']:.4f}", r["n_top"],
                     "PLACEHOLDER" if r["placeholder"] else "real"] for r in res.tokens]
            click.echo(tabulate(rows, headers=["#", "id", "token", "logprob", "top", "status"]))
        click.echo(f"verdict:     {res.verdict}")
    sys.exit(res.exit_code)


def _recover_options(fn):
    opts = [
        click.argument("transcript", type=click.Path(dir_okay=False)),
        click.option("-m", "--model", required=True, type=click.Path(dir_okay=False),
                     help="the target GGUF the server ran (-m)"),
        click.option("--request", "request_file", type=click.Path(dir_okay=False),
                     help="the request body, for a transcript that is a bare response"),
        click.option("--report", "report_file", type=click.Path(dir_okay=False),
                     help="also write the per-token report as JSON"),
        click.option("--tolerance", default=5e-4, show_default=True,
                     help="max |server - true| logprob for a real value to count as ok"),
        click.option("-c", "--ctx-size", type=int, help="the server's -c (default: the transcript's /props, else 2048)"),
        click.option("-b", "--batch-size", default=2048, show_default=True, help="the server's -b"),
        click.option("-ub", "--ubatch-size", default=512, show_default=True, help="the server's -ub"),
        click.option("-fa", "--flash-attn", default="auto", show_default=True, type=click.Choice(["auto", "on", "off"])),
        click.option("-t", "--threads", default=2, show_default=True),
        click.option("--no-prefix-reuse", is_flag=True,
                     help="evaluate every record's prompt from scratch (by default KV cells of a prompt prefix "
                          "shared with the previous record are kept where that is bit-exact: whole -ub blocks)"),
        click.option("--json", "as_json", is_flag=True, help="print the report as JSON instead of tables"),
        click.option("--force", is_flag=True, help="overwrite existing output/report files"),
        click.option("-v", "--verbose", is_flag=True, help="show libllama's log"),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _load_records(transcript, request_file, model):
    from .errors import TranscriptError
    from .models import check_gguf
    from .readers import read_source, read_text
    if not Path(transcript).is_file():
        raise TranscriptError("file not found", source=transcript)
    check_gguf(model)  # a wrong model is reported before anything is parsed
    from .fileio import read_request
    request = read_request(request_file) if request_file else None
    original = read_source(transcript)
    return read_text(original, str(transcript), request), original


def _run_recover(records, original, model, tolerance, ctx_size, batch_size, ubatch_size, flash_attn, threads,
                 verbose, *, reuse_prefix=True, skip=0, on_record=None):
    from .llama import set_verbose
    from .models import check_gguf
    from .recovery import ContextOptions, recover_records
    set_verbose(verbose)
    check_gguf(model)
    opts = ContextOptions(n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, flash_attn=flash_attn,
                          threads=threads, reuse_prefix=reuse_prefix)
    from .progress import progress_bar
    with progress_bar(len(records), "recovering records", done=skip) as advance:
        return recover_records(records, original, model, tolerance=tolerance, context=opts,
                               progress=lambda done, total: advance(done), skip=skip, on_record=on_record)


def _show(res, as_json: bool, changed_only: bool) -> None:
    from .report import summary_table, token_table
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
        return
    if len(res.records) == 1:
        click.echo(token_table(res.records[0], only_changed=changed_only))
        click.echo()
    click.echo(summary_table(res))
    for r in res.records:
        for note in r.notes:
            click.echo(f"note: {r.source}, record {r.record}: {note}")


@main.command()
@_recover_options
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="where to write the repaired transcript")
@click.option("--in-place", is_flag=True, help="replace the input file (atomically) with the repaired one")
@click.option("--resume", is_flag=True, help="continue an interrupted multi-record run (OUT.partial)")
@handle_errors
def recover(transcript, model, request_file, report_file, tolerance, ctx_size, batch_size, ubatch_size,
            flash_attn, threads, no_prefix_reuse, as_json, force, verbose, output, in_place, resume) -> None:
    """Recover the real logprobs of a recorded transcript and write a repaired copy.

    Replays the target model in-process with the server's decode schedule and
    puts the true values (and top-N alternatives) where the server sent
    placeholders or nothing, in the same file shape: a stream stays a stream,
    JSONL stays JSONL, every other field is kept. Values the server really
    sent are left as they were and checked.

    A JSONL of many records is written record by record to OUT.partial and
    moved to OUT at the end: an interrupted run keeps its finished records,
    and --resume continues after them (the result is byte-identical).

    \b
    spec-replay recover run.json -m SmolLM2-135M-Instruct.Q4_1.gguf -o run.fixed.json
    spec-replay recover evals.jsonl -m target.gguf -o evals.fixed.jsonl --report report.json
    spec-replay recover evals.jsonl -m target.gguf -o evals.fixed.jsonl --resume
    spec-replay recover response.json --request request.json -m target.gguf --in-place
    """
    from .fileio import refuse_existing, write_atomic
    if bool(output) == bool(in_place):
        raise click.UsageError("give exactly one of -o/--output and --in-place")
    out = Path(transcript).resolve() if in_place else Path(output)
    if not in_place and not resume:
        refuse_existing(out, force)
    if report_file:
        if Path(report_file).resolve() in (out.resolve(), Path(transcript).resolve()):
            raise click.UsageError("--report must not be the transcript or the output file")
        refuse_existing(report_file, force)
    records, original = _load_records(transcript, request_file, model)
    args = (model, tolerance, ctx_size, batch_size, ubatch_size, flash_attn, threads, verbose)
    if len(records) > 1:
        _recover_journaled(records, original, args, out, transcript, force or in_place, resume, as_json,
                           report_file, reuse_prefix=not no_prefix_reuse)
        return
    if resume:
        raise click.UsageError("--resume is for multi-record (JSONL) runs; this file has one record")
    res = _run_recover(records, original, *args)
    _show(res, as_json, changed_only=False)
    reason = res.failure()
    if report_file:
        write_atomic(report_file, json.dumps(res.to_json(), indent=2, allow_nan=False) + "\n", force=force)
    if reason:
        # a replay that disagrees with the server's real values is suspect everywhere: write nothing
        click.echo(f"Error: {reason}; nothing written to {out}", err=True)
        sys.exit(1)
    write_atomic(out, res.repaired, force=force or in_place)
    s = res.summary()
    click.echo(f"wrote {out}: {s['counts']['placeholder']} placeholder and {s['counts']['missing']} missing "
               f"value(s) recovered in {s['records']} record(s)", err=True)


def _recover_journaled(records, original, args, out: Path, transcript, force: bool, resume: bool, as_json: bool,
                       report_file, *, reuse_prefix: bool) -> None:
    import hashlib
    from .fileio import write_atomic
    from .journal import Journal
    from .repair import jsonl_line
    model, tolerance, ctx_size, batch_size, ubatch_size, flash_attn, threads, _ = args
    if resume and out.exists() and not force and not Path(str(out) + ".partial").exists():
        raise click.UsageError(f"{out} exists and there is no interrupted run to resume")
    fingerprint = {"input": str(Path(transcript).resolve()),
                   "input_sha256": hashlib.sha256(original.encode("utf-8")).hexdigest(),
                   "model": str(Path(model).resolve()), "tolerance": tolerance, "ctx_size": ctx_size,
                   "batch_size": batch_size, "ubatch_size": ubatch_size, "flash_attn": flash_attn,
                   "threads": threads}
    journal = Journal(out, fingerprint)
    done = journal.open(resume=resume, force=force)
    if done > len(records):
        raise click.UsageError(f"{journal.path} has {done} records but the input only {len(records)}")
    failed = []

    def on_record(rec, rep) -> bool:
        if not rep.recovered:
            failed.append(rep)
            return False
        journal.append(jsonl_line(rec))
        return True

    try:
        res = _run_recover(records, original, *args, reuse_prefix=reuse_prefix, skip=done, on_record=on_record)
    finally:
        journal.close()
    _show(res, as_json, changed_only=False)
    if report_file:
        write_atomic(report_file, json.dumps(res.to_json(), indent=2, allow_nan=False) + "\n", force=force)
    if failed:
        click.echo(f"Error: {res.failure()}; {out} not written (records before it are kept in {journal.path})",
                   err=True)
        sys.exit(1)
    journal.finish(force=force)
    s = res.summary()
    resumed = f" ({done} finished earlier)" if done else ""
    click.echo(f"wrote {out}: {s['counts']['placeholder']} placeholder and {s['counts']['missing']} missing "
               f"value(s) recovered in {len(records)} record(s){resumed}", err=True)


@main.command()
@_recover_options
@handle_errors
def diff(transcript, model, request_file, report_file, tolerance, ctx_size, batch_size, ubatch_size,
         flash_attn, threads, no_prefix_reuse, as_json, force, verbose) -> None:
    """Compare what the server sent with the true probabilities; write nothing.

    \b
    spec-replay diff run.json -m SmolLM2-135M-Instruct.Q4_1.gguf
    spec-replay diff evals.jsonl -m target.gguf --json | jq .summary
    """
    from .fileio import refuse_existing, write_atomic
    if report_file:
        refuse_existing(report_file, force)
    records, original = _load_records(transcript, request_file, model)
    res = _run_recover(records, original, model, tolerance, ctx_size, batch_size, ubatch_size, flash_attn, threads,
                       verbose, reuse_prefix=not no_prefix_reuse)
    if report_file:
        write_atomic(report_file, json.dumps(res.to_json(), indent=2, allow_nan=False) + "\n", force=force)
    _show(res, as_json, changed_only=False)
    reason = res.failure()
    if reason:
        click.echo(f"Error: {reason}", err=True)
        sys.exit(1)


@main.command()
@click.argument("transcript", required=False, type=click.Path(dir_okay=False))
@click.option("-m", "--model", required=True, type=click.Path(dir_okay=False), help="the target GGUF (-m)")
@click.option("-md", "--draft", "draft_path", type=click.Path(dir_okay=False), help="the draft GGUF (-md)")
@click.option("--request", "request_file", type=click.Path(dir_okay=False), help="request body for a bare response")
@click.option("--spec-type", "spec_types", multiple=True, help="the server's --spec-type (repeatable)")
@click.option("--spec-draft-n-max", type=int)
@click.option("--spec-draft-n-min", type=int)
@click.option("--spec-draft-p-min", type=float)
@click.option("--spec-draft-sampling", type=click.Choice(["greedy", "probabilistic"]))
@click.option("--spec-ngram-simple-size-n", type=int)
@click.option("--spec-ngram-simple-size-m", type=int)
@click.option("--spec-ngram-map-k-size-n", type=int)
@click.option("--spec-ngram-map-k-size-m", type=int)
@click.option("--spec-ngram-map-k-min-hits", type=int)
@click.option("--spec-ngram-map-k4v-size-n", type=int)
@click.option("--spec-ngram-map-k4v-size-m", type=int)
@click.option("--spec-ngram-map-k4v-min-hits", type=int)
@click.option("--spec-ngram-mod-n-match", type=int)
@click.option("--spec-ngram-mod-n-max", type=int)
@click.option("--spec-ngram-mod-n-min", type=int)
@click.option("--profile", type=click.Choice(["b11434", "0c1e570"]),
              help="server loop to replay (default: from the transcript's build_info)")
@click.option("--prompt", help="without a transcript: run the loop from scratch on this prompt")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--temp", type=float, default=0.8, show_default=True)
@click.option("-n", "--n-predict", type=int, default=32, show_default=True)
@click.option("-c", "--ctx-size", type=int, help="the server's -c (default: the transcript's /props, else 2048)")
@click.option("-t", "--threads", default=2, show_default=True)
@click.option("--steps", "steps_range", help="only show steps a:b")
@click.option("--json", "as_json", is_flag=True, help="the full trace as JSON")
@click.option("-v", "--verbose", is_flag=True, help="show libllama's log")
@handle_errors
def trace(transcript, model, draft_path, request_file, spec_types, spec_draft_n_max, spec_draft_n_min,
          spec_draft_p_min, spec_draft_sampling, spec_ngram_simple_size_n, spec_ngram_simple_size_m,
          spec_ngram_map_k_size_n, spec_ngram_map_k_size_m, spec_ngram_map_k_min_hits, spec_ngram_map_k4v_size_n,
          spec_ngram_map_k4v_size_m, spec_ngram_map_k4v_min_hits, spec_ngram_mod_n_match, spec_ngram_mod_n_max, spec_ngram_mod_n_min, profile, prompt, seed, temp,
          n_predict, ctx_size, threads, steps_range, as_json, verbose) -> None:
    """Replay llama-server's speculative loop step by step and check it against a transcript.

    Shows what was drafted (with the draft's q), what the target thought (p), which
    draft tokens were accepted or rejected (with the uniform draw), the resampled
    and bonus tokens, and the logprob a fixed server would report for every
    emitted token. With a transcript it must reproduce every token and the
    draft_n/draft_n_accepted totals; the first divergence is flagged.

    \b
    spec-replay trace run.json -m target.gguf -md draft.gguf
    spec-replay trace run.json -m target.gguf -md draft.gguf --json | jq .reproduced
    spec-replay trace -m target.gguf -md draft.gguf --spec-type draft-simple --prompt "Once upon a time" --seed 3
    """
    from .tracing import trace_command
    trace_command(**{k: v for k, v in locals().items()})


@main.command()
@click.option("--model", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="target GGUF (default: the committed tiny fixture)")
@click.option("--draft", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="draft GGUF (default: the committed tiny noisy draft)")
@click.option("--prompt", default="bcdbcbcdbcbcdbc", show_default=True)
@click.option("--n-predict", default=12, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="the audit as JSON (the shape of `check --json`)")
@handle_errors
def demo(model: Path | None, draft: Path | None, prompt: str, n_predict: int, as_json: bool) -> None:
    """Start a real speculating llama-server (draft-simple) and audit it.

    Builds llama-server on first use (a few minutes, cached), serves the
    committed tiny fixtures, and runs `check` against it: the table shows the
    placeholder logprobs of every token from the speculative loop.

    \b
    spec-replay demo
    spec-replay demo --model target.gguf --draft draft.gguf --prompt "Once upon a time"
    spec-replay demo --json | jq .verdict
    """
    from .build import ensure_built
    from .check import check as run_check
    from .models import tiny_draft, tiny_target
    from .server import LlamaServer, ServerConfig
    bins = ensure_built(log=lambda line: click.echo(line, err=True))
    cfg = ServerConfig(model=model or tiny_target(), draft=draft or tiny_draft(), spec_types=("draft-simple",))
    with LlamaServer(cfg, binary=bins.server) as srv:
        click.echo(f"started {bins.build_info} llama-server at {srv.url}: -m {cfg.model.name} -md {cfg.draft.name} "
                   "--spec-type draft-simple", err=True)
        res = run_check(srv.url, n_predict=n_predict, prompt=prompt)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
        return
    rows = [[r["index"], r["id"], repr(r["token"]), f"{r['logprob']:.4f}", r["n_top"],
             "PLACEHOLDER" if r["placeholder"] else "real"] for r in res.tokens]
    click.echo(tabulate(rows, headers=["#", "id", "token", "logprob", "top", "status"]))
    click.echo(f"/props speculative.types = {res.props_speculative!r}, /slots speculative = {res.slots_speculative}")
    click.echo(f"verdict: {res.verdict}")


if __name__ == "__main__":
    main()


@main.command("patch")
@click.option("--source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="the llama.cpp checkout to patch")
@click.option("--profile", type=click.Choice(["b11434", "0c1e570"]),
              help="patch a pinned source instead of --source")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="write the patch here (default: stdout)")
@click.option("--force", is_flag=True, help="overwrite an existing --output")
@click.option("--example", is_flag=True, help="fix examples/speculative/speculative.cpp instead of the server")
@click.option("--verify", is_flag=True, help="build the patched server and prove it on SmolLM2 and the tiny fixture")
@click.option("--seeds", default=2, show_default=True, help="seeds per endpoint/stream/mode for --verify")
@click.option("--json", "as_json", is_flag=True, help="--verify's table as JSON")
@handle_errors
def patch_cmd(source: Path | None, profile: str | None, output: Path | None, force: bool, example: bool,
              verify: bool, seeds: int, as_json: bool) -> None:
    """Write a fix for llama.cpp that makes the server report real probabilities.

    The patch fills prob and the top-N list of every token llama-server's
    speculative loop emits (pre- and post-sampling, streamed or not), without
    changing what is sampled. It is generated for the tree you give (its code
    shape is recognised: b11434, 0c1e570) and applies with `git apply -p1`.
    --verify builds the patched and unpatched servers (cached) and checks the
    patched one against `trace` and the unspeculated server.

    \b
    spec-replay patch --source ~/llama.cpp -o spec-probs.patch
    cd ~/llama.cpp && git apply spec-probs.patch
    spec-replay patch --verify --source ~/llama.cpp
    spec-replay patch --example --source ~/llama.cpp -o speculative-example.patch
    """
    from .fileio import refuse_existing, write_atomic
    if (source is None) == (profile is None):
        raise click.UsageError("give --source DIR (your llama.cpp checkout) or --profile b11434|0c1e570")
    if output is not None:
        refuse_existing(output, force)
    if verify:
        _verify_patch(source, profile or "b11434", example, seeds, as_json)
        return
    from .patchcheck import pinned_tree
    tree = source if source is not None else pinned_tree(profile)
    if example:
        from .patches import example_patch
        made = example_patch(tree)
    else:
        from .patches import server_patch
        made = server_patch(tree)
    if output is None:
        click.echo(made.diff, nl=False)
    else:
        write_atomic(output, made.diff, force=force)
        click.echo(f"{output}: patch for {made.path} ({made.profile} code shape); apply with "
                   f"`git apply -p1 {output}` in the llama.cpp tree", err=True)


def _verify_patch(source: Path | None, profile: str, example: bool, seeds: int, as_json: bool) -> None:
    if example:
        _verify_example_patch(source, profile, as_json)
        return
    from .patchcheck import HEADERS, table, verify_server_patch
    say = lambda line: click.echo(line, err=True)
    shape, rows = verify_server_patch(source, profile, seeds=range(1, seeds + 1), log=None,
                                      progress=lambda what: say(f"checking {what}"))
    if as_json:
        click.echo(json.dumps({"code_shape": shape, "passed": all(r.passed for r in rows),
                               "rows": [r.to_json() for r in rows]}, indent=2))
    else:
        click.echo(tabulate(table(rows), headers=HEADERS))
        n_fail = sum(not r.passed for r in rows)
        click.echo(f"\n{len(rows) - n_fail}/{len(rows)} checks passed ({shape} code shape)")
    if not all(r.passed for r in rows):
        raise SystemExit(1)


def _progress_printer():
    state = {"label": None}

    def show(label: str, done: int, total: int) -> None:
        if sys.stderr.isatty():
            click.echo(f"\r{label}: {done}/{total}", err=True, nl=done == total)
        elif done == total:
            click.echo(f"{label}: {done}/{total}", err=True)
        state["label"] = label
    return show


def _verify_example_patch(source: Path | None, profile: str, as_json: bool) -> None:
    from .distlab import Lab, example_binaries, render, run_lab
    from .build import BuildSpec, ensure_built
    from .models import tiny_draft, tiny_target
    plain, patched = example_binaries(source, profile)
    server = ensure_built(BuildSpec(profile, source_dir=source)).server
    lab = Lab(tiny_target(), tiny_draft(), seeds=range(1, 1001))
    res = run_lab(lab, server, plain, patched_speculative=patched, progress=_progress_printer(),
                  paths=("d", "e", "f", "d-patched"))
    ok = res.path("d-patched").verdict == "preserves" and all(
        s == n for a, b, s, n in res.agreements() if a == "d-patched")
    if as_json:
        click.echo(json.dumps({**res.to_json(), "passed": ok}, indent=2))
    else:
        click.echo(render(res))
        click.echo("\npatched llama-speculative: " + ("PASS (preserves the target distribution)" if ok else "FAIL"))
    if not ok:
        raise SystemExit(1)


@main.command()
@click.option("-n", "--seeds", "n_seeds", default=1000, show_default=True, help="seeds per path")
@click.option("--profile", default="b11434", show_default=True, type=click.Choice(["b11434", "0c1e570"]),
              help="which pinned llama.cpp build provides llama-server and llama-speculative")
@click.option("--paths", help="only these paths (comma list of a, b-greedy, b-probabilistic, c-greedy, "
                              "c-probabilistic, d, e, f, d-patched)")
@click.option("--patched-example", is_flag=True, help="also build and run llama-speculative with the --example patch")
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def dist(n_seeds: int, profile: str, paths: str | None, patched_example: bool, as_json: bool) -> None:
    """Which speculative loops sample the target's own distribution? Count and test.

    On the tiny fixture (prompt "gfbdc", prefix "e", --temp 1 --top-k 3), every
    path generates with N seeds; the token after the prefix is tallied and tested
    against the target's post-sampling probabilities (chi-square): the real server
    with and without speculation, spec-replay's trace loop, the real
    llama-speculative, our reimplementation of it, and that algorithm with its two
    defects fixed.

    \b
    spec-replay dist
    spec-replay dist -n 300 --paths a,d,e,f
    spec-replay dist --patched-example --json > dist.json
    """
    from .build import BuildSpec, ensure_built
    from .distlab import Lab, example_binaries, render, run_lab
    from .models import tiny_draft, tiny_target
    if n_seeds < 1:
        raise click.UsageError("--seeds must be at least 1")
    keys = tuple(k.strip() for k in paths.split(",")) if paths else None
    known = {"a", "b-greedy", "b-probabilistic", "c-greedy", "c-probabilistic", "d", "e", "f", "d-patched"}
    if keys and not set(keys) <= known:
        raise click.UsageError(f"unknown path(s): {', '.join(sorted(set(keys) - known))}")
    if profile == "0c1e570" and keys is None:
        keys = tuple(k for k in sorted(known) if "probabilistic" not in k)  # no probabilistic drafting there
    bins = ensure_built(BuildSpec(profile))
    patched = None
    if patched_example or (keys and "d-patched" in keys):
        _, patched = example_binaries(None, profile)
    lab = Lab(tiny_target(), tiny_draft(), seeds=range(1, n_seeds + 1))
    res = run_lab(lab, bins.server, bins.speculative, patched_speculative=patched, progress=_progress_printer(),
                  paths=keys)
    click.echo(json.dumps(res.to_json(), indent=2) if as_json else render(res))
