"""Choosing the CPU kernels a run replays on (`--server-cpu`, or probed from the transcript).

It runs after the libllama is chosen (cli/options.py: choose_libllama) and before anything loads it,
says on stderr which variant and why, and returns the choice for the report. A libllama that links
one ggml-cpu in (a native build, llama-cpp-python's own) has one set of kernels: nothing is chosen,
and the first entry's strict comparison stays the judge.

The candidates are the variants this CPU runs by its flags that also run on this host
(runtime/health.py: a variant whose kernels crash here is never one, and is named), each with extra
buffer types (llama.cpp's default) or without (`--no-repack`), as far as the command line and the
transcript's recorded server flags leave open.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

import click

from replay.commands.kernel_choice import EXACT, KernelChoice, choose_variant, records_named
from replay.commands.kernel_classes import SIGNATURE_CONTEXT, Candidate
from replay.commands.probe import Probe, default_cache, probe_variants, witnesses
from replay.errors import KernelsError, TranscriptError
from replay.runtime import binding, health
from replay.runtime.variants import VARIANTS, host_cpu_flags, runnable, variants_in
from replay.settings import resolve
from replay.transcripts.concurrency import shared_evidence
from replay.transcripts.entries import n_prompt_cached
from replay.transcripts.readers import Record


def server_cpu_option(fn: Callable) -> Callable:
    return click.option(
        "--server-cpu", "server_cpu", metavar="VARIANT",
        help="the CPU variant the server computed with (x64, sse42, sandybridge, ivybridge, piledriver, haswell, "
             "skylakex, icelake, zen4, ...: the libggml-cpu-<variant>.so a release build loaded), instead of "
             "finding it from the transcript's first real entry; needs a release-style libllama "
             "(spec-replay build, the default --cpu variants)")(fn)


def _library_dir() -> Path | None:
    want = os.environ.get(binding.ENV)
    if not want:
        return None
    lib = binding.library_file(Path(want))
    return lib.parent if lib else None


def recorded_repack(records: list[Record]) -> bool | None:
    """Whether the server loaded its model with extra buffer types, as the transcript's recorded server
    flags say (`record` writes --no-repack when it was given); None when no record says. Records that
    disagree cannot be one run's: a TranscriptError.

    >>> recorded_repack([]) is None
    True
    """
    said = {bool(r.flags.get("--no-repack")) for r in records if r.flags and "--no-repack" in r.flags}
    if len(said) > 1:
        raise TranscriptError("some records were recorded from a server started with --no-repack and some without: "
                              "recover them separately")
    return (not said.pop()) if said else None


def repack_modes(flags: dict, records: list[Record]) -> tuple[list[bool], str]:
    """The repack modes a transcript may have been computed with, and where that comes from: the command
    line (-nr), the recorded server flags, else both (probed)."""
    if flags.get("no_repack") is not None:
        return [not flags["no_repack"]], "command line"
    recorded = recorded_repack(records)
    if recorded is not None:
        return [recorded], "server.flags"
    return [True, False], "probed"


def _verdicts(bin_dir: Path, names: list[str], quiet: bool) -> dict[str, health.Health]:
    unknown = [n for n in names if health.health(bin_dir, n, probe=False) is None]
    if unknown and not quiet:
        click.echo(f"kernels: checking which CPU variants run on this host ({', '.join(unknown)}), once", err=True)
    return health.verdicts(bin_dir, names)


def choose_kernels(records: list[Record], *, text: str, source: str, request: dict | None, model: str,
                   flags: dict, options, server_cpu: str | None, quiet: bool = False) -> KernelChoice | None:
    """The CPU variant (and repack) to replay on, made the one the binding loads (here and in workers),
    with flags["no_repack"] set to the choice; None when the chosen libllama has no variants. Probing
    evaluates the first real entry under each candidate and keeps the exact one, told apart from
    others equal to it by their one-token decodes (commands/kernel_choice.py). A transcript that shows
    batches shared with other requests (several slots, --shared-batches) is probed on several records'
    first entries; with none exact its kernels are "unknown" and the best candidate is used. Otherwise
    nothing exact is a KernelsError, unless --server-backend allows the nearest."""
    bin_dir = _library_dir()
    present = variants_in(bin_dir) if bin_dir else []
    modes, modes_from = repack_modes(flags, records)
    if not present:
        if server_cpu:
            raise click.UsageError(f"--server-cpu {server_cpu}: the libllama in use ({bin_dir or 'llama-cpp-python own'}) "
                                   "links one CPU backend in; build a release-style one (spec-replay build) or give "
                                   "--libllama a build with libggml-cpu-<variant>.so beside it")
        if len(modes) == 1:
            flags["no_repack"] = not modes[0]
        return None
    if server_cpu is not None and server_cpu not in VARIANTS and server_cpu not in present:
        raise click.UsageError(f"--server-cpu {server_cpu}: not a CPU variant ({', '.join(VARIANTS)})")
    loaded, have = binding.variant_in_process()
    if loaded:  # in-process reuse (tests, notebooks): what is loaded stays
        if server_cpu and server_cpu != have:
            raise KernelsError(f"--server-cpu {server_cpu}: this process already computes with the {have} kernels")
        return KernelChoice(have, "default", why="already loaded in this process")
    can = runnable(present, host_cpu_flags())
    beyond = [n for n in present if n not in can]
    verdicts = _verdicts(bin_dir, can, quiet)
    crashes = tuple(verdicts[v].describe() for v in can if not all(verdicts[v].runs(m) for m in modes))
    # llama.cpp's default (extra buffer types) first, each mode's variants best first
    candidates = [Candidate(v, m) for m in modes for v in can if verdicts[v].runs(m)]
    if crashes and not quiet:
        for line in crashes:
            click.echo(f"kernels: {line}: not a candidate", err=True)
    if server_cpu:
        if server_cpu not in present:
            raise KernelsError(f"--server-cpu {server_cpu}: {bin_dir} has no libggml-cpu-{server_cpu}.so")
        if server_cpu not in can:
            raise KernelsError(f"--server-cpu {server_cpu}: this CPU cannot run it (it runs {', '.join(can) or 'none'}); "
                               "recover on a machine that can, or give --server-backend to recover at stated "
                               "precision")
        # the kernels are given: so is the repack, as llama.cpp's default (extra buffer types) unless the
        # command line or the transcript says --no-repack; the first entry's comparison judges it
        repack = modes[0]
        if not verdicts[server_cpu].runs(repack):
            raise KernelsError(f"--server-cpu {server_cpu}: {verdicts[server_cpu].describe()}; the transcript needs a "
                               "host that runs its kernels")
        choice = KernelChoice(server_cpu, "given", repack=repack, crashes=crashes)
        if modes_from == "probed":
            modes_from = "default"
    elif not candidates:
        raise KernelsError(f"none of the CPU variants in {bin_dir} runs on this host: " + "; ".join(crashes))
    else:
        choice = _probed(records, candidates, text=text, source=source, request=request, model=model, flags=flags,
                         options=options, bin_dir=bin_dir, beyond=beyond, crashes=crashes, quiet=quiet)
    binding.use_cpu_variant(choice.variant)
    flags["no_repack"] = not choice.repack
    if not quiet:
        click.echo(f"kernels: {choice.describe()}" + (f" (repack: {modes_from})" if modes_from != "probed" else ""),
                   err=True)
    return choice


def _probed(records: list[Record], candidates: list[Candidate], *, text: str, source: str, request: dict | None,
            model: str, flags: dict, options, bin_dir: Path, beyond: list[str], crashes: tuple[str, ...],
            quiet: bool) -> KernelChoice:
    """The candidate whose evaluation of the witnesses' first entries is the server's (kernel_choice)."""
    evidence = shared_evidence(records, flags.get("n_parallel"), options.shared_batches)
    shared = next(iter(evidence.values()), None)
    ks = witnesses(records, shared=shared is not None)
    best = candidates[0]
    if not ks:
        return KernelChoice(best.variant, "default", why="no record carries a real first entry to tell the kernels by",
                            repack=best.repack, crashes=crashes)
    if not quiet:
        click.echo(f"kernels: evaluating the first entry of {records_named(ks)} under each candidate this host runs "
                   f"({', '.join(c.label for c in candidates)})", err=True)

    def said(label: str, p: Probe) -> None:
        if not quiet:
            also = f"; stands for {', '.join(p.same)}" if p.same else ""
            click.echo(f"  {label:<24} " + (f"{p.diff:.3g} nats off (record {p.record + 1}){also}" if p.diff is not None
                                            else f"error: {p.error}"), err=True)
    rec = records[ks[0]]
    ctx = resolve("context", flags=flags, recorded=rec.flags, props=rec.props)
    probes = probe_variants(candidates, text=text, source=source, request=request, indices=ks, model=model,
                            flags=flags, options=options, libllama=bin_dir, progress=said, until_exact=EXACT,
                            cache=default_cache(), context={a: getattr(ctx, a) for a in SIGNATURE_CONTEXT})
    try:
        choice = choose_variant(probes, shared=shared, not_runnable=beyond, witnesses=ks, tolerance=options.tolerance,
                                allow_nearest="--server-backend" if options.server_backend else None,
                                crashes=crashes)
    except KernelsError:
        if not all(n_prompt_cached(records[k].final()) for k in ks):
            raise
        # its prompt came partly from the server's cache (no record here evaluated its prompt in
        # full): a disagreement may be the cache, not the kernels; the record's own judgement says
        choice = KernelChoice(best.variant, "default", record=ks[0], diffs=tuple((p.label, p.diff) for p in probes),
                              repack=best.repack,
                              why=f"record {ks[0] + 1}'s prompt came partly from the server's cache, so its "
                                  "first entry cannot tell the kernels")
    return replace(choice, crashes=crashes)
