"""The target sampler chain, built from effective settings the way llama-server builds it.

Mirrors `common_sampler_init` (common/sampling.cpp:191-444, b11434) using
libllama's own `llama_sampler_*` through ctypes, so every sampler's arithmetic
is the server's:

    [logit_bias(user biases + EOG biases if ignore_eos + suppress tokens)]   :329-342
    for s in samplers (default penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature):
        the matching llama_sampler_init_* (disabled ones are no-ops in libllama)   :344-398
    dist(seed), or adaptive-p in its place                                     :400-406
    (mirostat 1/2: temp + mirostat instead)                                    :407-413

and, beside the chain, the request's grammar (GrammarSampler: check the sampled token, resample
with the grammar applied on rejection, as common_sampler_sample does). The settings come from
settings/sampling.py (request > flags > model file > defaults). The prompt is fed to the chain's
history before the first sample (server-context.cpp:418-440, `common_sampler_accept(.., false)`).

`SamplerChain.apply()` gives the post-sampling candidate list the server reports with
`post_sampling_probs` (server-context.cpp:2097-2125): the chain's `cur_p`, sorted by p descending
when a sampler left it unsorted (`common_sampler_get_candidates`, common/sampling.cpp:861-886).
"""
from __future__ import annotations

import ctypes
import math
from typing import Sequence

import numpy as np

from replay.errors import TranscriptError
from replay.numerics.stdsort import std_sort_order
from replay.runtime.binding import L
from replay.settings.sampling import LLAMA_DEFAULT_SEED, Grammar, SamplingParams

__all__ = ["LLAMA_DEFAULT_SEED", "GrammarSampler", "SamplerChain", "SamplingParams", "TOKEN_DATA", "post_sampling"]

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # struct llama_token_data


