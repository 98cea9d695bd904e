"""Trace a recorded request (or a fresh prompt) through the server's loop and check it.

    trace_record(rec, target, ...) -> TraceResult     the loop with the transcript's settings,
                                                      compared with what it recorded: token ids where
                                                      known, else text (chunk by chunk for streams)
    trace_prompt(target, prompt, ...) -> TraceResult  the loop from scratch

The server's flags resolve from ours, the transcript and its /props (settings/config.py), the
sampling settings layer by layer (settings/sampling.py, reading/settings.py); the loop's
shape (builds/loop_shapes.py) from `--source DIR`, `--build N` or the transcript's build_info. A divergence is explained by
comparison/divergence.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from replay.builds.loop_shapes import NEWEST, Shape, shape_for
from replay.comparison.divergence import (
    DEFAULT_NOISE,
    MULTI_SLOT_NOISE,
    Explanation,
    admitted,
    dist_draw,
    explain_greedy,
    explain_rejection,
    explain_sampled,
    measured_noise,
    possibly_ahead,
)
from replay.errors import ModelError, located
from replay.loop.loop import Emitted, SpeculativeLoop, Step
from replay.loop.replayable import drafts_with_model
from replay.loop.state import SlotState
from replay.reading.identity import compare_draft, mismatch
from replay.reading.record import read_record
from replay.runtime.binding import library_in_use
from replay.runtime.gguf import check_gguf
from replay.runtime.llama import Model
from replay.schedule.memory import SlotConfig, schedule_of
from replay.schedule.prompt import NO_SPANS, MessageSpans
from replay.settings import ContextConfig, SpecConfig, describe, resolve
from replay.settings.sampling import Effective, effective, server_sampling
from replay.tokens.prompt_ids import message_spans
from replay.transcripts.concurrency import shared_evidence
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
    i = 0
    for item in plan:
        if isinstance(item, Known):
            if i >= len(ids) or ids[i] != item.id:
                return i
            i += 1
            continue
        start, text = i, b""
        while len(text) < len(item.data) and i < len(ids):
            text += target.piece(ids[i], special=False)
            i += 1
        if text != item.data:
            if item.data.startswith(text):
                return i  # the trace ended inside the gap
            # the first token whose bytes leave the gap's text
            acc = b""
            for k in range(start, i):
                acc += target.piece(ids[k], special=False)
                if not item.data.startswith(acc) or k == i - 1:
                    return k
            return start
    if i == len(ids) or (stream and i == len(ids) - 1 and target.is_eog(ids[i])):
        return None
    return i


def run_loop(target: Model, prompt: Sequence[int], settings: Effective, spec: SpecConfig, ctx: ContextConfig, *,
             shape: Shape, draft_model: Model | None, n_probs: int, recorded: Plan | None = None,
             timings: dict | None = None, slot_state: SlotState | None = None, stream: bool = False,
             spans: MessageSpans = NO_SPANS, recorded_flags: dict | None = None,
             cached: int | None = None) -> TraceResult:
    """Run the loop for one request. `recorded` (the transcript's plan) is compared with what the loop
    emits (compare_with_plan)."""
    loop = SpeculativeLoop(target, prompt, settings, spec, era=shape.era,
                           slot_config=SlotConfig.of(ctx, recorded_flags, shape.build), draft_model=draft_model,
                           n_probs=n_probs, slot_state=slot_state, spans=spans, cached=cached)
    try:
        steps = list(loop.steps())
        schedule = schedule_of(loop.memory, spans)
    finally:
        loop.close()
    ids = [e.id for e in loop.emitted]
    div, compared, recorded_ids = None, None, None
    if recorded is not None:
        compared = "token ids" if all(isinstance(i, Known) for i in recorded) else "text"
        div = compare_with_plan(ids, recorded, target, stream=stream)
        if compared == "token ids":
            recorded_ids = [i.id for i in recorded]
            if stream and len(ids) == len(recorded_ids) + 1 and target.is_eog(ids[-1]) and div is None:
                recorded_ids.append(ids[-1])  # a stream sends no chunk for the final end-of-generation token
    t = timings or {}
    return TraceResult(steps, loop.emitted, [target.piece(i).decode("utf-8", "replace") for i in ids], recorded_ids,
                       div, loop.n_draft, loop.n_accepted, t.get("draft_n"), t.get("draft_n_accepted"),
                       post=bool(settings.params.post_sampling_probs), notes=list(loop.notes), shape=shape,
                       spec=spec, settings=settings, compared=compared, schedule=schedule)


# --- what a transcript recorded --------------------------------------------------------

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


class Drafts:
    """Draft models by path, loaded once for a run over many records."""

    def __init__(self, params: dict | None = None) -> None:
        self._models: dict[str, Model] = {}
        self.params = dict(params or {})  # Model's load arguments: the server's (runtime/llama.py model_params)

    def get(self, path: str) -> Model:
        if path not in self._models:
            self._models[path] = Model(check_gguf(path), **self.params)
        return self._models[path]


def _draft(drafts: Drafts, spec: Any, rec: Record, renamed: bool) -> Model:
    """The draft model: -md, else the transcript's --spec-draft-model (a path on the server's machine, so
    one line saying to give -md where it is not a file here); -md is compared with the recorded name."""
    given = spec.sources.get("draft_model") == "command line"
    if given:
        wrong = mismatch(compare_draft(rec, Path(spec.draft_model).name, renamed=renamed), "-md")
        if wrong:
            raise ModelError(wrong)
    try:
        return drafts.get(spec.draft_model)
    except ModelError as e:
        if given:
            raise
        raise ModelError(f"{e} (the transcript's --spec-draft-model, a path on the server's machine): give the "
                         "draft model file with -md PATH") from None


# --- the two entry points ----------------------------------------------------------------

def trace_record(rec: Record, target: Model, *, flags: dict | None = None, build: int | None = None,
                 source: Path | None = None, slot_state: SlotState | None = None,
                 drafts: Drafts | None = None, renamed: bool = False, shared: str | None = None) -> TraceResult:
    """Trace one recorded request with its settings (flags given here win over the transcript's), in
    the loop shape of `source` (a llama.cpp checkout), else of build `build`, else of the transcript's
    build_info. Pass the same `slot_state` for consecutive requests to one slot (trace_state.ServerState), and `shared`, the
    evidence that the record's batches were shared with other requests' (transcripts/concurrency.py
    shared_evidence: it ran beside another record), where there is any beyond the record itself. Errors
    name the record."""
    with located(rec.source, rec.index):
        return _trace_record(rec, target, flags or {}, (build, source), slot_state, drafts or Drafts(), renamed,
                             shared)


def _trace_record(rec: Record, target: Model, flags: dict, given: tuple[int | None, Path | None],
                  slot_state: SlotState | None, drafts: Drafts, renamed: bool = False,
                  shared: str | None = None) -> TraceResult:
    read = read_record(rec, target, flags, command="trace", build=given[0], source=given[1], renamed=renamed,
                       shared=shared)
    spec, settings, prompt = read.spec, read.settings, list(read.prompt)
    draft_model = _draft(drafts, spec, rec, renamed) if drafts_with_model(spec, read.shape.era) else None
    res = run_loop(target, prompt, settings, spec, read.context, shape=read.shape, draft_model=draft_model,
                   n_probs=settings.params.n_probs or 5, recorded=read.plan, timings=read.draft_totals,
                   slot_state=slot_state, stream=rec.stream, spans=message_spans(rec, target, prompt),
                   recorded_flags=rec.flags, cached=read.cached)
    res.notes += list(settings.notes)
    if not [t for t in spec.spec_types if t != "none"] and res.server_draft_n:
        res.notes.append(f"the server drafted {res.server_draft_n} tokens, so it did speculate: pass its --spec-type")
    if res.first_divergence is not None:
        res.server_candidates = recorded_candidates(rec, res.first_divergence)
        res.explanation = explain(res, rec, settings, read.slots)
    elif res.reproduced is False:
        if draft_model is not None and read.shared:
            res.explanation = drafts_shared(res, read.shared)
        else:
            res.notes.append(drafts_differ(res, draft_model is not None))
    return res


def drafts_shared(res: TraceResult, evidence: str) -> Explanation:
    """Every token matches, the draft totals do not, and the draft model's batches may have held other
    requests' tokens: numerics. b11434 drafts every drafting slot in one batch on the one draft context
    (common/speculative.cpp:383-386 the first tokens of all slots, 446-453 each next token), so a shared
    batch moves the draft model's values, and with them its argmax at a near-tie and the --draft-p-min
    cut (speculative.cpp:420-425) that ends a draft; sample-and-match still emits the target's tokens."""
    return Explanation("numerics", (
        f"every token matches the transcript, but the draft totals differ (trace drafted {res.draft_n}, accepted "
        f"{res.draft_n_accepted}; the server {res.server_draft_n}, {res.server_draft_n_accepted}): the server "
        f"drafts all its busy slots in one batch of the draft model, and this record's batches may have been shared "
        f"({evidence}), which moves the draft model's values at a near-tie or at the --draft-p-min cut"))


def drafts_differ(res: TraceResult, draft_model: bool) -> str:
    """Why every token can match while the draft totals do not: the drafts were chosen differently."""
    why = ("the draft model's argmax at a near-tie follows the kernels that computed its logits: a server "
           "whose ggml differs from this replay's libllama (an older or newer build, a GPU, other CPU code "
           "paths) can draft another token there, and sample-and-match still emits the target's tokens"
           if draft_model else "an n-gram drafter's state differs (earlier requests to the same server that "
                               "the transcript does not hold?)")
    return (f"every token matches the transcript, but the draft totals differ (trace drafted {res.draft_n}, "
            f"accepted {res.draft_n_accepted}; the server {res.server_draft_n}, {res.server_draft_n_accepted}): "
            + why)


PROMPT_DEFAULTS = {"seed": 1, "n_predict": 32}  # trace --prompt without --seed / -n


def trace_prompt(target: Model, prompt: str, *, flags: dict | None = None, build: int | None = None,
                 source: Path | None = None, drafts: Drafts | None = None) -> TraceResult:
    """Run the loop from scratch on a text prompt: a /completion request that sets only the prompt
    (and 5 probabilities), on a server started with `flags` (--seed 1 and -n 32 unless given), in the
    loop shape of `source` or `build` (default: the newest)."""
    if build is None and source is None:
        shape = Shape(NEWEST, None, "the newest shape (no --build or --source)")
    else:
        shape = shape_for(build=build, source=source)
    flags = {**PROMPT_DEFAULTS, **(flags or {})}
    ids = target.tokenize(prompt, add_special=True, parse_special=True)
    spec = resolve("speculative", flags=flags)
    ctx = resolve("context", flags=flags)
    draft_model = (drafts or Drafts()).get(spec.draft_model) if drafts_with_model(spec, shape.era) else None
    settings = effective("/completion", {"prompt": prompt, "n_probs": 5},
                         server_sampling(flags=flags, model_meta=target.meta))
    return run_loop(target, ids, settings, spec, ctx, shape=shape, draft_model=draft_model, n_probs=5)


def trace(transcript: str | Path | dict | list, model: str | Path, *, flags: Mapping[str, Any] | None = None,
          request: dict | None = None, build: int | None = None, source: Path | None = None,
          renamed: bool = False) -> list[TraceResult]:
    """Trace every record of a transcript (a path, or an already-parsed object), in order, as requests to
    one server. `flags` are the server's flags as llama-server spells them ({"-md": "draft.gguf",
    "--spec-type": "draft-simple", "--spec-draft-n-max": 8}; settings attrs too): set aside with a warning
    where they change nothing trace computes, SettingsError where trace cannot reproduce them or
    llama-server has no such flag (settings/server_flags.py). Computes with the libllama loaded in this
    process (runtime/binding.py).

        >>> from replay.paths import FIXTURES
        >>> [r.reproduced for r in trace(FIXTURES / "transcripts" / "tiny-draft-simple.json", FIXTURES / "tiny-target.gguf",
        ...                              flags={"-md": FIXTURES / "tiny-draft.gguf"})]
        [True]
    """
    import json
    import warnings

    from replay.commands.trace_state import ServerState
    from replay.runtime.llama import model_params
    from replay.settings.server_flags import from_mapping
    from replay.transcripts.readers import read_file, read_text
    attrs, notes = from_mapping({k: str(v) if isinstance(v, Path) else v for k, v in (flags or {}).items()}, "trace")
    for note in notes:
        warnings.warn(note, stacklevel=2)
    records = read_text(json.dumps(transcript), "<object>", request) if isinstance(transcript, (dict, list)) \
        else read_file(transcript, request)
    target = Model(check_gguf(model), **model_params(attrs))
    drafts = Drafts(model_params(attrs))
    shared = shared_evidence(records, attrs.get("n_parallel"), False)
    with ServerState(attrs.get("n_parallel")) as state:
        return [trace_record(rec, target, flags=attrs, build=build, source=source, slot_state=state.slot(rec),
                             drafts=drafts, renamed=renamed, shared=shared.get(rec.index)) for rec in records]
