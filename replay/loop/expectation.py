"""The expected acceptance of a draft: what the verifier keeps on average, given the draft.

`tune` reports, beside the counts of one run, the acceptance the verifier's own probabilities give
along a draft (docs/tune.md). At position j of a draft d[0..n), once d[0..j) were kept, the verifier
keeps d[j] with probability a[j]:

    sample-and-match   a[j] = p(d[j])                 the target chain's draw equals the draft token
                                                       (common/sampling.cpp:686-718)
    rejection          a[j] = min(1, p(d[j]) / q(d[j])), 0 where q(d[j]) = 0
                                                       (common/sampling.cpp:785-796)

where p is the target chain's distribution at row j after the draft's first j tokens went into its
history, and q the draft's. A draft then keeps k or more tokens with probability a[0]...a[k-1], and
keeps sum_k a[0]...a[k-1] tokens on average. At temperature 0, p is one-hot: a[j] is 0 or 1 and the
expectation is the count. "Kept" is what the server counts as an accepted draft (draft_n_accepted):
sample-and-match stops at a matched end-of-generation token before the draft's end and counts it as the
target's own draw, so such a token and every one after it keep nothing (`acceptances`).

What this is exact for: the verifier's draws, given each draft and the context it was drafted in. A
probabilistic draft's own draws (draft-simple sampling at temperature > 0) are one sample. Chains whose
distribution is not a function of the logits and the history (a grammar's resample, mirostat's and
adaptive-p's state, XTC's own draw) have no such p: `not_expectable` names them.
"""
from __future__ import annotations

from typing import Callable, Sequence

from replay.loop.verifiers import ChainRows
from replay.loop.verify import prob_of


def acceptance_prob(rule: str, p: float, q: float | None) -> float:
    """a[j] for one position (module docstring).

    >>> acceptance_prob("sample-and-match", 0.25, None)
    0.25
    >>> acceptance_prob("rejection", 0.2, 0.4), acceptance_prob("rejection", 0.5, 0.4), acceptance_prob("rejection", 0.5, 0.0)
    (0.5, 1.0, 0.0)
    """
    if rule == "rejection":
        if not q or q <= 0:
            return 0.0
        return min(1.0, p / q)
    return float(p)


def kept_by_position(a: Sequence[float]) -> list[float]:
    """P(the draft keeps position k), k = 0..n-1: the running products a[0]...a[k].

    >>> kept_by_position([0.5, 0.5, 1.0])
    [0.5, 0.25, 0.25]
    """
    out, run = [], 1.0
    for x in a:
        run *= x
        out.append(run)
    return out


def expected_kept(a: Sequence[float]) -> float:
    """The expected number of draft tokens kept: sum_k a[0]...a[k].

    >>> expected_kept([1.0, 1.0, 0.0, 1.0])
    2.0
    >>> expected_kept([])
    0.0
    """
    return float(sum(kept_by_position(a)))


def not_expectable(params, has_grammar: bool) -> str | None:
    """Why the target chain has no distribution to take a[j] from (None: it has one). `params` is the
    request's SamplingParams (settings/sampling.py).

    >>> from types import SimpleNamespace as S
    >>> base = dict(mirostat=0, samplers=("top_k", "temperature"), xtc_probability=0.0, xtc_threshold=0.1)
    >>> not_expectable(S(**base), False) is None
    True
    >>> not_expectable(S(**base), True)
    'a grammar resamples what it rejects'
    >>> not_expectable(S(**{**base, "mirostat": 2}), False)
    'mirostat keeps a state the draw moves'
    """
    if has_grammar:
        return "a grammar resamples what it rejects"
    if params.mirostat:
        return "mirostat keeps a state the draw moves"
    if "adaptive_p" in params.samplers:
        return "adaptive-p keeps a state the draw moves"
    if "xtc" in params.samplers and params.xtc_probability > 0 and params.xtc_threshold <= 0.5:
        return "XTC draws its own cut"
    return None


def acceptances(draft: Sequence[int], q: list | None, ctx, chain, *, is_eog: Callable[[int], bool],
                eog_rule: bool) -> list[float]:
    """a[j] for every position of a draft verified on the target context's last batch (`ctx`, whose
    row j scores d[j]) by the target chain `chain` (runtime/sampler.py): the chain's p of d[j] at row j
    with d[0..j) accepted into its history, divided by q under the rejection rule (q given), else
    sample-and-match's; 0 from an end-of-generation draft token before the draft's end on (with the
    build's `eog_rule`, sample-and-match stops there and counts it as no accepted draft:
    match_continues, common/sampling.cpp:696). The chain (its history, random state and pass count) is
    put back as it was, so verification then runs as the server's."""
    rule = "rejection" if q is not None else "sample-and-match"  # as the loop's verify chooses
    rows = ChainRows(ctx, chain)
    snap, passes = chain.snapshot(), chain.passes
    out: list[float] = []
    try:
        for j, d_tok in enumerate(draft):
            cands, _ = chain.apply(ctx.logits(j))
            p = float(rows.target_p(cands)[cands["id"] == d_tok].sum()) if len(cands) else 0.0
            q_j = float(prob_of(q[j][0], q[j][1], d_tok)) if rule == "rejection" else None
            if rule == "sample-and-match" and eog_rule and is_eog(d_tok) and j + 1 < len(draft):
                out += [0.0] * (len(draft) - j)
                break
            out.append(acceptance_prob(rule, p, q_j))
            chain.accept(d_tok)
    finally:
        chain.restore(snap)
        chain.passes = passes  # not the server's work
    return out
