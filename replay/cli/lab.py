"""`spec-replay dist`: which speculative loops sample the target's own distribution."""
from __future__ import annotations

import json
import sys

import click

from replay.cli import main
from replay.cli.options import BUILD, json_option, verbose_option
from replay.report import schema as report_json

PATHS = ("a", "b-greedy", "b-probabilistic", "c-greedy", "c-probabilistic", "d", "e", "f", "d-patched")


def progress_printer():
    """A progress callback (label, done, total) for the lab's long paths: a live line on a terminal,
    one line per finished path otherwise."""
    def show(label: str, done: int, total: int) -> None:
        if sys.stderr.isatty():
            click.echo(f"\r{label}: {done}/{total}", err=True, nl=done == total)
        elif done == total:
            click.echo(f"{label}: {done}/{total}", err=True)
    return show


@main.command()
@click.option("--seeds", "n_seeds", type=click.IntRange(min=1), default=1000, show_default=True,
              help="seeds per path")
@click.option("--build", "profile", default="b11434", show_default=True, type=BUILD,
              help="the llama.cpp build whose llama-server and llama-speculative run (built once, cached)")
@click.option("--paths", help=f"only these paths (comma list of {', '.join(PATHS)})")
@click.option("--patched-example", is_flag=True, help="also build and run llama-speculative with the --example patch")
@json_option("the lab's counts and verdicts")
@verbose_option
def dist(n_seeds: int, profile: str, paths: str | None, patched_example: bool, as_json: bool,
         verbose: bool) -> None:
    """Which speculative loops keep the target's distribution?

    On the tiny fixture (prompt "gfbdc", prefix "e", --temp 1 --top-k 3), every
    path generates with N seeds; the token after the prefix is tallied and tested
    against the target's post-sampling probabilities (chi-square): the real server
    with and without speculation, spec-replay's trace loop, the real
    llama-speculative, our reimplementation of it, and that algorithm with its two
    defects fixed.

    \b
    spec-replay dist
    spec-replay dist --seeds 300 --paths a,d,e,f
    spec-replay dist --patched-example --json > dist.json
    """
    from replay.llamacpp.build import BuildSpec, ensure_built
    from replay.llamacpp.models import tiny_draft, tiny_target
    from replay.proof.distribution import Lab, example_binaries, render, run_lab
    keys = tuple(k.strip() for k in paths.split(",")) if paths else None
    if keys and not set(keys) <= set(PATHS):
        raise click.UsageError(f"unknown path(s): {', '.join(sorted(set(keys) - set(PATHS)))}")
    if profile == "0c1e570" and keys is None:
        keys = tuple(k for k in sorted(PATHS) if "probabilistic" not in k)  # no probabilistic drafting there
    bins = ensure_built(BuildSpec(profile), log=(lambda line: click.echo(line, err=True)) if verbose else None)
    patched = None
    if patched_example or (keys and "d-patched" in keys):
        _, patched = example_binaries(None, profile)
    lab = Lab(tiny_target(), tiny_draft(), seeds=range(1, n_seeds + 1))
    res = run_lab(lab, bins.server, bins.speculative, patched_speculative=patched, progress=progress_printer(),
                  paths=keys)
    click.echo(report_json.dumps(res.to_json(), indent=2) if as_json else render(res))
