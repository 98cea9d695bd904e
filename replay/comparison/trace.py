"""A trace against its transcript: where it parts from what the server recorded, and why. Pure over
the trace's results (the loop ran in commands/trace.py).

    TraceResult             the loop's steps and emitted tokens, the comparison and its explanation
    compare_with_plan       the first emitted token that disagrees with the transcript (ids, or text)
    items_of_emitted        the plan item each emitted token stands for
    explain                 numerics or the loop at the first divergence (divergence.py's rules)
    drafts_shared/_differ   why every token can match while the draft totals do not
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from replay.builds.loop_shapes import Shape
from replay.comparison.bounds import DEFAULT_NOISE, MULTI_SLOT_NOISE
from replay.comparison.divergence import (
    Explanation,
    admitted,
    dist_draw,
    explain_greedy,
    explain_rejection,
    explain_sampled,
    measured_noise,
    possibly_ahead,
)
from replay.loop.emission import Emitted
from replay.loop.request import Step
from replay.loop.work import Work
from replay.runtime.binding import library_in_use
from replay.runtime.llama import Model
from replay.settings import describe
from replay.settings.sampling import Effective
from replay.transcripts.entries import SentEntry, record_entries
from replay.transcripts.plan import Known, Plan
from replay.transcripts.readers import Record


@dataclass
class TraceResult:
    steps: list[Step]
    emitted: list[Emitted]
    pieces: list[str]
    recorded: list[int] | None  # the transcript's generated ids (None: no transcript, or it lacks ids)
    first_divergence: int | None
    draft_n: int
    draft_n_accepted: int
    server_draft_n: int | None = None
    server_draft_n_accepted: int | None = None
    post: bool = False
    server_candidates: list[tuple[int, float]] | None = None  # the transcript's top list at the divergence
    notes: list[str] = field(default_factory=list)
    shape: Shape | None = None  # the loop shape replayed, and why (builds/loop_shapes.py)
    spec: Any = None  # the SpecConfig the loop ran with (its .sources say where each value came from)
    settings: Effective | None = None  # the sampling settings, and where each came from
    compared: str | None = None  # what was compared with the transcript: "token ids" or "text"
    explanation: Explanation | None = None  # why it diverged (comparison/divergence.py)
    schedule: dict | None = None  # the prompt batches and the slot's checkpoints (schedule/), as recover reports them
    # the replay's decode calls and rows for this request, prompt included: {"target": (calls, rows), "draft": ...}
    decodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    work: Work | None = None  # the generation phase's decodes by batch size and chain passes (loop/work.py)
    prefix: Any = None  # schedule/prefix.py Prefix: what the request kept of the slot's memory

    @property
    def reproduced(self) -> bool | None:
        if self.compared is None:
            return None
        return self.first_divergence is None and (
            self.server_draft_n is None or (self.server_draft_n, self.server_draft_n_accepted) ==
            (self.draft_n, self.draft_n_accepted))

    def lighten(self) -> "TraceResult":
        """Drop what only explaining a divergence needs (each emitted token's candidate arrays and
        largest logits: ~0.6 MB a token), once `explanation` is made; returns self."""
        for e in self.emitted:
            e.cands, e.best_logits = None, {}
        return self

    def to_json(self, piece: Callable[[int], str]) -> dict:
        def top(pairs, post):
            return [{"id": i, "piece": piece(i), "logprob": (math.log(v) if post and v > 0 else v)} for i, v in pairs]
        return {
            "steps": [s.to_json() for s in self.steps],
            "emitted": [{"index": e.index, "id": e.id, "piece": self.pieces[e.index], "step": e.step,
                         "logprob": e.logprob, "top": top(e.top, False),
                         "post_prob": e.post_prob, "post_top": top(e.post_top, True)} for e in self.emitted],
            "reproduced": self.reproduced, "compared": self.compared, "first_divergence": self.first_divergence,
            "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
            "server_draft_n": self.server_draft_n, "server_draft_n_accepted": self.server_draft_n_accepted,
            "server_candidates_at_divergence": None if self.server_candidates is None else
            [{"id": i, "piece": piece(i), "logprob": lp} for i, lp in self.server_candidates],
            "divergence": None if self.explanation is None else self.explanation.to_json(),
            "notes": self.notes,
            "libllama": library_in_use(),
            "loop_shape": None if self.shape is None else self.shape.to_json(),
            "settings": [{"setting": k, "value": v, "source": src} for k, v, src in self.described()],
            "schedule": self.schedule,
        }

    def described(self) -> list[tuple[str, Any, str]]:
        """(setting, value, source) of every server flag and sampling setting that did not come from
        llama-server's built-in defaults."""
        out = [(flag, list(v) if isinstance(v, tuple) else v, src) for flag, v, src in describe(self.spec)
               if src != "default"] if self.spec is not None else []
        if self.settings is not None:
            out += self.settings.describe()
        return out


