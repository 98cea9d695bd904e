"""The `llama-speculative` example's stochastic verification, reimplemented (single draft sequence).

examples/speculative/speculative.cpp (identical in b11434 and 0c1e570) verifies a draft at
temperature > 0 like this (:264-392):

1. the target sampler samples the verify row (its choice is discarded) and its candidates
   `p` become `dist_tgt` (:268-270);
2. one `uniform_int_distribution` draw picks the draft sequence (:284-285), one
   `uniform_real_distribution<double>` draw `r` (:302);
3. accept the draft token x iff `r <= p(x) / q(x)` (:321-330), with q the draft sampler's
   candidates stored when x was drafted (:578);
4. otherwise build the residual (:335-367) and sample it with `discrete_distribution` (:383-392).

Two defects make it biased:

* **the draft token is the top candidate, not the sampled one** (:569
  `cur_p->data[is].id` with is = 0): the draft always proposes argmax q, yet step 3
  treats it as a sample from q;
* **the residual subtracts by array position, not by token id** (:350-356): both candidate
  lists are sorted by id and `p[i] - q[i]` is taken for the same index i, which pairs
  different tokens whenever the two top-k sets differ.

`fixed=True` corrects both (the sampled draft token; `max(0, p(x) - q(x))` per token id),
which is what `patches.example_patch` writes into the C++. Random numbers come from the
example's `std::default_random_engine` (minstd_rand0, seeded with the request seed, :67),
reproduced draw for draw in rng.py, so a run can be predicted seed by seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay.numerics.rng import (
    MinStdRand0,
    minstd_canonical_double,
    minstd_discrete,
    minstd_uniform_int,
)


@dataclass(frozen=True)
class Dist:
    """A sampler's candidate list as left by get_candidates(sorted): ids and float32 p, in order."""

    ids: tuple[int, ...]
    p: tuple[float, ...]

    @classmethod
    def of(cls, cands: np.ndarray) -> "Dist":
        return cls(tuple(int(i) for i in cands["id"]), tuple(float(v) for v in cands["p"]))

    def p_of(self, token: int) -> float:
        """First entry with that id, else 0 (the example's lookups, :311-322)."""
        for i, p in zip(self.ids, self.p):
            if i == token:
                return p
        return 0.0


def residual(tgt: Dist, dft: Dist, *, by_id: bool) -> Dist:
    """The residual distribution the example samples after a rejection (:339-367).

    Both lists are sorted by id; entry i becomes max(0, p_i - q_i) in float32, where q_i is
    the draft's entry at the same *position* i (the example) or the draft's p of the same
    *token* (by_id, the fix); then divided by their float32 sum and sorted by p descending
    (std::sort of <= 16 elements is an insertion sort, hence stable)."""
    t = sorted(zip(tgt.ids, tgt.p))
    d = sorted(zip(dft.ids, dft.p))
    f32 = np.float32
    res = []
    total = f32(0)
    for i, (tid, tp) in enumerate(t):
        if by_id:
            q = next((qp for qid, qp in d if qid == tid), 0.0)
        else:
            q = d[i][1] if i < len(d) else 0.0
        r = max(f32(0), f32(tp) - f32(q))
        res.append([tid, r])
        total = f32(total + r)
    for e in res:
        e[1] = f32(e[1] / total)
    res.sort(key=lambda e: -e[1])  # Python's sort is stable, like the insertion sort
    return Dist(tuple(e[0] for e in res), tuple(float(e[1]) for e in res))


def verify(rng: MinStdRand0, tgt: Dist, dft: Dist, x: int, *, fixed: bool) -> tuple[int, bool]:
    """One verification of draft token `x` (a single draft sequence): (emitted token, accepted)."""
    minstd_uniform_int(rng, 0, 0)  # which active sequence to verify (:284-285): one draw even for one
    r = minstd_canonical_double(rng)
    p, q = np.float32(tgt.p_of(x)), np.float32(dft.p_of(x))
    ratio = float(p / q) if q > 0 else float("inf")
    if r <= ratio:
        return x, True
    res = residual(tgt, dft, by_id=fixed)
    return res.ids[minstd_discrete(rng, list(res.p))], False


def first_token(rng: MinStdRand0, tgt: Dist) -> int:
    """The first generated token: nothing is drafted yet, so the example samples `dist_tgt`
    directly with discrete_distribution (:383-392)."""
    return tgt.ids[minstd_discrete(rng, list(tgt.p))]