def post_sampling(cands: np.ndarray, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """(p of `tok`, top-N (id, p) with p > 0) among the chain's candidates: what the server reports
    with post_sampling_probs (server-context.cpp:2097-2125). p is 0 for a token the chain removed."""
    where = np.nonzero(cands["id"] == tok)[0]
    top = []
    for i in range(min(n_top, len(cands))):
        if cands["p"][i] == 0.0:
            break
        top.append((int(cands["id"][i]), float(cands["p"][i])))
    return (float(cands["p"][where[0]]) if len(where) else 0.0), top


TIE_WINDOW = 64  # leading candidates whose order is reported (top-N, the trace's kept candidates)


def server_order(p: np.ndarray) -> np.ndarray:
    """The order common_sampler_get_candidates leaves unsorted candidates in: std::sort by p,
    descending (common/sampling.cpp:861-880). A stable argsort gives it but for the order of equal
    p, which libstdc++'s introsort scrambles (numerics/stdsort.py, pure Python and slow): that is
    followed wherever equal positive p meet in the first TIE_WINDOW entries, where the order is
    reported.

    >>> server_order(np.array([0.1, 0.5, 0.2, 0.2], dtype=np.float32)).tolist()
    [1, 2, 3, 0]
    """
    order = np.argsort(-p, kind="stable")
    head = p[order[:TIE_WINDOW + 1]]
    if np.any((head[1:] == head[:-1]) & (head[1:] > 0)):
        return np.asarray(std_sort_order(p), dtype=np.int64)
    return order


class GrammarSampler:
    """A libllama grammar sampler held beside the chain, as common_sampler holds `grmr`
    (common/sampling.cpp:225-311): lazy with its trigger patterns and tokens, or not; an
    output-format or tool-call grammar that is not lazy is first fed the generation prompt."""

    _ptr = None  # (so close() works when __init__ failed before it took a handle)

    def __init__(self, model, grammar: Grammar):
        self.model, self.grammar = model, grammar
        text = grammar.text.encode()
        if grammar.lazy:
            pats = [p.encode() for p in grammar.trigger_patterns]
            c_pats = (ctypes.c_char_p * max(len(pats), 1))(*pats)
            toks = (L.llama_token * max(len(grammar.trigger_tokens), 1))(*grammar.trigger_tokens)
            ptr = L.llama_sampler_init_grammar_lazy_patterns(model.vocab, text, b"root", c_pats, len(pats), toks,
                                                            len(grammar.trigger_tokens))
        else:
            ptr = L.llama_sampler_init_grammar(model.vocab, text, b"root")
        if not ptr:
            raise TranscriptError("the server's grammar does not parse (libllama refused it)")
        self._ptr = ptr
        self._one = np.zeros(1, dtype=TOKEN_DATA)
        if not grammar.lazy and grammar.kind in ("output_format", "tool_calls") and grammar.generation_prompt:
            prompt = grammar.generation_prompt
            try:
                for i, tok in enumerate(model.tokenize(prompt, add_special=False, parse_special=True)):
                    piece = model.piece(tok, special=True)
                    if i == 0 and piece[:1].isspace() and not prompt[:1].isspace():
                        continue  # a space some tokenizers put before the first special token (:287-292)
                    self.accept(tok)
            except BaseException:
                self.close()
                raise

    def _apply(self, cands: np.ndarray) -> None:
        arr = L.llama_token_data_array(data=cands.ctypes.data_as(ctypes.POINTER(L.llama_token_data)),
                                       size=len(cands), selected=-1, sorted=False)
        L.llama_sampler_apply(self._ptr, ctypes.byref(arr))

    def allows(self, token: int) -> bool:
        """The server's check of a sampled token alone (common_sampler_sample, :654-664)."""
        self._one["id"], self._one["logit"], self._one["p"] = token, 1.0, 0.0
        self._apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def masked(self, cands: np.ndarray) -> np.ndarray:
        """A copy of `cands` with the logits of tokens the grammar rejects set to -inf."""
        out = np.ascontiguousarray(cands).copy()
        self._apply(out)
        return out

    def accept(self, token: int) -> None:
        # libllama aborts the process on a token the grammar rejects: check it first
        if not self.allows(token):
            raise TranscriptError(f"token {token} ({self.model.piece(token)!r}) is not allowed by the grammar here: "
                                  "the transcript was not sampled under this grammar")
        L.llama_sampler_accept(self._ptr, token)

    def close(self) -> None:
        if self._ptr is not None:
            L.llama_sampler_free(self._ptr)
            self._ptr = None


def logit_biases(model, params: SamplingParams, *, suppress_tokens: bool) -> list[tuple[int, float]]:
    """The logit-bias sampler's (token, bias) pairs, in the server's order: the request's logit_bias (a
    text's every token: server-schema.cpp:445-452; ids outside the vocabulary dropped), -inf on every
    end-of-generation token with ignore_eos, and -inf on the model's tokenizer.ggml.suppress_tokens
    (b10182 and later, common/sampling.cpp:318)."""
    out: list[tuple[int, float]] = []
    for tok, bias in params.logit_bias:
        if isinstance(tok, str):
            out += [(t, bias) for t in model.tokenize(tok, add_special=False, parse_special=False)]
        elif 0 <= tok < model.n_vocab:
            out.append((int(tok), bias))
    if params.eog_bias:
        out += [(t, -math.inf) for t in model.eog_ids]
    if suppress_tokens:
        n_sup = ctypes.c_int32(0)
        sup = L.llama_vocab_get_suppress_tokens(model.vocab, ctypes.byref(n_sup))
        out += [(sup[i], -math.inf) for i in range(n_sup.value)]
    return out


def _stage(name: str, s: SamplingParams, vocab, n_vocab: int):
    """One named sampler of the request's `samplers` list, as common_sampler_init makes it
    (common/sampling.cpp:350-396); None for adaptive_p (it ends the chain: chain_samplers) and names it
    does not make."""
    if name == "dry":
        brk = [b.encode() for b in s.dry_sequence_breakers]
        c_brk = (ctypes.c_char_p * len(brk))(*brk)
        return L.llama_sampler_init_dry(vocab, s.dry_multiplier, s.dry_base, s.dry_allowed_length,
                                        s.dry_penalty_last_n, c_brk, len(brk))
    make = {
        "top_k": lambda: L.llama_sampler_init_top_k(s.top_k),
        "top_p": lambda: L.llama_sampler_init_top_p(s.top_p, s.min_keep),
        "top_n_sigma": lambda: L.llama_sampler_init_top_n_sigma(s.top_n_sigma),
        "min_p": lambda: L.llama_sampler_init_min_p(s.min_p, s.min_keep),
        "xtc": lambda: L.llama_sampler_init_xtc(s.xtc_probability, s.xtc_threshold, s.min_keep, s.seed),
        "typ_p": lambda: L.llama_sampler_init_typical(s.typ_p, s.min_keep),
        "temperature": lambda: L.llama_sampler_init_temp_ext(s.temp, s.dynatemp_range, s.dynatemp_exponent),
        "infill": lambda: L.llama_sampler_init_infill(vocab),
        "penalties": lambda: L.llama_sampler_init_penalties(n_vocab, s.penalty_last_n, s.penalty_repeat,
                                                            s.penalty_freq, s.penalty_present),
    }.get(name)
    return make() if make is not None else None


def chain_samplers(model, params: SamplingParams, *, suppress_tokens: bool) -> list:
    """The samplers of common_sampler_init's chain, in order: the logit bias where there is any
    (logit_biases; common/sampling.cpp:331-341), then with mirostat off the request's `samplers` in its
    order and the selecting sampler, dist, or adaptive_p in its place when the list names it (:344-404);
    with mirostat 1 or 2, temperature and that mirostat (:405-411)."""
    vocab, n_vocab, s = model.vocab, model.n_vocab, params
    out = []
    biases = logit_biases(model, params, suppress_tokens=suppress_tokens)
    if biases:
        arr = (L.llama_logit_bias * len(biases))(*[L.llama_logit_bias(t, b) for t, b in biases])
        out.append(L.llama_sampler_init_logit_bias(n_vocab, len(biases), arr))
    if s.mirostat == 1:
        return out + [L.llama_sampler_init_temp(s.temp),
                      L.llama_sampler_init_mirostat(n_vocab, s.seed, s.mirostat_tau, s.mirostat_eta, 100)]
    if s.mirostat != 0:
        return out + [L.llama_sampler_init_temp(s.temp),
                      L.llama_sampler_init_mirostat_v2(s.seed, s.mirostat_tau, s.mirostat_eta)]
    out += [x for x in (_stage(name, s, vocab, n_vocab) for name in s.samplers) if x is not None]
    if "adaptive_p" in s.samplers:
        return out + [L.llama_sampler_init_adaptive_p(s.adaptive_target, s.adaptive_decay, s.seed)]
    return out + [L.llama_sampler_init_dist(s.seed)]


class SamplerChain:
    """A libllama sampler chain built like common_sampler_init, with its own history, and the
    request's grammar beside it."""

    grammar: GrammarSampler | None = None  # (so close() works when __init__ failed early)
    _chain = None

    def __init__(self, model, params: SamplingParams, grammar: Grammar | None = None, *, suppress_tokens: bool = True,
                 single_draw: bool = True):
        """`suppress_tokens`: the model's tokenizer.ggml.suppress_tokens join the logit bias (b10182 and
        later, common/sampling.cpp:318). `single_draw`: the dist sampler draws from its RNG even when one
        candidate is left (b10355 and later, src/llama-sampler.cpp llama_sampler_dist_apply: "keep the RNG
        state aligned with backend sampling"); before, it drew nothing then (builds/loop_shapes.py)."""
        self.params = params
        self.single_draw = single_draw
        self.model = model
        self.grammar = GrammarSampler(model, grammar) if grammar is not None else None
        self.n_applies = 0  # chain passes so far: each draws once from dist's stream (comparison/divergence.py)
        self.passes = 0  # chain passes run, whatever a restore or a one-candidate pass does to n_applies (the work)
        cp = L.llama_sampler_chain_default_params()
        cp.no_perf = True
        self._chain = L.llama_sampler_chain_init(cp)
        n_vocab = model.n_vocab
        for sampler in chain_samplers(model, params, suppress_tokens=suppress_tokens):
            L.llama_sampler_chain_add(self._chain, sampler)
        # the old one-candidate rule is dist's alone: mirostat and adaptive-p draw and update their state
        # on one candidate too (llama-sampler.cpp: llama_sampler_mirostat_v2_apply), so only a chain that
        # ends with dist is rolled back after such a pass
        self._dist_last = params.mirostat == 0 and "adaptive_p" not in params.samplers
        self._buf = np.empty(n_vocab, dtype=TOKEN_DATA)
        self._buf["id"] = np.arange(n_vocab, dtype=np.int32)

    def accept(self, token: int, *, generated: bool = True) -> None:
        """common_sampler_accept (:473-505): the grammar (generated tokens only) and the chain's
        history (penalties, DRY) get `token`."""
        if self.grammar is not None and generated:
            self.grammar.accept(token)
        L.llama_sampler_accept(self._chain, token)

    def accept_prompt(self, tokens: Sequence[int]) -> None:
        """The prompt goes to the chain's history, never to the grammar (server-context.cpp:418-437)."""
        for t in tokens:
            self.accept(t, generated=False)

    def sample(self, logits: np.ndarray) -> tuple[np.ndarray, int]:
        """common_sampler_sample(.., grammar_first=false) (:602-684): run the chain; if a grammar
        rejects the token it picked, run the chain again over the grammar-masked logits (a second
        set of random draws). Returns (candidates, selected index) like `apply`: unmasked when the
        first pick stood, masked after a resample."""
        cands, sel = self.apply(logits)
        if self.grammar is None or self.grammar.allows(int(cands["id"][sel])):
            return cands, sel
        full = np.empty(len(logits), dtype=TOKEN_DATA)
        full["id"], full["logit"], full["p"] = np.arange(len(logits), dtype=np.int32), logits, 0.0
        return self.apply(self.grammar.masked(full)["logit"])

    def apply(self, logits: np.ndarray) -> tuple[np.ndarray, int]:
        """Run the chain over raw logits; return (candidates after the chain, selected index).

        The candidate array is a copy (structured TOKEN_DATA), sorted by p
        descending if the chain left it unsorted, as get_candidates(sorted=true) does.
        """
        self.n_applies += 1
        self.passes += 1
        # before b10355 a pass that leaves one candidate does not advance dist's RNG: keep a copy of the
        # chain to go back to (only other samplers' RNGs and dist's advance in apply)
        before = None if self.single_draw or not self._dist_last else L.llama_sampler_clone(self._chain)
        buf = self._buf
        buf["id"] = np.arange(len(buf), dtype=np.int32)
        buf["logit"] = logits
        buf["p"] = 0.0
        arr = L.llama_token_data_array(
            data=buf.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=len(buf), selected=-1, sorted=False)
        L.llama_sampler_apply(self._chain, ctypes.byref(arr))
        n = int(arr.size)
        if before is not None:
            if n == 1:
                L.llama_sampler_free(self._chain)
                self._chain, before = before, None
                self.n_applies -= 1  # no draw was taken from dist's stream (comparison/divergence.py counts draws)
            else:
                L.llama_sampler_free(before)
        addr = ctypes.cast(arr.data, ctypes.c_void_p).value
        view = np.frombuffer((ctypes.c_char * (n * TOKEN_DATA.itemsize)).from_address(addr), dtype=TOKEN_DATA)
        cands = view.copy()
        selected = int(arr.selected)
        if not arr.sorted:
            sel_id = int(cands["id"][selected]) if 0 <= selected < n else None
            cands = cands[server_order(cands["p"])]
            if sel_id is not None:
                selected = int(np.nonzero(cands["id"] == sel_id)[0][0])
        return cands, selected

    def snapshot(self) -> tuple:
        """A copy of the chain's state (every sampler's RNG and history) and the grammar's, for
        `restore`: common_sampler_clone (common/sampling.cpp:515-526)."""
        return (L.llama_sampler_clone(self._chain),
                L.llama_sampler_clone(self.grammar._ptr) if self.grammar is not None else None, self.n_applies)

    def restore(self, snap: tuple) -> None:
        """Go back to a snapshot (consumed): common_sampler_copy (common/sampling.cpp:528-547)."""
        chain, grammar, self.n_applies = snap
        L.llama_sampler_free(self._chain)
        self._chain = chain
        if self.grammar is not None:
            L.llama_sampler_free(self.grammar._ptr)
            self.grammar._ptr = grammar

    @staticmethod
    def close_snapshot(snap: tuple) -> None:
        """Free a snapshot that will not be restored."""
        for ptr in snap[:2]:
            if ptr is not None:
                L.llama_sampler_free(ptr)

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
        if self._chain is not None:
            L.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self):
        self.close()
