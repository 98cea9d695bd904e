"""Recover the real probabilities of recorded transcripts (the main job).

    transcript file -> Records (readers) -> token plan (tokens) -> target evaluation
    with the server's schedule (evaluate) -> per-token comparison (this module)
    -> repaired records in the same shape (repair) and a report (report)

`recover()` is the Python API; the `recover` and `diff` commands are thin
wrappers over it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelError, SpecReplayError, TranscriptError
from .evaluate import Gap, PieceIndex, Truth, Unaligned, truths
from .llama import Context, Model
from .prefix import plan_prefix
from .probs import drafted, n_generated, n_prompt_cached
from .readers import Record, read_source, read_text
from .sampling import SamplingParams, requested_n_probs
from .tokens import Ref, build_plan

DEFAULT_TOLERANCE = 5e-4
# A speculating server computes its few real entries after the first token on a KV cache built by
# verify batches, not one token per decode: on CPU the values then drift from the one-per-decode
# truth (measured on SmolLM2: 8.5e-5 on the token over 4,000 tokens from a short prompt; 0.063 on
# the last token after a 1,284-token prompt; up to 0.25 on low-probability alternatives). Such an
# entry is accepted up to this bound, with its difference in the report, and kept as the server sent it.
SPEC_KV_DRIFT = 0.3
STATUSES = ("ok", "placeholder", "missing", "mismatch", "unaligned")


@dataclass
class TokenReport:
    index: int
    id: int | None
    piece: str
    server_logprob: float | None  # natural log; null where the server sent nothing
    true_logprob: float | None
    status: str
    true_top: list[dict]
    note: str = ""

    def to_json(self) -> dict:
        return {"index": self.index, "id": self.id, "piece": self.piece, "server_logprob": self.server_logprob,
                "true_logprob": self.true_logprob, "status": self.status, "true_top": self.true_top,
                **({"note": self.note} if self.note else {})}


@dataclass
class RecordReport:
    source: str
    record: int
    endpoint: str
    stream: bool
    field_kind: str  # "logprob" (pre-sampling) or "prob" (post_sampling_probs), as the server sent them
    n_probs: int
    tokens: list[TokenReport] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)  # gaps that no token row can show
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # KV positions kept from the previous record (prefix.plan_prefix)
    prefix: str = "fresh"  # how: "fresh", "shared prefix", "server cache" or "server cache (rebuilt)"

    def summary(self) -> dict[str, Any]:
        counts = {s: 0 for s in STATUSES}
        for t in self.tokens:
            counts[t.status] += 1
        true = [t.true_logprob for t in self.tokens if t.true_logprob is not None]
        server = [t.server_logprob for t in self.tokens if t.server_logprob is not None]
        real = [abs(t.server_logprob - t.true_logprob) for t in self.tokens
                if t.status in ("ok", "mismatch") and t.server_logprob is not None and t.true_logprob is not None]
        mean = lambda xs: (sum(xs) / len(xs)) if xs else None
        mt = mean(true)
        return {
            "tokens": len(self.tokens), "counts": counts,
            "server_mean_logprob": mean(server), "true_mean_logprob": mt,
            "true_perplexity": math.exp(-mt) if mt is not None else None,
            "max_abs_diff_real": max(real) if real else None,
            "field_kind": self.field_kind,
        }

    @property
    def recovered(self) -> bool:
        return self.error is None and all(t.status in ("ok", "placeholder", "missing") for t in self.tokens)

    def to_json(self) -> dict:
        d = {"source": self.source, "record": self.record, "endpoint": self.endpoint, "stream": self.stream,
             "field_kind": self.field_kind, "n_probs": self.n_probs, "prompt_tokens": self.prompt_tokens,
             "reused_prompt_tokens": self.reused_prompt_tokens, "prefix": self.prefix,
             "tokens": [t.to_json() for t in self.tokens], "summary": self.summary()}
        if self.error:
            d["error"] = self.error
        if self.notes:
            d["notes"] = self.notes
        return d


@dataclass
class ContextOptions:
    """The server's context settings that change numerics (its -c, -b, -ub, -fa, -ctk/-ctv, -t)."""

    n_ctx: int | None = None  # default: the slot n_ctx in the transcript's /props, else 2048
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"
    threads: int = 2
    chunk: int = 1  # generated tokens per decode call: 1 = the server's schedule (see evaluate.py)
    reuse_prefix: bool = True  # keep KV of a prompt prefix shared with the previous record, where exact


