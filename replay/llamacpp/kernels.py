"""The CPU kernels a llama.cpp program the project starts computes with: the best that runs here.

A release-style build (every CPU variant beside the program) lets the program pick the variant of
highest score for the CPU's flags (ggml-backend-reg.cpp:480-572), and a host can advertise a variant's
features and still crash in its kernels (runtime/health.py: the AMX kernels of sapphirerapids on a
Sapphire Rapids class VM). So every llama-server the project starts (the test suite's, `demo`,
`patch --verify`, the benchmarks) runs from a directory holding only the best variant whose probe
ran here (Binaries.with_cpu), and says which; a build with its CPU backend linked in runs only when
its own probe did.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from replay.errors import ServerError
from replay.runtime import health
from replay.runtime.variants import VARIANTS, host_cpu_flags, library_of, runnable, variants_in


@dataclass(frozen=True)
class Kernels:
    """The program to start and the kernels it computes with: `variant` (None: linked in), and the
    variants passed over because they crash here (health lines)."""

    program: Path
    variant: str | None
    passed_over: tuple[str, ...] = ()

    def describe(self) -> str:
        """What a run says of its server.

        >>> Kernels(Path("llama-server"), "zen4", ("sapphirerapids: crashes on this host (SIGILL)",)).describe()
        'zen4 (AVX-512 VBMI VNNI BF16) kernels; sapphirerapids: crashes on this host (SIGILL)'
        """
        what = f"{VARIANTS[self.variant].label if self.variant in VARIANTS else self.variant} kernels" if self.variant \
            else "its linked-in CPU kernels"
        return "; ".join([what, *self.passed_over])


def _binaries_at(bin_dir: Path):
    """The Binaries whose bin/ is `bin_dir` (its manifest lies beside it), or None."""
    from replay.llamacpp.build import Binaries
    manifest = bin_dir.parent / "spec-replay-build.json"
    try:
        m = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    return Binaries(key=m.get("key", bin_dir.parent.name), bin_dir=bin_dir, manifest=m)


def variants_that_run(bin_dir: Path, *, repack: bool = True) -> list[str]:
    """The CPU variants of the release-style build in `bin_dir` that this CPU runs by its flags and that
    ran the health probe here (with extra buffer types, unless not `repack`), best first."""
    can = runnable(variants_in(bin_dir), host_cpu_flags())
    verdicts = health.verdicts(bin_dir, can)
    return [v for v in can if verdicts[v].runs(repack)]


def runnable_program(program: Path, *, repack: bool = True) -> Kernels:
    """`program` (llama-server, llama-speculative) as this host runs it: from a release-style build,
    the same program beside only the best variant that runs here with (`repack`) or without extra
    buffer types; a ServerError when nothing of its build runs here."""
    program = Path(program)
    bin_dir = program.parent
    present = variants_in(bin_dir)
    if not present:
        h = health.health(bin_dir, health.NATIVE)
        assert h is not None
        if not h.runs(repack):
            raise ServerError(h.describe(f"{program.name} of {bin_dir}") + ": rebuild it without those kernels, or "
                              "start it with --no-repack if the extra buffer types are what crash")
        return Kernels(program, None)
    can = runnable(present, host_cpu_flags())
    if not can:
        raise ServerError(f"this CPU runs none of {program.name}'s CPU variants ({', '.join(present)})")
    lib_dir = library_of(bin_dir, present[0]).resolve().parent
    best, failed = health.first_that_runs(lib_dir, can, repack=repack)
    if best is None:
        raise ServerError(f"none of {program.name}'s CPU variants runs on this host: "
                          + "; ".join(h.describe() for h in failed))
    passed = tuple(h.describe() for h in failed)
    if len(present) == 1:
        return Kernels(program, best, passed)
    bins = _binaries_at(bin_dir)
    if bins is None:
        raise ServerError(f"{bin_dir} has several CPU variants but no build manifest beside it: start {program.name} "
                          "from a spec-replay build (spec-replay build)")
    return Kernels(bins.with_cpu(best).bin_dir / program.name, best, passed)
