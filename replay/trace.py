"""llama-server's speculative loop (b11434), step by step, reproduced in-process.

One request on a fresh single-slot server (`-np 1`), as tools/server/server-context.cpp
runs it (SERVER_LOOP.md sections 3.2-3.8):

    prompt     target and draft decode the prompt (one batch, logits at the last token);
               the first token is sampled normally (real probabilities)
    each step  n_max = min(n_ctx - n_past - 2, n_remaining - 1)               :517-536
               draft d[0..n) from the first drafter that returns one         speculative.cpp:2868-2956
               target decodes [sampled, d0 .. d(n-1)], outputs on every row; the draft context
               mirrors that batch (output on the last row)                   :4072-4084
               verify: rejection if temp > 0 and the draft is probabilistic, else sample-and-match
               KV of rejected positions removed on both contexts             :4342-4348
               emit the tokens through the stop rules (n_predict, EOG, stop strings)
    no draft   a normal step: [sampled] alone, one sample (real probabilities)

Every emitted token carries the values a fixed server would report: the
pre-sampling softmax of the verify row that scored it, and the post-sampling
candidates of the target chain at that row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .drafters import NgramCache, NgramMap, NgramMod, NgramSimple
from .errors import TranscriptError
from .evaluate import pre_sampling
from .llama import Context, Model
from .rng import DRAFT_SEED_XOR, REJECTION_SEED_XOR, MT19937, canonical_float
from .sampling import LLAMA_DEFAULT_SEED, SamplerChain, SamplingParams
from .verify import match_continues, rejection_step

SUPPORTED = ("draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
UNSUPPORTED = {
    "draft-mtp": "MTP heads need the target's hidden states (src/llama-ext.h), which libllama's C API does not expose",
    "draft-eagle3": "EAGLE-3 needs the target's hidden states (src/llama-ext.h), which libllama's C API does not expose",
    "draft-dflash": "DFlash needs the target's hidden states (src/llama-ext.h), which libllama's C API does not expose",
}
PROFILES = ("b11434", "0c1e570")
PRIORITY = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple")


@dataclass
class SpecConfig:
    """The server's speculative flags (same names and defaults as llama-server's)."""

    types: tuple[str, ...] = ()
    draft_n_max: int = 3  # --spec-draft-n-max (common/common.h:329)
    draft_n_min: int = 0  # --spec-draft-n-min
    draft_p_min: float = 0.0  # --spec-draft-p-min
    draft_sampling: str = "greedy"  # --spec-draft-sampling
    ngram_simple_size_n: int = 12
    ngram_simple_size_m: int = 48
    ngram_map_k_size_n: int = 12
    ngram_map_k_size_m: int = 48
    ngram_map_k_min_hits: int = 1
    ngram_map_k4v_size_n: int = 12
    ngram_map_k4v_size_m: int = 48
    ngram_map_k4v_min_hits: int = 1
    ngram_mod_n_match: int = 24
    ngram_mod_n_max: int = 64
    ngram_mod_n_min: int = 48
    profile: str = "b11434"  # which server loop: SERVER_LOOP.md section 7

    def check(self, has_draft_model: bool) -> None:
        if self.profile not in PROFILES:
            raise TranscriptError(f"unknown server profile {self.profile!r}; known: {', '.join(PROFILES)}")
        if self.profile == "0c1e570" and self.draft_sampling == "probabilistic":
            raise TranscriptError("the 0c1e570 server has no --spec-draft-sampling probabilistic (no rejection "
                                  "path); this transcript cannot come from it")
        for t in self.types:
            if t in UNSUPPORTED:
                raise TranscriptError(f"--spec-type {t} cannot be replayed: {UNSUPPORTED[t]}")
            if t not in SUPPORTED:
                raise TranscriptError(f"unknown --spec-type {t!r}")
        if "draft-simple" in self.types and not has_draft_model:
            raise TranscriptError("--spec-type draft-simple needs the draft model: pass --draft")


@dataclass
class Emitted:
    index: int
    id: int
    step: int
    logprob: float  # pre-sampling, what a fixed server reports with post_sampling_probs false
    top: list[tuple[int, float]]
    post_prob: float
    post_top: list[tuple[int, float]]


@dataclass
class Step:
    """One verify step. Vocabulary as in verify.py."""

    index: int
    pos0: int  # position of `sampled` (the last emitted token, not yet in the KV)
    sampled: int
    drafter: str | None
    draft: list[int]
    draft_q: list[float] | None  # draft probability of each draft token (probabilistic draft-simple)
    target_p: list[float]  # target (post-sampling) probability of each verified draft token
    uniforms: list[list[float | None]]  # rejection draws per position: [u_accept, u_residual] (None: not drawn)
    rule: str  # "normal" | "sample-and-match" | "rejection"
    accepted: int
    resampled: int | None
    bonus: int | None
    emitted: list[int] = field(default_factory=list)  # after the stop rules

    def to_json(self) -> dict:
        return dict(self.__dict__)


class DraftSimple:
    """draft-simple (common/speculative.cpp:273-472): the draft model in its own context.

    Greedy: chain [suppress] -> top_k(10) -> dist; the draft is cur_p[0] (argmax).
    Probabilistic (temp > 0): chain [suppress] -> top_k(10) -> temp_ext(temp) -> dist(S ^ 0x85ebca6b),
    fresh at each request (begin() resets it); the draft is the sampled token, q its cur_p.
    """

    name = "draft-simple"

    def __init__(self, model: Model, ctx: Context, cfg: SpecConfig, temp: float, seed: int):
        self.model, self.ctx, self.cfg = model, ctx, cfg
        # 0c1e570 has no probabilistic drafting and resets the (argmax) sampler every step,
        # [0c1e570] common/speculative.cpp:326; with argmax drafting the reset changes nothing
        self.probabilistic = cfg.profile == "b11434" and cfg.draft_sampling == "probabilistic" and temp > 0
        if self.probabilistic:
            s = LLAMA_DEFAULT_SEED if seed == LLAMA_DEFAULT_SEED else (seed ^ DRAFT_SEED_XOR)
            params = SamplingParams(samplers=("top_k", "temperature"), top_k=10, temp=temp, seed=s)
        else:
            params = SamplingParams(samplers=("top_k",), top_k=10, seed=LLAMA_DEFAULT_SEED)
        self.chain = SamplerChain(model, params)
        self.last_q: list[tuple[np.ndarray, np.ndarray]] | None = None

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]:
        ctx, cfg = self.ctx, self.cfg
        pos0 = len(inp)
        ctx.decode([id_last], pos0, [True])
        out: list[int] = []
        qs: list[tuple[np.ndarray, np.ndarray]] = []
        i = 0
        while True:
            cands, sel = self.chain.apply(ctx.logits(0))
            tok = int(cands["id"][sel]) if self.probabilistic else int(cands["id"][0])
            if cands["p"][0] < cfg.draft_p_min:
                break
            self.chain.accept(tok)
            out.append(tok)
            qs.append((cands["id"].copy(), cands["p"].copy()))
            if cfg.draft_n_max <= len(out) or (n_max > 0 and n_max <= len(out)):
                break
            ctx.decode([tok], pos0 + i + 1, [True])
            i += 1
        if len(out) < cfg.draft_n_min:
            out, qs = [], []
        self.last_q = qs if self.probabilistic else None
        return out

    def accept(self, n_accepted: int) -> None:
        pass


class SpeculativeLoop:
    """Iterate the server's steps for one request; `emitted` grows as steps run.

    Profiles (SERVER_LOOP.md section 7): b11434 verifies by rejection when the draft is
    probabilistic and temp > 0, else by sample-and-match; 0c1e570 always by
    sample-and-match ([0c1e570] tools/server/server-context.cpp:3896-3900).
    """

    def __init__(self, target: Model, prompt: Sequence[int], params: SamplingParams, cfg: SpecConfig, *,
                 draft: Model | None = None, n_ctx: int = 2048, n_predict: int = -1, n_probs: int = 0,
                 stop: Sequence[str] = (), threads: int = 2, n_batch: int = 2048, n_ubatch: int = 512,
                 server_state: dict | None = None):
        """`server_state` carries drafter state that outlives a request on one server (ngram-mod's
        table, SERVER_LOOP.md section 0 item 6): pass the same dict for consecutive requests."""
        cfg.check(draft is not None)
        if params.seed == LLAMA_DEFAULT_SEED:
            raise TranscriptError("the request has no fixed seed (seed -1): the server drew a random one, so the "
                                  "run cannot be reproduced; record with an explicit \"seed\"")
        self.target, self.params, self.cfg = target, params, cfg
        self.prompt = list(prompt)
        self.n_ctx, self.n_predict, self.n_probs, self.stop = n_ctx, n_predict, max(n_probs, 1), list(stop)
        ctx_kw = dict(n_ctx=n_ctx, n_batch=min(n_batch, n_ctx), n_ubatch=n_ubatch, n_threads=threads)
        self.ctx = Context(target, **ctx_kw)
        self.chain = SamplerChain(target, params)
        self.rng = MT19937((params.seed ^ REJECTION_SEED_XOR) & 0xFFFFFFFF)
        self.draft_ctx = Context(draft, **ctx_kw) if draft is not None else None
        self.drafters = []
        for t in PRIORITY:
            if t not in cfg.types:
                continue
            if t == "ngram-simple":
                self.drafters.append(NgramSimple(cfg.ngram_simple_size_n, cfg.ngram_simple_size_m))
            elif t in ("ngram-map-k", "ngram-map-k4v"):
                # per-slot state that survives requests (SERVER_LOOP.md 4.2)
                state = server_state if server_state is not None else {}
                mp = state.get(t)
                if mp is None:
                    k = t.replace("-", "_")  # ngram_map_k | ngram_map_k4v
                    mp = state[t] = NgramMap(t == "ngram-map-k", getattr(cfg, k + "_size_n"),
                                             getattr(cfg, k + "_size_m"), getattr(cfg, k + "_min_hits"))
                self.drafters.append(mp)
            elif t == "ngram-cache":
                state = server_state if server_state is not None else {}
                self.drafters.append(state.setdefault(t, NgramCache()))  # per slot, kept across requests
            elif t == "ngram-mod":
                state = server_state if server_state is not None else {}
                mod = state.get("ngram-mod")
                if mod is None:
                    mod = state["ngram-mod"] = NgramMod(cfg.ngram_mod_n_match, cfg.ngram_mod_n_max, cfg.ngram_mod_n_min)
                self.drafters.append(mod)
            elif t == "draft-simple":
                self.drafters.append(DraftSimple(draft, self.draft_ctx, cfg, params.temp, params.seed))
        self.emitted: list[Emitted] = []
        self.text = b""
        self.done = False
        self.n_draft = 0
        self.n_accepted = 0

    def close(self) -> None:
        self.chain.close()
        for d in self.drafters:
            if isinstance(d, DraftSimple):
                d.chain.close()
        if self.draft_ctx is not None:
            self.draft_ctx.close()
        self.ctx.close()

    # --- helpers ---------------------------------------------------------------

    def _sample(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        cands, sel = self.chain.apply(logits)
        return int(cands["id"][sel]), cands

    def _emit(self, tok: int, step: int, logits: np.ndarray, cands: np.ndarray) -> bool:
        """Record one emitted token with its true values; False when generation stops after it."""
        logprob, top = pre_sampling(logits, tok, self.n_probs)
        where = np.nonzero(cands["id"] == tok)[0]
        post_top = []
        for i in range(min(self.n_probs, len(cands))):
            if cands["p"][i] == 0.0:
                break
            post_top.append((int(cands["id"][i]), float(cands["p"][i])))
        self.emitted.append(Emitted(len(self.emitted), tok, step, logprob, top,
                                    float(cands["p"][where[0]]) if len(where) else 0.0, post_top))
        # process_token (server-context.cpp:1966-2095): stop strings, n_predict, EOG, context
        self.text += self.target.piece(tok, special=False)
        text = self.text.decode("utf-8", "ignore")
        if any(s and s in text for s in self.stop):
            return False
        if self.target.is_eog(tok):
            return False
        if self.n_predict >= 0 and len(self.emitted) >= self.n_predict:
            return False
        if len(self.prompt) + len(self.emitted) + 1 >= self.n_ctx:
            return False
        return True

    def _decode_both(self, tokens: list[int], pos0: int) -> None:
        """The target batch (outputs on every row) and its mirror in the draft context (last row)."""
        self.ctx.decode(tokens, pos0, [True] * len(tokens))
        if self.draft_ctx is not None:
            self.draft_ctx.decode(tokens, pos0, [False] * (len(tokens) - 1) + [True])

    # --- the loop --------------------------------------------------------------

    def steps(self) -> Iterator[Step]:
        n_prompt = len(self.prompt)
        if n_prompt + 1 >= self.n_ctx:
            raise TranscriptError(f"the prompt has {n_prompt} tokens but the context holds {self.n_ctx}")
        for start in range(0, n_prompt, self.ctx.n_batch):
            part = self.prompt[start:start + self.ctx.n_batch]
            last = start + len(part) == n_prompt
            outs = [False] * (len(part) - 1) + [last]
            self.ctx.decode(part, start, outs)
            if self.draft_ctx is not None:
                self.draft_ctx.decode(part, start, outs)
        self.chain.accept_prompt(self.prompt)
        for d in self.drafters:
            d.begin(self.prompt)
        logits = self.ctx.logits(-1)
        sampled, cands = self._sample(logits)
        self.chain.accept(sampled)
        alive = self._emit(sampled, 0, logits, cands)
        yield Step(0, n_prompt, sampled, None, [], None, [], [], "normal", 0, None, None, [sampled])
        kv = list(self.prompt)  # tokens in the target KV (without `sampled`)
        step = 0
        while alive:
            step += 1
            pos0 = len(kv)
            n_remaining = self.n_predict - len(self.emitted) if self.n_predict >= 0 else -1
            n_max = self.n_ctx - pos0 - 2
            if n_remaining > 0:
                n_max = min(n_max, n_remaining - 1)
            draft, drafter, q = [], None, None
            if n_max > 0:
                for d in self.drafters:
                    got = d.draft(kv, sampled, n_max)
                    if got:
                        draft, drafter = got[:n_max], d
                        if isinstance(d, DraftSimple) and d.last_q is not None:
                            q = d.last_q[:n_max]
                        break
                if self.draft_ctx is not None:
                    self.draft_ctx.seq_rm(0, pos0, -1)  # drafting KV is discarded (server-context.cpp:3262-3307)
            self.n_draft += len(draft)
            batch = [sampled] + draft
            self._decode_both(batch, pos0)
            rec = Step(step, pos0, sampled, drafter.name if drafter else None, list(draft),
                       [float(qp[list(qi).index(t)]) if t in qi else 0.0 for t, (qi, qp) in zip(draft, q)] if q else None,
                       [], [], "normal" if not draft else ("rejection" if q is not None else "sample-and-match"),
                       0, None, None)
            ids: list[int] = []
            rows: list[tuple[np.ndarray, np.ndarray]] = []
            if rec.rule == "rejection":
                for i, d_tok in enumerate(draft):
                    logits = self.ctx.logits(i)
                    id_tgt, cands = self._sample(logits)
                    qi, qp = q[i]
                    dec = rejection_step(d_tok, cands["id"], cands["p"], qi, qp, id_tgt,
                                         lambda: canonical_float(self.rng))
                    rec.target_p.append(dec.p)
                    rec.uniforms.append([dec.u_accept, dec.u_residual])
                    self.chain.accept(dec.token)
                    ids.append(dec.token)
                    rows.append((logits, cands))
                    if not dec.accepted:
                        rec.resampled = dec.token
                        break
                    rec.accepted += 1
            else:
                for i, d_tok in enumerate(draft):
                    logits = self.ctx.logits(i)
                    tok, cands = self._sample(logits)
                    self.chain.accept(tok)
                    ids.append(tok)
                    rows.append((logits, cands))
                    w = np.nonzero(cands["id"] == d_tok)[0]
                    rec.target_p.append(float(cands["p"][w[0]]) if len(w) else 0.0)
                    if not match_continues(d_tok, tok, self.target.is_eog(tok), i, len(draft)):
                        if tok != d_tok:
                            rec.resampled = tok
                        break
                    rec.accepted += 1
            if len(ids) == len(draft) and (rec.resampled is None):
                logits = self.ctx.logits(len(draft))
                tok, cands = self._sample(logits)
                self.chain.accept(tok)
                ids.append(tok)
                rows.append((logits, cands))
                if draft:
                    rec.bonus = tok
            accepted_drafts = len(ids) - 1
            rec.accepted = accepted_drafts
            self.n_accepted += accepted_drafts
            if drafter is not None:
                drafter.accept(accepted_drafts)
            # KV: sampled + accepted drafts stay, the rest goes (server-context.cpp:4342-4348)
            keep = pos0 + 1 + accepted_drafts
            self.ctx.seq_rm(0, keep, -1)
            if self.draft_ctx is not None:
                self.draft_ctx.seq_rm(0, keep, -1)
            kv += [sampled] + ids[:-1]
            for tok, (logits, cands) in zip(ids, rows):
                rec.emitted.append(tok)
                if not self._emit(tok, step, logits, cands):
                    alive = False
                    break  # the rest of this step's tokens are dropped
            sampled = ids[-1]
            yield rec


# --- running a trace for a transcript or a fresh prompt ------------------------------

@dataclass
class TraceResult:
    steps: list[Step]
    emitted: list[Emitted]
    pieces: list[str]
    recorded: list[int] | None  # the transcript's generated ids (None: no transcript)
    first_divergence: int | None
    draft_n: int
    draft_n_accepted: int
    server_draft_n: int | None = None
    server_draft_n_accepted: int | None = None
    post: bool = False
    server_candidates: list[tuple[int, float]] | None = None  # the transcript's top list at the divergence
    notes: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool | None:
        if self.recorded is None:
            return None
        return self.first_divergence is None and (
            self.server_draft_n is None or (self.server_draft_n, self.server_draft_n_accepted) ==
            (self.draft_n, self.draft_n_accepted))

    def to_json(self, piece) -> dict:
        def top(pairs, post):
            import math
            return [{"id": i, "piece": piece(i), "logprob": (math.log(v) if post and v > 0 else v)} for i, v in pairs]
        return {
            "steps": [s.to_json() for s in self.steps],
            "emitted": [{"index": e.index, "id": e.id, "piece": self.pieces[e.index], "step": e.step,
                         "logprob": e.logprob, "top": top(e.top, False),
                         "post_prob": e.post_prob, "post_top": top(e.post_top, True)} for e in self.emitted],
            "reproduced": self.reproduced, "first_divergence": self.first_divergence,
            "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
            "server_draft_n": self.server_draft_n, "server_draft_n_accepted": self.server_draft_n_accepted,
            "server_candidates_at_divergence": None if self.server_candidates is None else
            [{"id": i, "piece": piece(i), "logprob": lp} for i, lp in self.server_candidates],
            "notes": self.notes,
        }


def profile_of(build_info: str | None) -> str | None:
    """b11434 or 0c1e570 from a server's build_info / system_fingerprint, else None."""
    if not build_info:
        return None
    if "0c1e570" in build_info:
        return "0c1e570"
    if build_info.startswith("b11434"):
        return "b11434"
    return None


