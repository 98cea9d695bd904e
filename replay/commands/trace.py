"""Trace a recorded request (or a fresh prompt) through the server's loop and check it.

    trace_record(rec, target, ...) -> TraceResult     the loop with the transcript's settings,
                                                      compared with what it recorded: token ids where
                                                      known, else text (chunk by chunk for streams)
    trace_prompt(target, prompt, ...) -> TraceResult  the loop from scratch

What the trace is compared with, and why it parts, is comparison/trace.py.

The server's flags resolve from ours, the transcript and its /props (settings/config.py), the
sampling settings layer by layer (settings/sampling.py, reading/settings.py); the loop's
shape (builds/loop_shapes.py) from `--source DIR`, `--build N` or the transcript's build_info. A divergence is explained by
comparison/divergence.py. A run over a file starts at the front door (run/trace.py: `trace`, the API).
"""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Any

from replay.builds.loop_shapes import NEWEST, Shape, shape_for
from replay.comparison.trace import (
    TraceResult,
    compare_with_plan,
    drafts_differ,
    drafts_shared,
    explain as why_parted,
    recorded_candidates,
)
from replay.errors import ModelError, located
from replay.loop.loop import SpeculativeLoop
from replay.loop.request import Request
from replay.loop.replayable import drafts_with_model
from replay.loop.state import SlotState
from replay.loop.work import Work, since
from replay.reading.identity import compare_draft, mismatch
from replay.reading.record import ReadRecord, read_record
from replay.runtime.gguf import check_gguf
from replay.runtime.llama import Model
from replay.schedule.memory import SlotConfig, schedule_of
from replay.schedule.prompt import MessageSpans
from replay.settings import resolve
from replay.settings.sampling import effective, server_sampling
from replay.tokens.prompt_ids import message_spans
from replay.transcripts.plan import Known, Plan
from replay.transcripts.readers import Record


def run_loop(target: Model, request: Request, slot_config: SlotConfig, *, shape: Shape, draft_model: Model | None,
             recorded: Plan | None = None, timings: dict | None = None, slot_state: SlotState | None = None,
             stream: bool = False) -> TraceResult:
    """Run the loop for one request. `recorded` (the transcript's plan) is compared with what the loop
    emits (compare_with_plan)."""
    loop = SpeculativeLoop(target, request, era=shape.era, slot_config=slot_config, draft_model=draft_model,
                           slot_state=slot_state)
    contexts = {"target": loop.ctx, "draft": loop.memory.draft}
    before = {k: (c.n_decodes, c.n_rows) for k, c in contexts.items() if c is not None}
    try:
        steps: list = []
        gen0 = None  # the counters when the generation phase began (loop/work.py)
        for step in loop.steps():
            steps.append(step)
            if gen0 is None:
                gen0 = {k: dict(c.batches) for k, c in contexts.items() if c is not None}, loop.chain.passes
        schedule = schedule_of(loop.memory, request.spans)
        decodes = {k: (contexts[k].n_decodes - n, contexts[k].n_rows - r) for k, (n, r) in before.items()}
        work = Work(since(gen0[0]["target"], loop.ctx.batches),
                    since(gen0[0].get("draft", {}), contexts["draft"].batches) if contexts["draft"] is not None else {},
                    loop.chain.passes - gen0[1], loop.draft_samples(), len(loop.emitted))
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
                       post=bool(request.settings.params.post_sampling_probs), notes=list(loop.notes), shape=shape,
                       spec=request.spec, settings=request.settings, compared=compared, schedule=schedule,
                       decodes=decodes, work=work, prefix=loop.prefix)


PROMPT_DEFAULTS = {"seed": 1, "n_predict": 32}  # trace --prompt without --seed / -n


class Drafts:
    """Draft models by path, loaded once for a run over many records."""

    def __init__(self, params: dict | None = None) -> None:
        self._models: dict[str, Model] = {}
        self._loading: dict[str, cf.Future] = {}
        self.params = dict(params or {})  # Model's load arguments: the server's (runtime/llama.py model_params)

    def prefetch(self, path: str) -> None:
        """Start loading `path` on a thread of its own, beside what the caller loads meanwhile (the target):
        a load runs in libllama with the GIL released, most of it one core building the vocabulary (0.35 s
        of a 262k one). `get` takes it, or raises what loading it raised."""
        if path not in self._models and path not in self._loading:
            pool = cf.ThreadPoolExecutor(1, thread_name_prefix="draft-load")
            self._loading[path] = pool.submit(self._load, path)
            pool.shutdown(wait=False)

    def _load(self, path: str) -> Model:
        return Model(check_gguf(path), **self.params)

    def get(self, path: str) -> Model:
        if path not in self._models:
            loading = self._loading.pop(path, None)
            self._models[path] = loading.result() if loading is not None else self._load(path)
        return self._models[path]


