"""Why a trace diverged from its transcript: numerics (a draw that fell within the numeric difference
of a boundary, a near tie) or the loop (anything else), with the figures.

A server with several slots decodes a request in batches shared with other requests, so its logits
differ slightly from a one-request evaluation (comparison/bounds.py). At the first
token where the trace and the transcript differ, the trace knows how it chose its token:

    sampled    the chain's dist sampler drew u from its own stream, mt19937(seed), one
               generate_canonical<double> per chain pass (src/llama-sampler.cpp:1150-1223), and
               picked the token whose interval of the cumulative p holds u * sum(p); the server's
               token is numerics-close when, with every logit off by up to `noise` (the logprob
               difference measured on this record's real values), its interval could hold u
               (explain_sampled: near ties in the order may swap intervals)
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

from replay.numerics.rng import MT19937, canonical_double



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


def possibly_ahead(p: np.ndarray, pt: float, noise: float) -> np.ndarray:
    """Which candidates may sit ahead of a token of probability `pt` in the server's array when every
    logit is off by up to `noise` nats: those within e^(2 noise) of it or above (a near tie in the
    order may swap the two).

    >>> possibly_ahead(np.array([0.5, 0.3, 0.1]), 0.3, 0.05).tolist()
    [True, True, False]
    """
    return p >= pt / math.exp(2 * noise)


def explain_sampled(ids: np.ndarray, p: np.ndarray, u: float, ours: int, theirs: int, noise: float) -> Explanation:
    """Whether a numeric difference of `noise` nats could have put the draw u in the server's token.

    dist picks the candidate whose interval of the cumulative p (in array order, which top-k sorted
    by logit) holds u. Off by at most `noise` = n nats in every logit, a sum S of some candidates' p
    keeps its odds S / (1 - S) within a factor e^(+-2n), and a candidate whose p is within e^(2n) of
    the server's token's may sit on either side of it in the server's array (a near tie in the order
    swaps the two intervals). The server's token therefore starts no earlier than S_ahead and ends no
    later than S_maybe + p_t, each moved by that odds factor, where S_ahead sums the candidates surely
    ahead of it (p > p_t e^(2n)) and S_maybe those possibly ahead (p >= p_t e^(-2n)): numerics when u
    lies inside that range."""
    p64 = p.astype(np.float64)
    p64 = p64 / p64.sum()
    cum = np.cumsum(p64)
    where = {int(t): k for k, t in enumerate(ids)}
    if theirs not in where:
        return Explanation("loop", f"the server's token is not among the trace's {len(ids)} candidates after the "
                                   "sampler chain: not a near tie")
    j, jb = where.get(ours), where[theirs]
    pt, f = float(p64[jb]), math.exp(2 * noise)
    others = np.arange(len(p64)) != jb
    ahead = float(p64[others & (p64 > pt * f)].sum())
    maybe = float(p64[others & possibly_ahead(p64, pt, noise)].sum())
    lo, hi = _odds_moved(ahead, -2 * noise), _odds_moved(maybe + pt, 2 * noise)
    start = cum[jb - 1] if jb else 0.0
    margin = max(start - u, u - cum[jb], 0.0)
    inside = lo <= u < hi
    held = "outside the kept candidates" if j is None else f"[{(cum[j - 1] if j else 0.0):.6f}, {cum[j]:.6f})"
    figures = (f"u {u:.6f}; the trace's token holds {held}, the "
               f"server's token (p {pt:.4f}) [{start:.6f}, {cum[jb]:.6f}): the draw lies {margin:.6f} from the "
               f"server's token, and a numeric difference of {noise:.3g} nats lets that token hold anything "
               f"within [{lo:.6f}, {hi:.6f})")
    return Explanation("numerics" if inside else "loop",
                       ("explained by numerics: " if inside else "not a near tie: ") + figures)


def admitted(ids: np.ndarray, p: np.ndarray, theirs: int, raw: dict[int, float], temp: float,
             noise: float) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The candidates with the server's token added, when the trace's chain cut it but a numeric
    difference of `noise` nats could have kept it; None otherwise. Returns (ids, p, gap).

    top-k, top-p and min-p keep a prefix of the candidates in logit order, so a token whose raw logit
    lies within 2 * noise of the lowest kept candidate's can trade places with it and be kept (a
    sufficient condition: min-p may keep it further down). Its p, beside the kept candidates', is the
    lowest kept one's times e^(-gap / temp) (the chain's softmax over logits / temp), and the whole row
    is normalised again; `raw` holds the row's largest raw logits.

    Token 3's logit is 0.1 below token 2's, within 2 * 0.1; its p is 0.25 * e^-0.1 before the row is
    normalised again; at noise 0.04 it is out of reach:

    >>> ids, p, gap = admitted(np.array([1, 2]), np.array([0.75, 0.25]), 3, {1: 2.0, 2: 0.9, 3: 0.8}, 1.0, 0.1)
    >>> ids.tolist(), [round(float(v), 4) for v in p], round(gap, 3)
    ([1, 2, 3], [0.6116, 0.2039, 0.1845], 0.1)
    >>> admitted(np.array([1, 2]), np.array([0.75, 0.25]), 3, {1: 2.0, 2: 0.9, 3: 0.8}, 1.0, 0.04) is None
    True
    """
    if theirs in set(int(i) for i in ids) or theirs not in raw or temp <= 0 or len(ids) == 0:
        return None
    kept = [raw.get(int(i)) for i in ids]
    if any(v is None for v in kept):
        return None
    low = int(np.argmin(kept))
    gap = float(kept[low]) - raw[theirs]
    if gap > 2 * noise:
        return None
    pt = float(p[low]) * math.exp(-max(gap, 0.0) / temp)
    p2 = np.append(p.astype(np.float64), pt)
    return np.append(ids, theirs), p2 / p2.sum(), gap


def _odds_moved(s: float, by: float) -> float:
    """The probability whose odds are those of `s` times e^by.

    >>> round(_odds_moved(0.5, math.log(3)), 6)
    0.75
    """
    if s <= 0.0 or s >= 1.0:
        return min(max(s, 0.0), 1.0)
    return 1.0 / (1.0 + (1.0 - s) / s * math.exp(-by))


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