def run(target: Model, prompt: Sequence[int], params: SamplingParams, cfg: SpecConfig, *, draft: Model | None,
        n_ctx: int, n_predict: int, n_probs: int, stop: Sequence[str] = (), recorded: list[int] | None = None,
        timings: dict | None = None, threads: int = 2, server_state: dict | None = None,
        stream: bool = False) -> TraceResult:
    """Run the loop for one request. `recorded` (the server's ids) is compared token by token; from a
    stream it may lack a final end-of-generation token (a stream sends no chunk for it)."""
    loop = SpeculativeLoop(target, prompt, params, cfg, draft=draft, n_ctx=n_ctx, n_predict=n_predict,
                           n_probs=n_probs, stop=stop, threads=threads, server_state=server_state)
    try:
        steps = list(loop.steps())
    finally:
        loop.close()
    ids = [e.id for e in loop.emitted]
    div = None
    if recorded is not None:
        if stream and len(ids) == len(recorded) + 1 and ids[:-1] == list(recorded) and target.is_eog(ids[-1]):
            recorded = list(recorded) + [ids[-1]]
        for i in range(max(len(ids), len(recorded))):
            if i >= len(ids) or i >= len(recorded) or ids[i] != recorded[i]:
                div = i
                break
    t = timings or {}
    return TraceResult(steps, loop.emitted, [target.piece(i).decode("utf-8", "replace") for i in ids], recorded, div,
                       loop.n_draft, loop.n_accepted, t.get("draft_n"), t.get("draft_n_accepted"),
                       post=bool(params.post_sampling_probs))
