"""What a run computes with, as one value: the libllama, its CPU kernels, the repack and the thread count.

    EngineChoice   chosen once per run (run/engine.py: from the transcript's build, the command line and
                   the kernel probes), applied once per process (`apply`: the driver, each worker, each
                   Ray actor), carried to child processes as a value (pickled with their job), never
                   through os.environ or a flags dict changed in place
    KernelChoice   its CPU part: the variant of a release-style libllama and how it was chosen

Everything that loads a model asks the engine for the flags to load and decode with (`flags`): the given
server flags with the chosen repack and thread count put over them, a new dict each time.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from replay.runtime import binding
from replay.runtime.binding import LibChoice
from replay.runtime.variants import VARIANTS


@dataclass(frozen=True)
class KernelChoice:
    """The variant to replay on and how it was chosen: "matched" (exactly), "loop" (no real entry: the only
    class whose loop replay emits the transcript's tokens and draft totals), "given" (--server-cpu),
    "nearest" (none matched; allowed by `why`), "unknown" (none matched, and shared batches say the
    first entries cannot tell: the host's best), "default" (nothing to probe: the host's best)."""

    variant: str | None
    how: str
    diff: float | None = None
    record: int | None = None  # the probed record (0-based)
    equal: tuple[str, ...] = ()  # other candidates that matched as exactly (or compute this model alike)
    why: str | None = None
    diffs: tuple[tuple[str, float | None], ...] = ()
    spread: float | None = None  # how far the equal variants' one-token decodes are apart, where not exact
    repack: bool | None = None  # the model is loaded with extra buffer types (None: not chosen here)
    crashes: tuple[str, ...] = ()  # the variants that crash on this host, as runtime/health.py says it
    unprobed: tuple[str, ...] = ()  # candidates not probed: the evidence made them needless (`why_unprobed`)
    why_unprobed: str | None = None
    # (record, bound): where nothing told the kernels ("default", "unknown"), the largest difference between
    # the values the remaining classes compute for each record (run/kernels/processes.py value_spread)
    bounds: tuple[tuple[int, float | None], ...] = ()

    def bound_of(self, record: int) -> float | None:
        """The bound on record `record`'s (0-based) values from the kernels left open, None where none was
        measured.

        >>> KernelChoice("zen4", "default", bounds=((0, 0.02), (1, None))).bound_of(0)
        0.02
        """
        return dict(self.bounds).get(record)

    def brief(self, width: int = 120) -> str:
        """The console's line: describe() with the variants computing alike counted, not named, those not
        probed left out, and cut to `width` characters where it is still longer (-v prints describe();
        the report has it whole).

        >>> KernelChoice("haswell", "matched", 0.0, 0, ("piledriver", "alderlake")).brief()
        'haswell (AVX2), matched on the first entry of record 1 (as exactly: 2 others)'
        """
        short = replace(self, equal=(f"{len(self.equal)} other{'s' if len(self.equal) > 1 else ''}",)
                        if len(self.equal) > 1 else self.equal,
                        unprobed=())
        line = short.describe()
        return line if len(line) <= width else line[:width - 10].rstrip(" ,;(") + " ... (-v)"

    def describe(self) -> str:
        """The report's line.

        >>> KernelChoice("haswell", "matched", 0.0, 0, ("piledriver",)).describe()
        'haswell (AVX2), matched on the first entry of record 1 (as exactly: piledriver)'
        >>> KernelChoice("haswell", "nearest", 0.0193, 2, why="--server-backend").describe()
        'haswell (AVX2), the nearest: 0.0193 nats off the first entry of record 3 (no variant here matches; --server-backend)'
        """
        name = VARIANTS[self.variant].label if self.variant in VARIANTS else str(self.variant)
        if self.repack is False:
            name += " --no-repack"
        where = f"the first entry of record {self.record + 1}" if self.record is not None else "the first entry"
        if self.how == "matched":
            spread = f"; one-token decodes within {self.spread:.2g}" if self.spread else ""
            return f"{name}, matched on {where}" + (f" (as exactly: {', '.join(self.equal)}{spread})" if self.equal
                                                     else "") + (
                f"; not probed: {', '.join(self.unprobed)} ({self.why_unprobed})" if self.unprobed else "") + (
                f"; {self.why}" if self.why else "")
        if self.how == "loop":
            also = f" (as exactly: {', '.join(self.equal)})" if self.equal else ""
            return (f"{name}, the one class whose replay of the server's loop emits the transcript's tokens and draft "
                    f"totals{also}; out: {self.why}")
        if self.how == "tried":
            return (f"{name}, tried first on {where}, which decides as it is recovered (not probed: "
                    f"{', '.join(self.unprobed)})")
        if self.how == "given":
            off = f"; {self.diff:.3g} nats off {where}" if self.diff is not None else ""
            return f"{name}, given (--server-cpu){off}"
        if self.how == "nearest":
            return f"{name}, the nearest: {self.diff:.3g} nats off {where} (no variant here matches; {self.why})"
        if self.how == "unknown":
            return f"{name}, this host's best; the server's kernels are unknown ({self.why})"
        return f"{name}, this host's best ({self.why})"

    @property
    def reproduces(self) -> bool:
        """Whether the server's kernels are known to be these: not when none matched (nearest, unknown).

        >>> KernelChoice("x64", "matched").reproduces, KernelChoice("x64", "nearest").reproduces
        (True, False)
        """
        return self.how not in ("nearest", "unknown")

    def to_json(self) -> dict:
        return {"variant": self.variant, "how": self.how, "diff": self.diff, "record": self.record,
                "equal": list(self.equal), "decode_spread": self.spread, "why": self.why,
                "probes": {v: d for v, d in self.diffs}, "repack": self.repack, "crashes": list(self.crashes),
                "unprobed": list(self.unprobed), "why_unprobed": self.why_unprobed,
                "bounds": {str(k + 1): b for k, b in self.bounds},
                "description": self.describe()}


@dataclass(frozen=True)
class Tried:
    """The best class tried on the run itself (run/kernels/policy.py): record `record`'s first entry, as
    it is recovered, confirms it (within run/kernels/choice.py EXACT) or the run starts again with the
    kernels probed; either outcome is kept as that probe's (`key` in the probe cache)."""

    key: str
    record: int
    variant: str
    repack: bool


@dataclass(frozen=True)
class EngineChoice:
    """The libllama (`libllama`; `kept`: another was already loaded in this process and stays), the CPU
    kernels (None: the library links one CPU backend in), the repack (None: not chosen: the flags'
    own, llama.cpp's default) and the threads of every context (None: each context's resolved -t), with
    the lines the choice said, in order."""

    libllama: LibChoice
    kernels: KernelChoice | None = None
    repack: bool | None = None
    threads: int | None = None
    kept: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)
    tried: Tried | None = None
    # the build chosen by evidence for a transcript that names none (run/build_choice.py): its number,
    # the report's words, and whether evidence decided it (False: the default, values approximate)
    build: int | None = None
    build_why: str | None = None
    build_decided: bool = True

    def options(self, given):
        """The recover options with the build chosen here (its loop shape) where none was given: `given`
        itself when nothing was chosen (a RecoverOptions, replaced as a new value)."""
        from dataclasses import replace
        if self.build is None or given.build is not None or given.source is not None:
            return given
        return replace(given, build=self.build, build_why=self.build_why, build_decided=self.build_decided)

    def flags(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The server flags to load and decode with: `given` (settings attrs) with the chosen repack and
        threads over them, as a new dict.

        >>> e = EngineChoice(LibChoice(None, "test"), repack=False, threads=3)
        >>> e.flags({"n_ctx": 256}), EngineChoice(LibChoice(None, "test")).flags({"no_repack": True})
        ({'n_ctx': 256, 'no_repack': True, 'threads': 3}, {'no_repack': True})
        """
        out = dict(given)
        if self.repack is not None:
            out["no_repack"] = not self.repack
        if self.threads:
            out["threads"] = self.threads
        return out

    @property
    def library(self) -> str:
        """The libllama file this engine loads, resolved ("bundled": llama-cpp-python's own), without
        loading it."""
        lib = binding.library_file(Path(self.libllama.path)) if self.libllama.path is not None else None
        return str(lib.resolve()) if lib is not None else "bundled"

    def apply(self) -> None:
        """Make this the libllama and CPU variant the binding loads in this process (before it loads: a
        process holds one ggml). A library already loaded here stays when the choice said it may (`kept`)."""
        if not self.kept:
            binding.use_libllama(self.libllama)
        loaded, _ = binding.variant_in_process()
        if self.kernels is not None and self.kernels.variant is not None and not loaded:
            binding.use_cpu_variant(self.kernels.variant)
