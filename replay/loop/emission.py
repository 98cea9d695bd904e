"""The tokens a request emitted, with their verify-row values, and the rules that end generation.

Every token the loop emits goes through `Emission.add`, in the order the server sends them: the token is
recorded with the values a fixed server reports for it (the pre-sampling softmax of the verify row that
scored it and the target chain's post-sampling candidates there: docs/architecture.md, "The truth"), then
the server's stop rules decide whether generation goes on (process_token, server-context.cpp:1966-2095).
The rules are `stop_reason`, pure; a stop drops the rest of the step's tokens (:4350-4368).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from replay.numerics.server_probs import pre_sampling
from replay.runtime.sampler import post_sampling
from replay.transcripts.utf8 import utf8_complete

CANDS_KEPT = 256  # candidates kept per emitted token for explaining a divergence
BEST_KEPT = 256  # raw logits kept per emitted token, likewise


@dataclass
class Emitted:
    """One token the server emitted, with its verify-row values (what a fixed server would report)."""

    index: int
    id: int
    step: int
    logprob: float  # pre-sampling, what a fixed server reports with post_sampling_probs false
    top: list[tuple[int, float]]
    post_prob: float
    post_top: list[tuple[int, float]]
    # how it was chosen, for explaining a divergence (comparison/divergence.py): the chain pass that scored
    # its row (1-based), that pass's candidates (ids and p, in order), and the verifier's rule
    draw: int = 0
    cands: np.ndarray | None = field(default=None, repr=False)
    # "drawn" (the target chain's own draw: a normal step, sample-and-match, a bonus), "replayed" (a restored
    # step's kept token), "rejection accepted" (a draft token the rejection rule kept), "rejection resampled"
    # (drawn from the residual in place of the first draft token it rejected): verify.py's words
    chosen: str = "drawn"
    # the row's BEST_KEPT largest raw logits (and its own): a near tie at temperature 0, or a token the
    # trace's chain cut that the server's kept within the numeric difference (comparison/divergence.py)
    best_logits: dict[int, float] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Limits:
    """What ends generation besides end-of-generation tokens (process_token, server-context.cpp:1966-2095)."""

    n_ctx: int  # the slot's context
    n_predict: int = -1  # -1: no limit
    stop: tuple[str, ...] = ()

    def context_full(self, n_prompt: int, n_before: int, n_step: int) -> bool:
        """The context stop for every token of a step (server-context.cpp:2018-2026):
        `prompt.n_tokens() + 1 >= n_ctx`, where at emission the slot holds the prompt, the tokens
        emitted before this step and all but one of this step's, the same for each of them:

            n_tokens = n_prompt + n_before + n_step - 1

        so a normal step stops after token n_ctx - n_prompt, and a speculative step whose accepted
        draft fills the context exactly stops after its first token.

        >>> Limits(n_ctx=10).context_full(8, 0, 1), Limits(n_ctx=10).context_full(8, 1, 1)
        (False, True)
        >>> Limits(n_ctx=10).context_full(6, 0, 4)  # a whole step that fills it: every token of it stops
        True
        """
        return n_prompt + n_before + n_step - 1 + 1 >= self.n_ctx


def stop_reason(text: bytes, is_eog: bool, limits: Limits, *, n_prompt: int, n_before: int, n_step: int,
                n_emitted: int) -> str | None:
    """Why generation stops after a token, the first rule that ends it in the order the server asks them
    (process_token, server-context.cpp:1966-2095), or None when it goes on:

        "stop string"   a stop string is in the text, looked for only while the text ends in a whole
                        UTF-8 character, in its bytes (:1980-2000)
        "context"       the slot's context is full (Limits.context_full, :2019-2027)
        "n_predict"     n_emitted tokens reached n_predict (has_budget, :2029-2034)
        "eog"           the token ends generation (:2085-2090)

    `text` is every emitted token's piece so far, this one's included; `n_before` tokens were emitted
    before this step, which verified `n_step`; `n_emitted` counts this one.

    >>> lim = Limits(n_ctx=100, n_predict=3, stop=("END",))
    >>> stop_reason(b"the END", False, lim, n_prompt=5, n_before=0, n_step=1, n_emitted=1)
    'stop string'
    >>> stop_reason(b"the EN\\xe2\\x82", False, Limits(100, stop=("EN",)), n_prompt=5, n_before=0, n_step=1, n_emitted=1) is None
    True
    >>> stop_reason(b"a", False, lim, n_prompt=5, n_before=2, n_step=1, n_emitted=3)
    'n_predict'
    >>> stop_reason(b"a", True, lim, n_prompt=99, n_before=0, n_step=1, n_emitted=1)  # the context is asked before EOG
    'context'
    >>> stop_reason(b"a", True, lim, n_prompt=5, n_before=0, n_step=1, n_emitted=1)
    'eog'
    """
    if utf8_complete(text) == len(text) and any(s and s.encode() in text for s in limits.stop):
        return "stop string"
    if limits.context_full(n_prompt, n_before, n_step):
        return "context"
    if limits.n_predict >= 0 and n_emitted >= limits.n_predict:
        return "n_predict"
    return "eog" if is_eog else None


class Emission:
    """The record of what one request emitted: each token with its values (`emitted`), the text so far,
    and why generation stopped (`stopped`, stop_reason's words, None while it goes on).

    `evidence` keeps each token's chain candidates and largest logits, what explaining a divergence
    needs (comparison/trace.py explain); recover, which only asks whether the loop parts, goes without."""

    def __init__(self, target, limits: Limits, n_prompt: int, n_probs: int, *, evidence: bool = True):
        self.target, self.limits, self.n_prompt = target, limits, n_prompt
        self.n_probs, self.evidence = max(n_probs, 1), evidence
        self.emitted: list[Emitted] = []
        self.text = b""
        self.stopped: str | None = None

    def add(self, tok: int, step: int, logits: np.ndarray, cands: np.ndarray, *, n_before: int, n_step: int,
            chosen: tuple[int, str] = (0, "drawn")) -> bool:
        """Record `tok`, scored by the row `logits` and drawn from `cands` by the chain pass and rule
        `chosen`; False when generation stops after it."""
        logprob, top = pre_sampling(logits, tok, self.n_probs)
        post_p, post_top = post_sampling(cands, tok, self.n_probs)
        kept, best = None, {}
        if self.evidence:
            kept = cands[:CANDS_KEPT].copy()
            ids = np.argpartition(logits, -BEST_KEPT)[-BEST_KEPT:] if len(logits) > BEST_KEPT else np.arange(len(logits))
            best = {int(i): float(logits[i]) for i in ids} | {tok: float(logits[tok])}
        self.emitted.append(Emitted(len(self.emitted), tok, step, logprob, top, post_p, post_top, draw=chosen[0],
                                    cands=kept, chosen=chosen[1], best_logits=best))
        self.text += self.target.piece(tok, special=False)
        self.stopped = stop_reason(self.text, self.target.is_eog(tok), self.limits, n_prompt=self.n_prompt,
                                   n_before=n_before, n_step=n_step, n_emitted=len(self.emitted))
        return self.stopped is None

    def remaining(self) -> int:
        """Tokens n_predict still allows (-1: no limit), what a step's draft is cut to (drafting.py)."""
        return self.limits.n_predict - len(self.emitted) if self.limits.n_predict >= 0 else -1
