"""One record read once, for every command that replays it (recover, diff, trace).

The order is the order a user meets the errors in: what the record says of the server's handling
(transcripts/request.py asked), the loop shape of its build, the request as the server parsed it
(tokens/server_view.py), its sampling settings (a flag or field the command cannot reproduce is refused
here), the model's identity, the generated tokens' plan and their vocabulary, the prompt ids. Nothing
here decodes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from replay.builds.loop_shapes import Shape, shape_for
from replay.errors import ModelError
from replay.reading.identity import Compared, ModelFacts, check_vocabulary, compare_model, located_draft, mismatch
from replay.reading.settings import request_settings
from replay.runtime.llama import Model
from replay.settings import ContextConfig, SpecConfig, resolve
from replay.settings.table import SPEC_TYPES
from replay.settings.sampling import Effective
from replay.tokens.prompt_ids import prompt_ids, server_tokens
from replay.tokens.server_view import server_view
from replay.transcripts.entries import drafted, n_prompt_cached
from replay.transcripts.plan import Plan, build_plan
from replay.transcripts.readers import Record
from replay.transcripts.request import asked

Piece = Callable[[int], bytes]


@dataclass(frozen=True)
class ReadRecord:
    """One record as the replay reads it (read_record), for the stages after it."""

    rec: Record
    post: bool  # the server sent post-sampling probabilities
    settings: Effective  # what it sampled with, and where each value came from
    shape: Shape  # the loop shape of the server's build
    plan: Plan  # the generated tokens: known ids, gaps to align
    prompt: tuple[int, ...]
    notes: tuple[str, ...]
    context: ContextConfig  # the server's context flags
    spec: SpecConfig  # the server's speculative flags
    final: dict | None  # the final response object (a stream's last event)
    speculative: bool  # the server ran its speculative loop
    slots: int | None  # the server's slot count (None: not known)
    shared: str | None  # why the server's batches may have been shared with other requests, or None
    identity: tuple[Compared, ...] = ()  # the transcript's evidence on the model, compared with -m

    @property
    def n_probs(self) -> int:
        return self.settings.params.n_probs

    @property
    def cached(self) -> int | None:
        """The prompt tokens the server took from its cache (timings.cache_n)."""
        return n_prompt_cached(self.final)

    @property
    def timings(self) -> dict | None:
        """The server's timings object, where it sent one."""
        t = (self.final or {}).get("timings")
        return t if isinstance(t, dict) else None

    @property
    def draft_totals(self) -> dict | None:
        """The server's draft_n and draft_n_accepted (its timings), None where it sent no timings."""
        timings = (self.final or {}).get("timings")
        if not isinstance(timings, dict):
            return None
        return {"draft_n": timings.get("draft_n", 0), "draft_n_accepted": timings.get("draft_n_accepted", 0)}