def _tops_agree(server: list[tuple[int, float]], true: list[tuple[int, float]], tol: float) -> bool:
    """Do the server's top-N alternatives come from the same model? The same ids in the same
    order with logprobs within `tol`; or, where they differ (the server computed its real
    entries from speculative verify batches, whose KV drifts from a one-token-per-decode
    schedule past the first 256-cell window: up to ~0.25 nats on low-probability
    alternatives), the same id set up to one entry at the boundary."""
    if len(server) != len(true):
        return False
    if all(si == ti and (abs(slp - tlp) <= tol if math.isfinite(slp) and math.isfinite(tlp) else slp == tlp)
           for (si, slp), (ti, tlp) in zip(server, true)):
        return True
    s_ids, t_ids = {i for i, _ in server}, {i for i, _ in true}
    return len(s_ids & t_ids) >= len(true) - 1


def _n_ctx_of(rec: Record, opts: ContextOptions) -> int:
    if opts.n_ctx:
        return opts.n_ctx
    c = rec.container if isinstance(rec.container, dict) else {}
    props = ((c.get("server") or {}).get("props") or {}) if isinstance(c, dict) else {}
    n = (props.get("default_generation_settings") or {}).get("n_ctx")
    return int(n) if isinstance(n, int) and n > 0 else 2048


