"""What one request brings to the loop and what each of its steps did.

    Request         its prompt, sampling settings, the server's speculative flags, n_probs, ...
    Step            one verify step: the draft, the rule, what was accepted, resampled, emitted
    check_seed      a drawn request needs a fixed seed to be reproduced
    drafts_counted  how many of a step's kept tokens the server counts as accepted drafts
"""
from __future__ import annotations

from dataclasses import dataclass, field

from replay.errors import TranscriptError
from replay.runtime.sampler import LLAMA_DEFAULT_SEED
from replay.schedule.prompt import NO_SPANS, MessageSpans
from replay.settings import SpecConfig
from replay.settings.sampling import Effective


def drawn(params) -> bool:
    """Whether the server's chains draw at random (a seed then decides the tokens): a temperature above 0,
    a dynamic temperature range, or XTC on; else each keeps one candidate and the draw is no choice.

    >>> from replay.settings.sampling import SamplingParams
    >>> drawn(SamplingParams(temp=0.0)), drawn(SamplingParams(temp=0.7)), drawn(SamplingParams(temp=0.0, xtc_probability=0.5))
    (False, True, True)
    """
    return params.temp > 0 or params.dynatemp_range > 0 or params.xtc_probability > 0


def check_seed(params) -> None:
    """At temperature <= 0 (no dynamic range, no XTC) every sampler keeps one candidate before the draw
    (src/llama-sampler.cpp:265-285, llama_sampler_temp_impl), so no seed moves a token: greedy runs replay
    without one, as eval harnesses send them. A drawn request with seed -1 (LLAMA_DEFAULT_SEED) ran on a
    random seed the server drew: it cannot be reproduced."""
    if params.seed == LLAMA_DEFAULT_SEED and drawn(params):
        raise TranscriptError("the request has no fixed seed (seed -1): the server drew a random one, so the "
                              "run cannot be reproduced; record with an explicit \"seed\"")


@dataclass
class Step:
    """One verify step. Vocabulary as in verify.py."""

    index: int
    pos0: int  # position of `sampled` (the last emitted token, not yet in the KV)
    sampled: int
    rule: str  # "normal" | "sample-and-match" | "rejection" | "checkpoint replay[ (sample-and-match)]",
    #            with ", checkpoint restored" when a partly accepted step was undone
    drafter: str | None = None
    draft: list[int] = field(default_factory=list)
    draft_q: list[float] | None = None  # draft probability of each draft token (probabilistic draft-simple)
    target_p: list[float] = field(default_factory=list)  # target (post-sampling) p of each verified draft token
    uniforms: list[list[float | None]] = field(default_factory=list)  # rejection draws: [u_accept, u_residual]
    # the verifier's probability of keeping each draft token once the ones before it were kept (Request.expect;
    # None: not asked, or the chain has no such probability: loop/expectation.py)
    accept_p: list[float] | None = None
    accepted: int = 0
    resampled: int | None = None
    bonus: int | None = None
    emitted: list[int] = field(default_factory=list)  # after the stop rules

    def to_json(self) -> dict:
        keys = ("index", "pos0", "sampled", "drafter", "draft", "draft_q", "target_p", "uniforms", "rule",
                "accepted", "resampled", "bonus", "emitted") + (("accept_p",) if self.accept_p is not None else ())
        return {k: getattr(self, k) for k in keys}


def drafts_counted(n_accepted: int, replay: bool) -> int:
    """How many of a step's accepted tokens the server counts as accepted drafts (draft_n_accepted):
    a replayed step's last kept token was the verifier's, not a drafter's (:4322-4325).

    >>> drafts_counted(3, replay=False), drafts_counted(3, replay=True), drafts_counted(0, replay=True)
    (3, 2, 0)
    """
    return n_accepted - 1 if replay and n_accepted > 0 else n_accepted


@dataclass(frozen=True)
class Request:
    """What one request brings to the loop: its prompt ids, its sampling settings (with grammar and
    limits), the server's speculative flags, how many probabilities it asked for, the prompt's message
    spans (schedule/prompt.py), and the prompt tokens the server took from its cache (timings.cache_n)."""

    prompt: tuple[int, ...]
    settings: Effective
    spec: SpecConfig
    n_probs: int = 0
    spans: MessageSpans = NO_SPANS
    cached: int | None = None
    expect: bool = False  # take each draft's acceptance probabilities (Step.accept_p, loop/expectation.py: tune)
    # keep each emitted token's candidates and largest logits, what explaining a divergence needs
    # (comparison/trace.py explain); recover, which only asks whether the loop parts, goes without
    evidence: bool = True


def draft_q_of(draft: list[int], q: list | None) -> list[float] | None:
    """The draft's own probability of each draft token, from its candidates at that position."""
    if not q:
        return None
    return [float(qp[list(qi).index(t)]) if t in qi else 0.0 for t, (qi, qp) in zip(draft, q)]