def read_record(rec: Record, model: Model, flags: Mapping[str, Any], *, command: str = "recover",
                build: int | None = None, source: Path | None = None, renamed: bool = False, build_why: str | None = None,
                facts: ModelFacts | None = None, piece: Piece | None = None, shared: str | None = None) -> ReadRecord:
    """Read `rec` against `model` with the server flags given on the command line (`flags`, settings
    attrs, over the transcript's). `build`/`source` (--build/--source) pick the loop shape over its
    build_info; `renamed` (--renamed-model) sets the model's name aside; `shared` is the evidence, from
    the whole file, that its batches were shared (transcripts/readers.py shared_evidence), else the
    record's own. Errors: TranscriptError (cannot be replayed), ModelError (another model)."""
    piece = piece or (lambda t: model.piece(t, special=True))
    said = asked(rec)
    shape = shape_for(build=build, source=source, build_info=rec.server_build, build_why=build_why)
    view = server_view(rec, said, model.path, flags, lambda p: server_tokens(model, p), model.chat_template())
    settings = request_settings(rec, said, flags=flags, model_meta=model.meta, command=command,
                                rebuilt=view.rebuilt if view else None)
    plan = build_plan(rec, piece, settings.stop)
    identity = tuple(compare_model(rec, facts or ModelFacts.of(model), renamed=renamed))
    wrong = mismatch(list(identity), "-m")
    if wrong:
        raise ModelError(wrong)
    check_vocabulary(rec, plan, n_vocab=model.n_vocab, file=model.path.name, piece=piece,
                     plain=lambda t: model.piece(t, special=False))
    prompt = prompt_ids(rec, model, view)
    final = rec.final()
    notes = list(settings.notes) + ([f"prompt and grammar as the server built them: {view.source}"]
                                    if view is not None else [])
    spec = echoed_types(resolve("speculative", flags=dict(flags), recorded=rec.flags, props=rec.props), final)
    spec = draft_here(spec, rec, model.path)
    return ReadRecord(
        rec=rec, post=bool(rec.request.get("post_sampling_probs")), settings=settings, shape=shape, plan=plan,
        prompt=tuple(prompt), notes=tuple(notes),
        context=resolve("context", flags=dict(flags), recorded=rec.flags, props=rec.props), spec=spec, final=final,
        speculative=bool(drafted(final)) or speculating_types((rec.flags or {}).get("--spec-type")),
        slots=rec.slots(flags.get("n_parallel")), shared=shared or rec.busy_when_sent(),
        identity=identity)


def draft_here(spec: SpecConfig, rec: Record, model: Path) -> SpecConfig:
    """`spec` with the transcript's draft model where it is on this machine (reading/identity.py
    located_draft: from the transcript's folder, next to it, or next to -m), its source saying so
    ("server.flags: fixtures/tiny-draft.gguf, found next to -m"); as it was where -md was given or nothing
    is found (the draft's loading then asks for -md)."""
    if not spec.draft_model or spec.sources.get("draft_model") == "command line":
        return spec
    found = located_draft(str(spec.draft_model), rec.source, model)
    if found is None:
        return spec
    path, where = found
    source = f"{spec.sources.get('draft_model', 'server.flags')}: {spec.draft_model}, found {where}"
    return dataclasses.replace(spec, draft_model=path, sources={**spec.sources, "draft_model": source})


def echoed_types(spec: SpecConfig, final: dict | None) -> SpecConfig:
    """`spec` with the speculative types the response echoes where nothing else gave them: /completion's
    `generation_settings` carries the slot's "speculative.types" (tools/server/server-task.cpp:140, the
    params' to_json), the server's own --spec-type, which /props reports as "none" whatever it runs.

    >>> echoed_types(SpecConfig(sources={"spec_types": "default"}),
    ...              {"generation_settings": {"speculative.types": "none,ngram-mod"}}).spec_types
    ('ngram-mod',)
    """
    said = ((final or {}).get("generation_settings") or {}).get("speculative.types")
    if spec.sources.get("spec_types", "default") != "default" or not isinstance(said, str):
        return spec
    types = tuple(t.strip() for t in said.split(",") if t.strip() not in ("", "none"))
    if not types or any(t not in SPEC_TYPES for t in types):
        return spec
    return dataclasses.replace(spec, spec_types=types,
                               sources={**spec.sources, "spec_types": "generation_settings"})


def speculating_types(value) -> bool:
    """Does a recorded `--spec-type` (a list, or one comma-separated string, as llama-server takes it:
    common/arg.cpp --spec-type) name a speculative type? `none` is no speculation.

    >>> speculating_types(["none"]), speculating_types("none"), speculating_types(None)
    (False, False, False)
    >>> speculating_types(["ngram-mod", "draft-simple"]), speculating_types("none,ngram-mod")
    (True, True)
    """
    if not value:
        return False
    names = value.split(",") if isinstance(value, str) else [n for v in value for n in str(v).split(",")]
    return any(n.strip() not in ("", "none") for n in names)
