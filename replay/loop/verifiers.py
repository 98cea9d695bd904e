"""The three ways a step verifies its draft, each a function of the draft and the verify batch's rows.

    by_match(draft, rows, ...)          sample-and-match (common/sampling.cpp:686-718, every era)
    by_rejection(draft, q, rows, ...)   the rejection rule (common/sampling.cpp:732-836, b11434)
    by_replay(draft, rows)              a restored step's kept tokens accepted again (server-context.cpp:57-80)

Each returns what it kept (Verified: accepted + [resampled | bonus], with the row that scored each);
the rule at one position is verify.py's (rejection_step, match_continues), pure. What they read and
advance is the target's side of the step (TargetRows): the verify batch's logits row by row, and the
target sampler chain, whose history each kept token joins before the next row is sampled, as the
server's does (common_sampler_accept), so a row's p depends on the tokens kept before it. The random
draws of the rejection rule come from the caller (`uniform`: the server's MT19937 stream, rng.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from replay.loop.verify import match_continues, rejection_step
from replay.runtime.sampler import post_sampling

Row = tuple[np.ndarray, np.ndarray]  # (logits [n_vocab] float32, the target chain's candidates) of one verify row


@dataclass
class Verified:
    """What verification of one draft produced: `ids` = accepted drafts + [resampled | bonus]."""

    ids: list[int] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)  # the verify row that scored each of `ids`
    chosen: list[tuple[int, str]] = field(default_factory=list)  # (chain pass, Emitted.chosen) of each of `ids`
    target_p: list[float] = field(default_factory=list)
    uniforms: list[list[float | None]] = field(default_factory=list)
    resampled: int | None = None
    bonus: int | None = None


class TargetRows(Protocol):
    """The target's side of a verify step: the batch's rows and the target sampler chain."""

    n_applies: int  # the chain passes so far (Emitted.draw)

    def logits(self, row: int) -> np.ndarray: ...

    def sample(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        """The chain's draw on a row (it advances the chain), and the candidates it drew from."""

    def accept(self, tok: int) -> None:
        """`tok` joins the chain's history (common_sampler_accept)."""

    def target_p(self, cands: np.ndarray) -> np.ndarray:
        """The candidates' p as the rejection rule sees them (a grammar's rejected ones at 0)."""


def by_match(draft: list[int], rows: TargetRows, *, is_eog: Callable[[int], bool], eog_rule: bool) -> Verified:
    """common_sampler_sample_and_accept_n (common/sampling.cpp:686-718): sample each row, keep the sample,
    go on while it equals the draft token (verify.py match_continues); a sample that differs is the
    resampled token; a whole draft kept takes the bonus from the row after it. With no draft, the normal
    path's single sample (no bonus)."""
    v = Verified()
    for i, d_tok in enumerate(draft):
        logits = rows.logits(i)
        tok, cands = rows.sample(logits)
        _keep(v, rows, tok, logits, cands)
        v.target_p.append(post_sampling(cands, d_tok, 0)[0])
        if not match_continues(d_tok, tok, is_eog(tok), i, len(draft), eog_rule=eog_rule):
            if tok != d_tok:
                v.resampled = tok
            return v
    _bonus(v, rows, len(draft), bonus=bool(draft))
    return v


def by_rejection(draft: list[int], q: list, rows: TargetRows, uniform: Callable[[], np.float32]) -> Verified:
    """common_sampler_sample_and_accept_n_rejection (common/sampling.cpp:732-836): at each row the target
    chain samples (its draw is the fallback), then verify.py rejection_step accepts the draft token with
    probability min(1, p/q) or resamples from the residual, drawing from `uniform`; the first rejection
    ends the step, a whole draft kept takes the bonus."""
    v = Verified()
    for i, d_tok in enumerate(draft):
        logits = rows.logits(i)
        id_tgt, cands = rows.sample(logits)
        qi, qp = q[i]
        dec = rejection_step(d_tok, cands["id"], rows.target_p(cands), qi, qp, id_tgt, uniform)
        v.target_p.append(dec.p)
        v.uniforms.append([dec.u_accept, dec.u_residual])
        _keep(v, rows, dec.token, logits, cands, "rejection accepted" if dec.accepted else "rejection resampled")
        if not dec.accepted:
            v.resampled = dec.token
            return v
    _bonus(v, rows, len(draft), bonus=bool(draft))
    return v


def by_replay(draft: list[int], rows: TargetRows) -> Verified:
    """server_accept_replay (server-context.cpp:57-80): every kept token is accepted again after a sample
    whose result is discarded (it advances the chain), then one new token is sampled (the bonus)."""
    v = Verified()
    for i, d_tok in enumerate(draft):
        logits = rows.logits(i)
        _, cands = rows.sample(logits)
        draw = rows.n_applies
        rows.accept(d_tok)
        v.ids.append(d_tok)
        v.rows.append((logits, cands))
        v.chosen.append((draw, "replayed"))
        v.target_p.append(post_sampling(cands, d_tok, 0)[0])
    _bonus(v, rows, len(draft), bonus=True)
    return v


def _keep(v: Verified, rows: TargetRows, tok: int, logits: np.ndarray, cands: np.ndarray,
          chosen: str = "drawn") -> None:
    """A token the verifier returns: accepted into the chain's history (common_sampler_accept)."""
    v.chosen.append((rows.n_applies, chosen))
    rows.accept(tok)
    v.ids.append(tok)
    v.rows.append((logits, cands))


def _bonus(v: Verified, rows: TargetRows, row: int, *, bonus: bool) -> None:
    """Every draft token was kept: sample one more at the row after the draft."""
    logits = rows.logits(row)
    tok, cands = rows.sample(logits)
    _keep(v, rows, tok, logits, cands)
    if bonus:
        v.bonus = tok


class ChainRows:
    """TargetRows over a target context's last batch and its sampler chain (runtime/sampler.py)."""

    def __init__(self, ctx, chain):
        self.ctx, self.chain = ctx, chain

    @property
    def n_applies(self) -> int:
        return self.chain.n_applies

    def logits(self, row: int) -> np.ndarray:
        return self.ctx.logits(row)

    def sample(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        cands, sel = self.chain.sample(logits)
        return int(cands["id"][sel]), cands

    def accept(self, tok: int) -> None:
        self.chain.accept(tok)

    def target_p(self, cands: np.ndarray) -> np.ndarray:
        """The target's p as the rejection verifier sees it: with a grammar, the candidates it rejects
        get 0 and the rest are rescaled by 1/sum, in float32 (common/sampling.cpp:754-778)."""
        if self.chain.grammar is None:
            return cands["p"]
        valid = np.isfinite(self.chain.grammar.masked(cands)["logit"])
        p_raw = np.where(valid, cands["p"], np.float32(0)).astype(np.float32)
        p_sum = np.add.accumulate(p_raw, dtype=np.float32)[-1] if len(p_raw) else np.float32(0)
        p_norm = np.float32(1) / p_sum if p_sum > 0 else np.float32(1)
        return (p_raw * p_norm).astype(np.float32)
