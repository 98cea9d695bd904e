"""Which CPU variant replays a transcript, from the probes of its first real entry (pure).

The rule: a variant whose evaluation of the first entry equals the server's to within EXACT (the
float32 rounding of the values the server printed) computed it; the replay then runs on it and its
values are exact wherever the schedule is the server's. Several variants may be equal on that entry
(a class of kernels); the most capable of them is used and the others are named. When none is equal,
the transcript came from kernels this host cannot run (a GPU, another CPU architecture, a native
build with other flags, a variant beyond this CPU): that is refused in one line unless the user said
so (`--server-backend`) or the transcript shows batches shared with other requests, which change the
first entry themselves; then the nearest variant is used and the report names it and its distance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import SpecReplayError
from .probe import Probe
from .variants import VARIANTS

EXACT = 1e-6  # nats: a float32 logprob printed by the server and recomputed by the same kernels agree to this


class KernelsError(SpecReplayError):
    """No CPU variant here reproduces the server's first entry, and nothing said why."""


@dataclass(frozen=True)
class KernelChoice:
    """The variant to replay on and how it was chosen: "matched" (exactly), "given" (--server-cpu),
    "nearest" (none matched; allowed by `why`), "default" (nothing to probe: the host's best)."""

    variant: str | None
    how: str
    diff: float | None = None
    record: int | None = None  # the probed record (0-based)
    equal: tuple[str, ...] = ()  # other variants that matched as exactly
    why: str | None = None
    diffs: tuple[tuple[str, float | None], ...] = ()

    def describe(self) -> str:
        """The report's line.

        >>> KernelChoice("haswell", "matched", 0.0, 0, ("piledriver",)).describe()
        'haswell (AVX2), matched on the first entry of record 1 (as exactly: piledriver)'
        >>> KernelChoice("haswell", "nearest", 0.0193, 2, why="--server-backend").describe()
        'haswell (AVX2), the nearest: 0.0193 nats off the first entry of record 3 (no variant here matches; --server-backend)'
        """
        name = VARIANTS[self.variant].label if self.variant in VARIANTS else str(self.variant)
        where = f"the first entry of record {self.record + 1}" if self.record is not None else "the first entry"
        if self.how == "matched":
            return f"{name}, matched on {where}" + (f" (as exactly: {', '.join(self.equal)})" if self.equal else "")
        if self.how == "given":
            off = f"; {self.diff:.3g} nats off {where}" if self.diff is not None else ""
            return f"{name}, given (--server-cpu){off}"
        if self.how == "nearest":
            return f"{name}, the nearest: {self.diff:.3g} nats off {where} (no variant here matches; {self.why})"
        return f"{name}, this host's best ({self.why})"

    def to_json(self) -> dict:
        return {"variant": self.variant, "how": self.how, "diff": self.diff, "record": self.record,
                "equal": list(self.equal), "why": self.why, "probes": {v: d for v, d in self.diffs},
                "description": self.describe()}


def choose_variant(probes: Sequence[Probe], *, record: int, allow_nearest: str | None = None,
                   not_runnable: Sequence[str] = ()) -> KernelChoice:
    """The variant whose probe is exact (`probes` best-first: the first exact one, the other exact ones
    named), else the nearest when `allow_nearest` says why that is allowed, else KernelsError naming the
    nearest, its distance, the likely causes and `not_runnable` (variants the library has but this CPU
    cannot run).

    >>> ps = [Probe("haswell", 0.0193), Probe("sse42", 0.0), Probe("x64", 0.0)]
    >>> choose_variant(ps, record=0).variant, choose_variant(ps, record=0).equal
    ('sse42', ('x64',))
    >>> choose_variant([Probe("haswell", 0.02)], record=0, allow_nearest="--server-backend").how
    'nearest'
    """
    diffs = tuple((p.variant, p.diff) for p in probes)
    exact = [p.variant for p in probes if p.diff is not None and p.diff <= EXACT]
    if exact:
        d = next(p.diff for p in probes if p.variant == exact[0])
        return KernelChoice(exact[0], "matched", d, record, tuple(exact[1:]), diffs=diffs)
    measured = sorted((p for p in probes if p.diff is not None), key=lambda p: p.diff)
    if not measured:
        errors = "; ".join(f"{p.variant}: {p.error}" for p in probes) or "no CPU variant to evaluate"
        raise KernelsError(f"record {record + 1}'s first entry could not be evaluated under any CPU variant ({errors})")
    near = measured[0]
    if allow_nearest:
        return KernelChoice(near.variant, "nearest", near.diff, record, why=allow_nearest, diffs=diffs)
    others = ", ".join(f"{p.variant} {p.diff:.3g}" for p in measured[1:4])
    beyond = f" ({', '.join(not_runnable)} are built but this CPU cannot run them)" if not_runnable else ""
    raise KernelsError(
        f"record {record + 1}'s first entry matches none of this host's CPU kernels (nearest "
        f"{VARIANTS[near.variant].label if near.variant in VARIANTS else near.variant} {near.diff:.3g} nats off"
        f"{'; ' + others if others else ''}): the server computed on a GPU, another CPU architecture, a native "
        f"build with other flags, or a CPU variant this host cannot run{beyond}; give --server-backend NAME to "
        "recover at stated precision on the nearest")