def compare_with_plan(ids: Sequence[int], plan: Plan, target: Model, *, stream: bool) -> int | None:
    """The index of the first emitted token that disagrees with the transcript, or None.

    Known ids must match one for one. A gap (text without ids: a stream's speculative chunk, bytes
    of tokens that ended in incomplete UTF-8) must be exactly the text of the next emitted tokens,
    ending on a token boundary, so a stream is compared chunk by chunk. A stream sends nothing for
    a final end-of-generation token, so the trace may emit one more."""
    items, parted = _aligned(ids, plan, lambda t: target.piece(t, special=False))
    if parted is not None:
        return parted
    i = len(items)
    if i == len(ids) or (stream and i == len(ids) - 1 and target.is_eog(ids[i])):
        return None
    return i


def items_of_emitted(ids: Sequence[int], plan: Plan, piece: Callable[[int], bytes]) -> list | None:
    """The plan item each emitted token stands for, walking the plan as compare_with_plan does: a Known
    item is one token with its id; a gap is the tokens whose pieces spell its text, ending on a token
    boundary. None where they do not line up; a final token past the plan (a stream sends nothing for a
    final end-of-generation token) has no item.

    >>> from replay.transcripts.plan import Gap, Known
    >>> pieces = {1: b"a", 4: b"b", 5: b"cd"}
    >>> plan = (Known(1, None), Gap(b"bcd", "", None))
    >>> [type(i).__name__ for i in items_of_emitted([1, 4, 5], plan, pieces.__getitem__)]
    ['Known', 'Gap', 'Gap']
    >>> items_of_emitted([1, 5], plan, pieces.__getitem__) is None
    True
    """
    items, parted = _aligned(ids, plan, piece)
    return items if parted is None else None


def _aligned(ids: Sequence[int], plan: Plan, piece: Callable[[int], bytes]) -> tuple[list, int | None]:
    """(the plan item of each emitted token while they line up, the index of the first token that does
    not: a wrong id, the token whose bytes leave a gap's text, or len(ids) where the tokens end inside a
    gap or before the plan's end; None where the whole plan is spelled)."""
    items: list = []
    i = 0
    for item in plan:
        if isinstance(item, Known):
            if i >= len(ids) or ids[i] != item.id:
                return items, i
            items.append(item)
            i += 1
            continue
        text = b""
        while len(text) < len(item.data):
            if i >= len(ids):
                return items, i  # the trace ended inside the gap
            text += piece(ids[i])
            if not item.data.startswith(text):
                return items, i  # this token's bytes leave the gap's text
            items.append(item)
            i += 1
    return items, None


