"""Verification of a draft against the target: the two rules llama-server uses.

Vocabulary (used the same way in every module, report and log line):

    draft       the tokens d[0..n) a drafter proposed after the last sampled token
    accepted    draft tokens the target kept
    resampled   the token the target put in place of the first rejected draft token
                (rejection rule: drawn from the residual max(0, p - q))
    bonus       the extra token sampled at position n when the whole draft was accepted
    emitted     accepted + [resampled | bonus]  (1 .. n+1 tokens per step)

Sample-and-match (common/sampling.cpp:686-718, every era): sample the target at
each position; keep going while the sample equals the draft token (and it is not
an EOG before the last position); the sample is emitted either way. Emitted
tokens are exactly what plain decoding would emit.

Rejection (common/sampling.cpp:732-836, b11434 only, temp > 0 and a probabilistic
draft-simple): accept d with probability min(1, p(d)/q(d)); on rejection draw from
the residual. The rules are pure here; randomness is passed in by the caller,
which owns the server's exact MT19937 stream (rng.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Decision:
    """The outcome at one draft position under the rejection rule."""

    accepted: bool
    token: int  # the draft token if accepted, else the resampled one
    u_accept: float | None  # the uniform compared with p/q (None: not drawn, p >= q or q == 0)
    u_residual: float | None  # the uniform that picked from the residual (None: not drawn)
    p: float  # target probability of the draft token (0 if outside the candidates)
    q: float  # draft probability of the draft token (0 if outside q's support)


def prob_of(ids: Sequence[int], probs: Sequence[float], token: int) -> np.float32:
    """The first p for `token` in a candidate list, else 0 (common/sampling.cpp:720-727)."""
    for i, t in enumerate(ids):
        if t == token:
            return np.float32(probs[i])
    return np.float32(0.0)


def rejection_step(draft_token: int, target_ids: Sequence[int], target_p: Sequence[float],
                   q_ids: Sequence[int], q_p: Sequence[float], id_target: int,
                   uniform: Callable[[], np.float32]) -> Decision:
    """One position of common_sampler_sample_and_accept_n_rejection (no grammar), in float32.

    Accept iff q > 0 and (p >= q or U < p/q), U drawn only when q > 0 and p < q (:791).
    Otherwise residual r_k = p_k - q(id_k) over the target candidates in their order,
    keep r_k > 0, sum in float; if sum > 0 draw u = U * sum and scan `u -= r; pick at u <= 0`
    (fallback: the last residual entry); if sum == 0 the target's own sample `id_target`.

    >>> u = iter([np.float32(0.9), np.float32(0.5)]).__next__
    >>> rejection_step(2, [1, 2], [0.7, 0.3], [2, 1], [0.6, 0.4], 1, u).accepted   # p/q = 0.5 < 0.9
    False
    """
    p_x = prob_of(target_ids, target_p, draft_token)
    q_x = prob_of(q_ids, q_p, draft_token)
    u_acc = None
    if q_x > 0:
        if p_x >= q_x:
            return Decision(True, draft_token, None, None, float(p_x), float(q_x))
        u_acc = uniform()
        if u_acc < np.float32(p_x / q_x):
            return Decision(True, draft_token, float(u_acc), None, float(p_x), float(q_x))
    residual: list[tuple[int, np.float32]] = []
    total = np.float32(0.0)
    for t, p in zip(target_ids, target_p):
        r = np.float32(np.float32(p) - prob_of(q_ids, q_p, t))
        if r > 0:
            residual.append((int(t), r))
            total = np.float32(total + r)
    token = id_target
    u_res = None
    if total > 0:
        u_res = uniform()
        u = np.float32(u_res * total)
        token = residual[-1][0]
        for t, r in residual:
            u = np.float32(u - r)
            if u <= 0:
                token = t
                break
    return Decision(False, int(token), None if u_acc is None else float(u_acc),
                    None if u_res is None else float(u_res), float(p_x), float(q_x))


def match_continues(draft_token: int, sampled: int, is_eog: bool, i: int, n_draft: int, *,
                    eog_rule: bool = True) -> bool:
    """Sample-and-match: keep verifying after position i while the sample equals the draft token;
    from b11269 (`eog_rule`, common/sampling.cpp:696) also stop at an EOG that is not the draft's last
    token. Before it, acceptance runs past a matched EOG (process_token stops the emission there)."""
    return draft_token == sampled and not (eog_rule and is_eog and i + 1 < n_draft)
