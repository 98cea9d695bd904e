"""Why a trace diverged from its transcript: numerics (a draw that fell within the numeric difference
of a boundary, a near tie) or the loop (anything else), with the figures.

A server with several slots decodes a request in batches shared with other requests, so its logits
differ slightly from a one-request evaluation (recovery/compare.py, BATCH_BOUND). At the first
token where the trace and the transcript differ, the trace knows how it chose its token:

    sampled    the chain's dist sampler drew u from its own stream, mt19937(seed), one
               generate_canonical<double> per chain pass (src/llama-sampler.cpp:1150-1223), and
               picked the token whose interval of the cumulative p holds u * sum(p); the server's
               token is numerics-close when u lies within `noise` of the boundary to its interval,
               where `noise` is the logprob difference measured on this record's real values,
               turned into probability (p * noise for each interval in between)
    greedy     temperature 0 keeps the argmax: a near tie when the two logprobs differ by no more
               than `noise`
    rejection  the verifier compared u with p/q: numerics-close when |u - p/q| <= noise * p/q

Pure: the caller passes the candidates, the draw and the noise. The trace keeps candidates sorted
by p, which is the order dist scans whenever top-k ran before it (the default chain); without
top-k the interval figures are approximate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..numerics.rng import MT19937, canonical_double

DEFAULT_NOISE = 0.1  # nats, when the transcript has no real values to measure it (the largest seen: 0.093)


@dataclass(frozen=True)
class Explanation:
    cause: str  # "numerics" | "loop"
    text: str

    def to_json(self) -> dict:
        return {"cause": self.cause, "text": self.text}


def dist_draw(seed: int, ordinal: int) -> float:
    """The uniform the target chain's dist sampler drew on its `ordinal`-th pass (1-based)."""
    rng = MT19937(seed & 0xFFFFFFFF)
    u = 0.0
    for _ in range(ordinal):
        u = canonical_double(rng)
    return u


def explain_sampled(ids: np.ndarray, p: np.ndarray, u: float, ours: int, theirs: int, noise: float) -> Explanation:
    """Where u fell in the cumulative p (array order, as dist scans it) relative to the interval of the
    server's token (module docstring)."""
    p64 = p.astype(np.float64)
    cum = np.cumsum(p64)
    target = u * cum[-1]
    where = {int(t): k for k, t in enumerate(ids)}
    if theirs not in where:
        return Explanation("loop", f"the server's token is not among the trace's {len(ids)} candidates after the "
                                   "sampler chain: not a near tie")
    j, jb = where[ours], where[theirs]
    lo, hi = sorted((j, jb))
    # interval k is [cum[k-1], cum[k]): how far the cumulative p must move for u to land in jb's
    margin = target - cum[jb] if jb < j else cum[jb - 1] - target
    allowed = noise * float(p64[lo:hi + 1].sum())
    figures = (f"u {u:.6f} at {target:.6f} of the cumulative p; the trace's token holds "
               f"[{(cum[j - 1] if j else 0.0):.6f}, {cum[j]:.6f}), the server's p {p64[jb]:.4f}; the draw lies "
               f"{margin:.6f} from the server's token, and a numeric difference of {noise:.3g} nats moves the "
               f"boundaries by up to {allowed:.6f}")
    return Explanation("numerics" if margin <= allowed else "loop",
                       ("explained by numerics: " if margin <= allowed else "not a near tie: ") + figures)


def explain_greedy(lp_ours: float, lp_theirs: float | None, noise: float) -> Explanation:
    if lp_theirs is None:
        return Explanation("loop", "temperature 0 keeps the argmax, and the server's token is not among the "
                                   "trace's top candidates: not a near tie")
    gap = lp_ours - lp_theirs
    text = (f"temperature 0 keeps the argmax; the two tokens' logprobs differ by {gap:.4g}, the numeric difference "
            f"is {noise:.3g} nats")
    return Explanation("numerics" if gap <= noise else "loop",
                       ("explained by numerics (a near tie): " if gap <= noise else "not a near tie: ") + text)


def explain_rejection(u: float | None, p: float, q: float, noise: float) -> Explanation:
    if u is None or q <= 0:
        return Explanation("loop", "the rejection verifier drew nothing for this position: not a near tie")
    ratio = p / q
    margin = abs(u - ratio)
    text = f"the verifier compared u {u:.6f} with p/q {ratio:.6f} ({margin:.6f} apart; noise {noise:.3g} nats)"
    close = margin <= noise * ratio
    return Explanation("numerics" if close else "loop",
                       ("explained by numerics: " if close else "not a near tie: ") + text)


def measured_noise(pairs: list[tuple[float, float]]) -> float | None:
    """The largest |server - trace| logprob over real values both reported (token and alternatives)."""
    d = [abs(a - b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    return max(d) if d else None