def _draft(drafts: Drafts, spec: Any, rec: Record, renamed: bool) -> Model:
    """The draft model: -md, else the transcript's --spec-draft-model (a path on the server's machine, so
    one line saying to give -md where it is not a file here); -md is compared with the recorded name."""
    if spec.sources.get("draft_model") == "command line":
        wrong = mismatch(compare_draft(rec, Path(spec.draft_model).name, renamed=renamed), "-md")
        if wrong:
            raise ModelError(wrong)
    return draft_model_of(drafts, spec)


def draft_model_of(drafts: Drafts, spec: Any) -> Model:
    """spec's draft model, loaded once; where the transcript named it and it is not here (reading/record.py
    draft_here looked next to the transcript and -m), one line asking for -md."""
    try:
        return drafts.get(spec.draft_model)
    except ModelError as e:
        if spec.sources.get("draft_model") == "command line":
            raise
        raise ModelError(f"{e} (the transcript's --spec-draft-model, a path on the server's machine, is not next to "
                         "the transcript or -m either): give the draft model file with -md PATH") from None


# --- the two entry points ----------------------------------------------------------------

def trace_record(rec: Record, target: Model, *, flags: dict | None = None, build: int | None = None,
                 source: Path | None = None, slot_state: SlotState | None = None,
                 drafts: Drafts | None = None, renamed: bool = False, shared: str | None = None) -> TraceResult:
    """Trace one recorded request with its settings (flags given here win over the transcript's), in
    the loop shape of `source` (a llama.cpp checkout), else of build `build`, else of the transcript's
    build_info. Pass the same `slot_state` for consecutive requests to one slot (trace_state.ServerState), and `shared`, the
    evidence that the record's batches were shared with other requests' (transcripts/readers.py shared_evidence
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
    return trace_read(read, target, slot_state=slot_state, drafts=drafts, renamed=renamed)


def trace_read(read: ReadRecord, target: Model, *, slot_state: SlotState | None = None, drafts: Drafts | None = None,
               renamed: bool = False, spans: MessageSpans | None = None, expect: bool = False,
               explain: bool = True) -> TraceResult:
    """The loop over a record already read (reading/record.py read_record), compared with it. `spans`: the
    prompt's message spans, where the caller has them (tune replays one read under many speculative settings,
    each a copy of the read with its `spec` replaced); `expect` as in loop.Request. `explain` False: where the
    loop parts from the transcript, say where but not why (recover asks only whether it parts)."""
    rec, spec, settings = read.rec, read.spec, read.settings
    draft_model = _draft(drafts or Drafts(), spec, rec, renamed) if drafts_with_model(spec, read.shape.era) else None
    request = Request(read.prompt, settings, spec, settings.params.n_probs or 5,
                      message_spans(rec, target, list(read.prompt)) if spans is None else spans, read.cached,
                      expect=expect, evidence=explain)
    res = run_loop(target, request, SlotConfig.of(read.context, rec.flags, read.shape.build, read.spec), shape=read.shape,
                   draft_model=draft_model, recorded=read.plan, timings=read.draft_totals, slot_state=slot_state,
                   stream=rec.stream)
    res.notes += list(settings.notes)
    if not [t for t in spec.spec_types if t != "none"] and res.server_draft_n:
        res.notes.append(f"the server drafted {res.server_draft_n} tokens, so it did speculate: pass its --spec-type")
    if res.first_divergence is not None:
        if explain:
            res.server_candidates = recorded_candidates(rec, res.first_divergence)
            res.explanation = why_parted(res, rec, settings, read.slots)
    elif res.reproduced is False:
        drafter = "draft model" if draft_model is not None else "MTP heads" if "draft-mtp" in spec.spec_types else None
        if drafter and read.shared:
            res.explanation = drafts_shared(res, read.shared, drafter)
        else:
            res.notes.append(drafts_differ(res, drafter, rec.several_slots()))
    return res


def trace_prompt(target: Model, prompt: str, *, flags: dict | None = None, build: int | None = None,
                 source: Path | None = None, drafts: Drafts | None = None, expect: bool = False) -> TraceResult:
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
    return run_loop(target, Request(tuple(ids), settings, spec, 5, expect=expect), SlotConfig.of(ctx, None, shape.build, spec),
                    shape=shape, draft_model=draft_model)