def real_value_pairs(res: TraceResult, sent: Sequence[SentEntry], upto: int | None = None) -> list[tuple[float, float]]:
    """(server, trace) logprob of every real value the transcript sent (`sent`: record_entries) for a
    token the trace emitted the same, its alternatives matched by id (the trace reports with the
    transcript's mode), up to and including index `upto` (after a divergence the two condition on
    different tokens)."""
    pairs = []
    n = len(res.emitted) if upto is None else upto + 1
    for k, (e, s) in enumerate(zip(res.emitted[:n], sent[:n])):
        if s.is_placeholder or (s.id != e.id and k != upto):
            continue  # (at the divergence itself the context is the same: its alternatives compare)
        ours = dict((i, math.log(p) if p > 0 else -math.inf) for i, p in e.post_top) if res.post else dict(e.top)
        if s.id == e.id:
            pairs.append((s.logprob, (math.log(e.post_prob) if e.post_prob > 0 else -math.inf) if res.post
                          else e.logprob))
        pairs += [(lp, ours[i]) for i, _, lp in s.top if i in ours]
    return pairs


def explain(res: TraceResult, rec: Record, settings: Effective, slots: int | None = None) -> Explanation | None:
    """Numerics or the loop, at the first divergence (comparison/divergence.py). The numeric difference is
    the largest measured on the record's real values up to the divergence. On a server that ran
    several slots (or may have), batches shared with other requests move a position's logits by more
    than a few reported values show: where the values that decide the divergence (the tokens possibly
    ahead of the server's in the draw's order, and the server's own) are not all among the real
    values the server sent for that position (a placeholder, or a short top list), at least
    MULTI_SLOT_NOISE, the largest difference measured on real values of concurrent traffic."""
    i = res.first_divergence
    if i is None or i >= len(res.emitted) or res.recorded is None or i >= len(res.recorded):
        return None
    e, theirs = res.emitted[i], res.recorded[i]
    sent = record_entries(rec)
    noise = measured_noise(real_value_pairs(res, sent, upto=i))
    assumed = noise is None
    noise = DEFAULT_NOISE if assumed else max(noise, 1e-6)
    p = settings.params
    rejection = e.chosen in ("rejection accepted", "rejection resampled")
    greedy = not rejection and p.temp <= 0 and p.mirostat == 0 and "temperature" in p.samplers
    sampled = not (rejection or greedy) and p.mirostat == 0 and "adaptive_p" not in p.samplers and e.cands is not None
    reported = set() if i >= len(sent) or sent[i].is_placeholder else \
        {t for t, _, _ in sent[i].top} | {sent[i].id}
    cands = (e.cands["id"], e.cands["p"]) if sampled else None
    multi = slots != 1 and noise < MULTI_SLOT_NOISE and not (_decisive(e, theirs, cands, noise) <= reported)
    if multi:
        noise, assumed = MULTI_SLOT_NOISE, False
    if rejection:
        step = res.steps[e.step]
        k = i - sum(len(s.emitted) for s in res.steps[:e.step])
        u = step.uniforms[k][0] if k < len(step.uniforms) else None
        q = step.draft_q[k] if step.draft_q and k < len(step.draft_q) else 0.0
        out = explain_rejection(u, step.target_p[k] if k < len(step.target_p) else 0.0, q, noise)
    elif greedy:
        out = explain_greedy(e.best_logits.get(e.id, 0.0), e.best_logits.get(theirs), noise)
    elif sampled:
        wider = None if settings.grammar else admitted(*cands, theirs, e.best_logits, p.temp, noise)
        if wider is None:
            out = explain_sampled(*cands, dist_draw(p.seed, e.draw), e.id, theirs, noise)
        else:  # the trace's chain cut the server's token, near enough the boundary for the server's to keep it
            out = explain_sampled(*wider[:2], dist_draw(p.seed, e.draw), e.id, theirs, noise)
            out = Explanation(out.cause, out.text + f" (the trace's chain cut the server's token: its logit lies "
                                                     f"{wider[2]:.4g} nats below the lowest kept candidate's, within "
                                                     "the numeric difference of trading places with it)")
    else:
        return Explanation("loop", "mirostat and adaptive-p draws are not reconstructed: cannot tell")
    if assumed:
        out = Explanation(out.cause, out.text + f" (no real values in the transcript to measure the numeric "
                                                 f"difference: {DEFAULT_NOISE} assumed)")
    if multi:
        where = f"a {slots}-slot server" if slots else "a server that may run several slots"
        what = "a placeholder here" if not reported else "values the server did not send here decide it"
        out = Explanation(out.cause, out.text + f" ({what}, on {where}: {MULTI_SLOT_NOISE} nats assumed, the largest "
                                                 "difference measured on real values of concurrent traffic)")
    return out


