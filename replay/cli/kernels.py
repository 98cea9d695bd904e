"""Choosing the CPU kernels a run replays on (`--server-cpu`, or probed from the transcript).

Thin I/O over kernels/: it runs after the libllama is chosen (cli/options.py: choose_libllama) and
before anything loads it, says on stderr which variant and why, and returns the choice for the
report. A libllama that links one ggml-cpu in (a native build, llama-cpp-python's own) has one set
of kernels: nothing is chosen, and the first entry's strict comparison stays the judge.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import click

from replay.commands.kernel_choice import EXACT, KernelChoice, choose_variant, records_named
from replay.commands.probe import Probe, default_cache, probe_variants, witnesses
from replay.errors import KernelsError
from replay.runtime import binding
from replay.runtime.variants import VARIANTS, host_cpu_flags, runnable, variants_in
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


def choose_kernels(records: list[Record], *, text: str, source: str, request: dict | None, model: str,
                   flags: dict, options, server_cpu: str | None, quiet: bool = False) -> KernelChoice | None:
    """The CPU variant to replay on, made the one the binding loads (here and in workers); None when
    the chosen libllama has no variants. Probing evaluates the first real entry under each variant
    this host runs, and keeps the exact one, told apart from others equal to it by their one-token
    decodes (commands/kernel_choice.py). A transcript that shows batches shared
    with other requests (several slots, --shared-batches) is probed on several records' first entries;
    with none exact its kernels are "unknown" and the host's best is used. Otherwise nothing exact is a
    KernelsError, unless --server-backend allows the nearest."""
    bin_dir = _library_dir()
    present = variants_in(bin_dir) if bin_dir else []
    if not present:
        if server_cpu:
            raise click.UsageError(f"--server-cpu {server_cpu}: the libllama in use ({bin_dir or 'llama-cpp-python own'}) "
                                   "links one CPU backend in; build a release-style one (spec-replay build) or give "
                                   "--libllama a build with libggml-cpu-<variant>.so beside it")
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
    if server_cpu:
        if server_cpu not in present:
            raise KernelsError(f"--server-cpu {server_cpu}: {bin_dir} has no libggml-cpu-{server_cpu}.so")
        if server_cpu not in can:
            raise KernelsError(f"--server-cpu {server_cpu}: this CPU cannot run it (it runs {', '.join(can) or 'none'}); "
                               "recover on a machine that can, or give --server-backend to recover at stated "
                               "precision")
        choice = KernelChoice(server_cpu, "given")
    elif not can:
        raise KernelsError(f"this CPU runs none of the CPU variants in {bin_dir}")
    else:
        shared = ("--shared-batches" if options.shared_batches else
                  next((s for s in (r.several_slots(flags.get("n_parallel")) for r in records) if s), None))
        ks = witnesses(records, shared=shared is not None)
        if not ks:
            choice = KernelChoice(can[0], "default", why="no record carries a real first entry to tell the kernels by")
        else:
            if not quiet:
                click.echo(f"kernels: evaluating the first entry of {records_named(ks)} under each CPU variant this "
                           f"host runs ({', '.join(can)})", err=True)

            def said(v: str, p: Probe) -> None:
                if not quiet:
                    click.echo(f"  {v:<14} " + (f"{p.diff:.3g} nats off (record {p.record + 1})" if p.diff is not None
                                                else f"error: {p.error}"), err=True)
            probes = probe_variants(can, text=text, source=source, request=request, indices=ks, model=model,
                                    flags=flags, options=options, libllama=bin_dir, progress=said,
                                    until_exact=EXACT, cache=default_cache())
            try:
                choice = choose_variant(probes, shared=shared, not_runnable=beyond, witnesses=ks,
                                        tolerance=options.tolerance,
                                        allow_nearest="--server-backend" if options.server_backend else None)
            except KernelsError:
                if not all(n_prompt_cached(records[k].final()) for k in ks):
                    raise
                # its prompt came partly from the server's cache (no record here evaluated its prompt in
                # full): a disagreement may be the cache, not the kernels; the record's own judgement says
                choice = KernelChoice(can[0], "default", record=ks[0], diffs=tuple((p.variant, p.diff) for p in probes),
                                      why=f"record {ks[0] + 1}'s prompt came partly from the server's cache, so its "
                                          "first entry cannot tell the kernels")
    binding.use_cpu_variant(choice.variant)
    if not quiet:
        click.echo(f"kernels: {choice.describe()}", err=True)
    return choice