class Recoverer:
    """Holds the target model and one context; recovers records one after another."""

    def __init__(self, model: Model | str | Path, opts: ContextOptions | None = None, tolerance: float = DEFAULT_TOLERANCE):
        self.model = model if isinstance(model, Model) else Model(model)
        self.opts = opts or ContextOptions()
        self.tolerance = tolerance
        self._ctx: Context | None = None
        self._pieces: PieceIndex | None = None
        self._exact_upto = 0  # KV positions the previous record left as the server computed them
        self._piece_cache: dict[int, bytes] = {}

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None

    def piece(self, tid: int) -> bytes:
        if not (0 <= tid < self.model.n_vocab):
            raise ModelError(f"token id {tid} is outside this model's vocabulary ({self.model.n_vocab} tokens): "
                             f"the transcript comes from another model than {self.model.path.name}")
        b = self._piece_cache.get(tid)
        if b is None:
            b = self._piece_cache[tid] = self.model.piece(tid, special=True)
        return b

    def pieces(self) -> PieceIndex:
        if self._pieces is None:
            self._pieces = PieceIndex(self.model)
        return self._pieces

    def context(self, n_ctx: int) -> Context:
        if self._ctx is None or self._ctx.n_ctx != n_ctx:
            self.close()
            o = self.opts
            self._ctx = Context(self.model, n_ctx=n_ctx, n_batch=min(o.n_batch, n_ctx), n_ubatch=o.n_ubatch,
                                n_threads=o.threads, flash_attn=o.flash_attn, type_k=o.type_k, type_v=o.type_v)
        return self._ctx

    def prompt_ids(self, rec: Record) -> list[int]:
        from .prompt import prompt_ids
        return prompt_ids(rec, self.model)

    def check_vocab(self, rec: Record, plan) -> None:
        """Refuse a transcript from another model: its real entries' top pieces must be this model's pieces."""
        checked = 0
        for item in plan:
            ref = getattr(item, "ref", None)
            e = getattr(ref, "entry", None)
            if not e:
                continue
            for t in (e.get("top_logprobs") or e.get("top_probs") or []):
                tid, b = t.get("id"), t.get("bytes")
                if isinstance(tid, int) and isinstance(b, list):
                    # the server renders control tokens as nothing unless started with --special
                    if bytes(b) != self.piece(tid) and not (not b and not self.model.piece(tid, special=False)):
                        raise ModelError(f"token {tid} is {bytes(b)!r} in the transcript but "
                                         f"{self.piece(tid)!r} in {self.model.path.name}: the transcript comes "
                                         "from another model")
                    checked += 1
                if checked >= 64:
                    return

    def recover(self, rec: Record) -> RecordReport:
        """Recover one record; every error names the file and record."""
        try:
            return self._recover(rec)
        except ModelError as e:
            msg = str(e)
            raise ModelError(msg if msg.startswith(rec.where) else f"{rec.where}: {msg}") from None
        except TranscriptError as e:
            if e.source is not None:
                raise
            raise TranscriptError(str(e), source=rec.source, record=rec.index) from None
        except SpecReplayError as e:  # e.g. a decode failure
            raise type(e)(f"{rec.where}: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError) as e:
            # a field of an unexpected type that validation did not catch: still one clear line
            raise TranscriptError(f"unreadable value in the transcript ({type(e).__name__}: {e})",
                                  source=rec.source, record=rec.index) from None

    def _recover(self, rec: Record) -> RecordReport:
        post = bool(rec.request.get("post_sampling_probs"))
        n_probs = requested_n_probs(rec.endpoint, rec.request)
        rep = RecordReport(rec.source, rec.index, rec.endpoint, rec.stream, "prob" if post else "logprob", n_probs)
        try:
            params = SamplingParams.from_request(rec.endpoint, rec.request)
        except (TypeError, ValueError, KeyError, OverflowError) as e:
            raise TranscriptError(f"unreadable sampling parameters ({e})", source=rec.source, record=rec.index) from None
        plan = build_plan(rec, self.piece)
        self.check_vocab(rec, plan)
        prompt = self.prompt_ids(rec)
        for t in prompt:
            self.piece(t)  # vocabulary range check
        ctx = self.context(_n_ctx_of(rec, self.opts))
        final = rec.final()
        prefix = plan_prefix(ctx.kv_tokens, self._exact_upto, prompt, n_prompt_cached(final), ctx.n_batch,
                             ctx.n_ubatch, reuse=self.opts.reuse_prefix)
        if prefix.note:
            rep.notes.append(prefix.note)
        speculative = bool(drafted(final)) or bool((rec.speculative or {}).get("types"))
        self._exact_upto = 0  # until this record's evaluation completes
        pending: list[Truth] = []  # tokens of a Gap that replaces an id-less entry, until the gap ends

        def flush() -> None:
            # the entry's bytes end with its own token's piece: it belongs to the gap's LAST token;
            # the earlier ones had no entry and are inserted before it
            for k, tr in enumerate(pending):
                ref = tr.item.ref
                entry = ref.entry if k == len(pending) - 1 else None
                if entry is None and ref.before is None:
                    ref.before = ref.entry
                rep.tokens.append(self._compare(tr, entry, post, n_probs, speculative))
                self._write_back(rec, tr, ref, entry, post, rep.tokens[-1])
            pending.clear()

        try:
            for truth in truths(self.model, ctx, prompt, plan, params, n_probs, post=post,
                                chunk=self.opts.chunk, keep=prefix.keep, rebuild=prefix.rebuild,
                                pieces=self.pieces() if any(isinstance(i, Gap) for i in plan) else None):
                if pending and truth.item is not pending[-1].item:
                    flush()
                ref: Ref | None = getattr(truth.item, "ref", None)
                if isinstance(truth.item, Gap) and ref is not None and ref.entry is not None:
                    pending.append(truth)
                    continue
                entry = ref.entry if ref is not None and not isinstance(truth.item, Gap) else None
                rep.tokens.append(self._compare(truth, entry, post, n_probs, speculative))
                self._write_back(rec, truth, ref, entry, post, rep.tokens[-1])
            flush()
        except Unaligned as e:
            rep.error = str(e)
            rep.tokens.append(TokenReport(e.index, None, "", None, None, "unaligned", [], note=str(e)))
        rep.prompt_tokens, rep.reused_prompt_tokens, rep.prefix = len(prompt), prefix.keep, prefix.how
        # what the next record may keep: the prompt, and the generated tokens too when both we and the
        # server decoded them one per decode (a speculating server decoded them in verify batches)
        one_by_one = drafted(final) is False and self.opts.chunk == 1
        self._exact_upto = len(ctx.kv_tokens) if one_by_one and rep.error is None else len(prompt)
        generated = n_generated(rec.endpoint, final)
        if rep.error is None and generated is not None and generated > len(rep.tokens):
            rep.notes.append(f"the server generated {generated} tokens but its response shows {len(rep.tokens)}: "
                             f"the last {generated - len(rep.tokens)} were never sent (a trimmed stop word, or "
                             "text ending in incomplete UTF-8) and cannot be recovered")
        return rep

    # --- comparison ---------------------------------------------------------

    def _compare(self, t: Truth, entry: dict | None, post: bool, n_probs: int,
                 speculative: bool = False) -> TokenReport:
        if post:
            true_lp = math.log(t.post_prob) if t.post_prob else float("-inf")
            true_top = [(i, math.log(p)) for i, p in (t.post_top or [])]
        else:
            true_lp, true_top = t.logprob, t.top
        top_json = [{"id": i, "piece": self._text(i), "logprob": lp} for i, lp in true_top]
        piece = self._text(t.id)
        if entry is None:
            ref = getattr(t.item, "ref", None)
            note = (t.item.reason if isinstance(t.item, Gap)
                    else (getattr(ref, "reason", "") or "the server sent no entry for this token"))
            return TokenReport(t.index, t.id, piece, None, _finite(true_lp), "missing", top_json, note=note)
        server_lp, server_top = _server_values(entry)
        if server_lp == 0.0 and not server_top and n_probs > 0:
            return TokenReport(t.index, t.id, piece, 0.0, _finite(true_lp), "placeholder", top_json)
        same_ids = _tops_agree(server_top, true_top[:len(server_top)], self.tolerance) and \
            len(server_top) == min(len(true_top), n_probs)
        diff = abs(server_lp - true_lp) if math.isfinite(server_lp) and math.isfinite(true_lp) else (0.0 if server_lp == true_lp else math.inf)
        status = "ok" if diff <= self.tolerance and same_ids else "mismatch"
        note = "" if status == "ok" else (f"|diff| {diff:.2e}" + ("" if same_ids else "; top ids differ"))
        if status == "mismatch" and speculative and t.index > 0 and same_ids and diff <= SPEC_KV_DRIFT:
            status = "ok"
            note = (f"|diff| {diff:.2e}: the speculating server computed this entry on a KV cache built by "
                    "verify batches (kept as sent)")
        return TokenReport(t.index, t.id, piece, server_lp, _finite(true_lp), status, top_json, note=note)

    def _text(self, tid: int) -> str:
        return self.piece(tid).decode("utf-8", "replace")

    # --- repair -------------------------------------------------------------

    def _write_back(self, rec: Record, t: Truth, ref: Ref | None, entry: dict | None, post: bool,
                    tr: TokenReport) -> None:
        """Put the true values where the server should have: into its entry, or a new one."""
        if ref is None or ref.report_only:
            return  # trimmed entries stay trimmed
        if tr.status in ("ok", "mismatch"):
            ref.last_written = entry  # real values the server sent stay as they were
            return
        from .repair import fill_entry, new_entry
        values = (t.post_prob or 0.0, t.post_top or []) if post else (t.logprob, t.top)
        if entry is not None:
            fill_entry(entry, values, post, self.piece)
            ref.last_written = entry
            return
        home = ref.home
        if home is None:
            from .tokens import home_for_chunk
            home = ref.home = home_for_chunk(rec, ref.chunk)
        e = new_entry(t.id, values, post, self.piece)
        anchor = getattr(ref, "last_written", None)
        if anchor is not None and any(x is anchor for x in home):
            pos = next(k for k, x in enumerate(home) if x is anchor) + 1  # after the previous token of this gap
        elif ref.before is not None and any(x is ref.before for x in home):
            pos = next(k for k, x in enumerate(home) if x is ref.before)
        else:
            pos = len(home)
        home.insert(pos, e)
        ref.last_written = e


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _server_values(e: dict) -> tuple[float, list[tuple[int | None, float]]]:
    if "prob" in e:
        p = float(e["prob"])
        lp = math.log(p) if p > 0 else float("-inf")
        top = [(x.get("id"), math.log(x["prob"]) if x.get("prob", 0) > 0 else float("-inf")) for x in e.get("top_probs") or []]
        return lp, top
    lp = e.get("logprob")
    top = [(x.get("id"), float(x["logprob"])) for x in e.get("top_logprobs") or [] if x.get("logprob") is not None]
    return (float(lp) if lp is not None else float("-inf")), top


@dataclass
class RecoverResult:
    """What `recover()` returns: one report per record, and the repaired file text."""

    records: list[RecordReport]
    repaired: str

    @property
    def ok(self) -> bool:
        return all(r.recovered for r in self.records)

    def summary(self) -> dict[str, Any]:
        counts = {s: 0 for s in STATUSES}
        for r in self.records:
            for k, v in r.summary()["counts"].items():
                counts[k] += v
        diffs = [r.summary()["max_abs_diff_real"] for r in self.records]
        diffs = [d for d in diffs if d is not None]
        return {"records": len(self.records), "counts": counts, "max_abs_diff_real": max(diffs) if diffs else None,
                "prompt_tokens": sum(r.prompt_tokens for r in self.records),
                "reused_prompt_tokens": sum(r.reused_prompt_tokens for r in self.records)}

    def to_json(self) -> dict:
        return {"records": [r.to_json() for r in self.records], "summary": self.summary()}

    def failure(self) -> str | None:
        """One line saying why not everything was recovered, or None."""
        for r in self.records:
            if r.error:
                return f"{r.source}, record {r.record}: {r.error}"
        bad = [(r, t) for r in self.records for t in r.tokens if t.status in ("mismatch", "unaligned")]
        if bad:
            r, t = bad[0]
            why = "the replay does not match this server's numerics (model file, build, or context settings)"
            if r.prefix == "server cache":
                why = (f"this record's values depend on the server's prompt cache ({r.reused_prompt_tokens} tokens), "
                       "rebuilt from the previous record: keep the file in request order, one server slot")
            elif r.prefix == "server cache (rebuilt)":
                why = ("the server took part of this prompt from a cache left by a request that is not in this file, "
                       "and evaluating those tokens on their own did not rebuild it (see the note); --tolerance 0.3 "
                       "accepts the difference and keeps the server's real values as sent")
            return (f"{len(bad)} token(s) disagree with real values the server sent (first: {r.source}, record "
                    f"{r.record}, token {t.index}, {t.note}); {why}")
        return None


def recover(source: str | Path | dict | list, model: Model | str | Path, *, request: dict | None = None,
            tolerance: float = DEFAULT_TOLERANCE, context: ContextOptions | None = None,
            progress=None, skip: int = 0, on_record=None) -> RecoverResult:
    """Recover true probabilities for every record of a transcript.

    `source` is a path, or an already-parsed object (a transcript, a
    {"request", "response"} pair, or a bare response with `request`). Returns
    the per-token report and the repaired text in the source's own shape.

        >>> res = recover("run.json", model="SmolLM2-135M-Instruct.Q4_1.gguf")
        >>> res.records[0].summary()["counts"]
        {'ok': 1, 'placeholder': 38, 'missing': 0, 'mismatch': 0, 'unaligned': 0}

    `skip` leaves the first records out (finished by an earlier, interrupted run);
    `on_record(record, report)` is called after each record and may return False to stop.
    """
    import json as _json
    if isinstance(source, (dict, list)):
        original = _json.dumps(source)
        records = read_text(original, "<object>", request)
    else:
        original = read_source(source)
        records = read_text(original, str(source), request)
    return recover_records(records, original, model, tolerance=tolerance, context=context, progress=progress,
                           skip=skip, on_record=on_record)


def recover_records(records: list[Record], original: str, model: Model | str | Path, *,
                    tolerance: float = DEFAULT_TOLERANCE, context: ContextOptions | None = None,
                    progress=None, skip: int = 0, on_record=None) -> RecoverResult:
    """`recover` for records already read from `original` (the file's text)."""
    from .repair import serialise
    rec_model = model if isinstance(model, Model) else Model(model)
    r = Recoverer(rec_model, context, tolerance)
    reports = []
    try:
        for k, rec in enumerate(records):
            if k < skip:
                continue
            reports.append(r.recover(rec))
            if progress is not None:
                progress(k + 1, len(records))
            if on_record is not None and on_record(rec, reports[-1]) is False:
                break
    finally:
        r.close()
    return RecoverResult(reports, serialise(records, original) if not skip and on_record is None else "")