def _decisive(e, theirs: int, cands: tuple[np.ndarray, np.ndarray] | None, noise: float) -> set[int]:
    """The tokens whose values decide whether the server could have picked `theirs` where the trace
    picked e.id: both tokens, and for a draw (`cands` given) every candidate that may sit ahead of the server's in the
    order (possibly_ahead)."""
    out = {int(e.id), int(theirs)}
    if cands is not None:
        ids, p = cands
        where = np.nonzero(ids == theirs)[0]
        if len(where) == 0:
            return out | {-1}  # the server's token is not among the candidates: nothing it sent covers that
        out |= {int(t) for t in ids[possibly_ahead(p, float(p[where[0]]), noise)]}
    return out


def recorded_candidates(rec: Record, index: int) -> list[tuple[int, float]] | None:
    """The server's own top list for generated token `index` (natural-log values), if it sent a real one."""
    probs = record_entries(rec)
    if index < len(probs) and probs[index].top:
        return [(i, lp) for i, _, lp in probs[index].top]
    return None


def drafts_shared(res: TraceResult, evidence: str, drafter: str = "draft model") -> Explanation:
    """Every token matches, the draft totals do not, and the drafter's batches may have held other
    requests' tokens: numerics. b11434 drafts every drafting slot in one batch: the draft model
    (common/speculative.cpp:383-386 the first tokens of all slots, 446-453 each next token) and the MTP
    heads alike (1656-1712), whose context also takes the target's whole batch, every slot's rows, with
    their hidden rows (1539-1610 process). A shared batch moves the drafter's values, and with them its
    argmax at a near-tie and the --draft-p-min cut (speculative.cpp:420-425) that ends a draft;
    sample-and-match still emits the target's tokens. `drafter`: "draft model" or "MTP heads"."""
    return Explanation("numerics", (
        f"{_totals_differ(res)}: the server drafts all its busy slots in one batch of its {drafter}, and this "
        f"record's batches may have been shared ({evidence}), which moves {_whose(drafter)} values at a near-tie "
        "or at the --draft-p-min cut"))


def _whose(drafter: str) -> str:
    """The drafter's possessive.

    >>> _whose("draft model"), _whose("MTP heads")
    ("the draft model's", "the MTP heads'")
    """
    return f"the {drafter}'" if drafter.endswith("s") else f"the {drafter}'s"


def _totals_differ(res: TraceResult) -> str:
    return (f"every token matches the transcript, but the draft totals differ (trace drafted {res.draft_n}, "
            f"accepted {res.draft_n_accepted}; the server {res.server_draft_n}, {res.server_draft_n_accepted})")


def drafts_differ(res: TraceResult, drafter: str | None, several_slots: str | None = None) -> str:
    """Why every token can match while the draft totals do not: the drafts were chosen differently.
    `drafter`: "draft model" or "MTP heads" where a model drafts (its values follow the kernels), None
    for an n-gram drafter (its state follows the requests). `several_slots` (Record.several_slots) names
    a possibility the transcript shows no evidence of."""
    why = (f"{_whose(drafter)} argmax at a near-tie follows the kernels that computed its logits: a server "
           "whose ggml differs from this replay's libllama (an older or newer build, a GPU, other CPU code "
           "paths, another --threads-draft past 256 positions) can draft another token there, and "
           "sample-and-match still emits the target's tokens"
           if drafter else "an n-gram drafter's state differs (earlier requests to the same server that "
                           "the transcript does not hold?)")
    also = (f"; or {several_slots} drafted other requests' tokens in the same batch, if any ran at the same time "
            "(nothing in the transcript shows one did)" if several_slots and drafter else "")
    return f"{_totals_differ(res)}: {why}{also}"
