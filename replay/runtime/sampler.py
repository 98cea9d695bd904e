"""The target sampler chain, built from a request the way llama-server builds it.

Mirrors `common_sampler_init` (common/sampling.cpp:191-444, b11434) using
libllama's own `llama_sampler_*` through ctypes, so every sampler's arithmetic
is the server's:

    [logit_bias(user biases + EOG biases if ignore_eos + suppress tokens)]   :329-342
    for s in samplers (default penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature):
        the matching llama_sampler_init_* (disabled ones are no-ops in libllama)   :344-398
    dist(seed)                                                                 :400-406
    (mirostat 1/2: temp + mirostat instead)                                    :407-413

Request fields and defaults follow tools/server/server-schema.cpp:11-516 and
common/common.h:227-303. The prompt is fed to the chain's history before the
first sample (server-context.cpp:418-440, `common_sampler_accept(.., false)`).

`Candidates.after_chain()` gives the post-sampling candidate list the server
reports with `post_sampling_probs` (server-context.cpp:2097-2125): the chain's
`cur_p`, sorted by p descending when a sampler left it unsorted
(`common_sampler_get_candidates`, common/sampling.cpp:861-886).
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import llama_cpp as L
import numpy as np

from ..errors import TranscriptError

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# common/common.h:264-274
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
# common/sampling.cpp:959-1049: names, aliases and one-letter codes
_NAMES = {
    "dry": "dry", "top_k": "top_k", "top-k": "top_k", "topk": "top_k",
    "top_p": "top_p", "top-p": "top_p", "nucleus": "top_p", "topp": "top_p",
    "top_n_sigma": "top_n_sigma", "top-n-sigma": "top_n_sigma",
    "typ_p": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "typical_p": "typ_p", "typical-p": "typ_p", "typical": "typ_p",
    "min_p": "min_p", "min-p": "min_p", "xtc": "xtc", "temperature": "temperature", "temp": "temperature",
    "infill": "infill", "penalties": "penalties", "adaptive_p": "adaptive_p", "adaptive-p": "adaptive_p",
}
_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
          "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # struct llama_token_data


@dataclass
class SamplingParams:
    """The sampling fields of one request, with the server's defaults."""

    seed: int = LLAMA_DEFAULT_SEED
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typ_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    logit_bias: list[tuple[Any, float]] = field(default_factory=list)  # (token id or string, bias)
    ignore_eos: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False

    @classmethod
    def from_request(cls, endpoint: str, body: dict) -> "SamplingParams":
        """Read a request body as tools/server/server-schema.cpp does (null = default). A field of the
        wrong type is a TranscriptError naming it."""
        p = cls()
        for key, attr in _SIMPLE.items():
            v = _number(body, key, type(getattr(p, attr)))
            if v is not None:
                setattr(p, attr, v)
        p.temp = max(p.temp, 0.0)  # server-schema.cpp:116-118
        dry_base = _number(body, "dry_base", float)
        if dry_base is not None and dry_base >= 1.0:
            p.dry_base = dry_base
        breakers = body.get("dry_sequence_breakers")
        if breakers is not None:
            if not (isinstance(breakers, list) and all(isinstance(b, str) for b in breakers)):
                raise TranscriptError("\"dry_sequence_breakers\" must be a list of strings")
            p.dry_sequence_breakers = tuple(breakers)
        seed = body.get("seed")
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool) or not -1 <= seed < 2**32:
                raise TranscriptError(f"\"seed\" {str(seed)[:20]} is not a 32-bit seed")
            p.seed = seed & 0xFFFFFFFF
        if body.get("ignore_eos") is not None:
            p.ignore_eos = bool(body["ignore_eos"])
        if body.get("post_sampling_probs") is not None:
            p.post_sampling_probs = bool(body["post_sampling_probs"])
        p.samplers = parse_samplers(body.get("samplers"))
        p.logit_bias = parse_logit_bias(body.get("logit_bias"))
        p.n_probs = requested_n_probs(endpoint, body)
        return p


# request field -> SamplingParams attribute (tools/server/server-schema.cpp)
_SIMPLE = {"temperature": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "typical_p": "typ_p", "top_n_sigma": "top_n_sigma", "xtc_probability": "xtc_probability",
           "xtc_threshold": "xtc_threshold", "dynatemp_range": "dynatemp_range",
           "dynatemp_exponent": "dynatemp_exponent", "repeat_last_n": "penalty_last_n",
           "repeat_penalty": "penalty_repeat", "frequency_penalty": "penalty_freq",
           "presence_penalty": "penalty_present", "dry_multiplier": "dry_multiplier",
           "dry_allowed_length": "dry_allowed_length", "dry_penalty_last_n": "dry_penalty_last_n",
           "mirostat": "mirostat", "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta",
           "min_keep": "min_keep"}
_INT32 = 2**31


def _number(body: dict, key: str, kind: type) -> Any:
    """body[key] as an int or a finite float (None when absent or null); anything else is a
    TranscriptError naming the field."""
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and kind is int:
        ok = -_INT32 <= v < _INT32  # a float is truncated, as nlohmann's get<int32_t>() does
    if not ok:
        what = "a 32-bit integer" if kind is int else "a finite number"
        raise TranscriptError(f"\"{key}\" must be {what}, got {str(v)[:20]}")
    return kind(v)


def requested_n_probs(endpoint: str, body: dict) -> int:
    """How many alternatives the request asked for.

    /v1/chat/completions: `logprobs: true` means `top_logprobs` (default 20)
    (tools/server/server-common.cpp:1470-1479); elsewhere `n_probs`, alias `logprobs`.
    """
    if endpoint == "/v1/chat/completions":
        if body.get("logprobs"):
            v = _number(body, "top_logprobs", int)
            return 20 if v is None else v
        return _number(body, "n_probs", int) or 0
    key = "n_probs" if body.get("n_probs") is not None else "logprobs"
    if isinstance(body.get(key), bool):
        return 0
    return _number(body, key, int) or 0


def parse_samplers(v: Any) -> tuple[str, ...]:
    if v is None:
        return DEFAULT_SAMPLERS
    if isinstance(v, str) and ";" in v:
        v = v.split(";")
    if isinstance(v, str):
        return tuple(_CHARS[c] for c in v if c in _CHARS)
    if isinstance(v, list):
        return tuple(_NAMES[n] for n in v if isinstance(n, str) and n in _NAMES)
    raise TranscriptError(f"\"samplers\" must be a list of names or a string, got {type(v).__name__}")


def parse_logit_bias(v: Any) -> list[tuple[Any, float]]:
    """`[[tok|string, bias|false], ...]` or `{"tok"|"string": bias}` (server-schema.cpp:434-473)."""
    if not v:
        return []
    if not isinstance(v, (list, dict)):
        raise TranscriptError("\"logit_bias\" must be a list of [token, bias] pairs or an object")
    items = v.items() if isinstance(v, dict) else v
    out = []
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise TranscriptError("\"logit_bias\" entries must be [token, bias] pairs")
        tok, bias = item
        if bias is False:
            bias = -math.inf
        elif not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise TranscriptError(f"\"logit_bias\": the bias of {str(tok)[:20]} is not a number")
        if isinstance(tok, str) and tok.lstrip("-").isdigit() and isinstance(v, dict):
            tok = int(tok)
        if not isinstance(tok, (int, str)) or isinstance(tok, bool):
            raise TranscriptError("\"logit_bias\": a token must be an id or a string")
        out.append((tok, float(bias)))
    return out


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


class SamplerChain:
    """A libllama sampler chain built like common_sampler_init, with its own history."""

    def __init__(self, model, params: SamplingParams):
        self.params = params
        self.model = model
        cp = L.llama_sampler_chain_default_params()
        cp.no_perf = True
        self._chain = L.llama_sampler_chain_init(cp)
        vocab, n_vocab = model.vocab, model.n_vocab
        add = lambda s: L.llama_sampler_chain_add(self._chain, s)

        biases: list[tuple[int, float]] = []
        for tok, bias in params.logit_bias:
            if isinstance(tok, str):
                biases += [(t, bias) for t in model.tokenize(tok, add_special=False, parse_special=False)]
            else:
                biases.append((int(tok), bias))
        if params.ignore_eos:
            biases += [(t, -math.inf) for t in model.eog_ids]
        n_sup = ctypes.c_int32(0)
        sup = L.llama_vocab_get_suppress_tokens(vocab, ctypes.byref(n_sup))
        biases += [(sup[i], -math.inf) for i in range(n_sup.value)]
        if biases:
            arr = (L.llama_logit_bias * len(biases))(*[L.llama_logit_bias(t, b) for t, b in biases])
            add(L.llama_sampler_init_logit_bias(n_vocab, len(biases), arr))

        s = params
        if s.mirostat == 0:
            adaptive = False
            for name in s.samplers:
                if name == "dry":
                    brk = [b.encode() for b in s.dry_sequence_breakers]
                    c_brk = (ctypes.c_char_p * len(brk))(*brk)
                    add(L.llama_sampler_init_dry(vocab, s.dry_multiplier, s.dry_base, s.dry_allowed_length,
                                                 s.dry_penalty_last_n, c_brk, len(brk)))
                elif name == "top_k":
                    add(L.llama_sampler_init_top_k(s.top_k))
                elif name == "top_p":
                    add(L.llama_sampler_init_top_p(s.top_p, s.min_keep))
                elif name == "top_n_sigma":
                    add(L.llama_sampler_init_top_n_sigma(s.top_n_sigma))
                elif name == "min_p":
                    add(L.llama_sampler_init_min_p(s.min_p, s.min_keep))
                elif name == "xtc":
                    add(L.llama_sampler_init_xtc(s.xtc_probability, s.xtc_threshold, s.min_keep, s.seed))
                elif name == "typ_p":
                    add(L.llama_sampler_init_typical(s.typ_p, s.min_keep))
                elif name == "temperature":
                    add(L.llama_sampler_init_temp_ext(s.temp, s.dynatemp_range, s.dynatemp_exponent))
                elif name == "infill":
                    add(L.llama_sampler_init_infill(vocab))
                elif name == "penalties":
                    add(L.llama_sampler_init_penalties(n_vocab, s.penalty_last_n, s.penalty_repeat, s.penalty_freq,
                                                       s.penalty_present))
                elif name == "adaptive_p":
                    adaptive = True
            if adaptive:
                raise TranscriptError("the adaptive-p sampler is not supported for replay")
            add(L.llama_sampler_init_dist(s.seed))
        elif s.mirostat == 1:
            add(L.llama_sampler_init_temp(s.temp))
            add(L.llama_sampler_init_mirostat(n_vocab, s.seed, s.mirostat_tau, s.mirostat_eta, 100))
        else:
            add(L.llama_sampler_init_temp(s.temp))
            add(L.llama_sampler_init_mirostat_v2(s.seed, s.mirostat_tau, s.mirostat_eta))
        self._buf = np.empty(n_vocab, dtype=TOKEN_DATA)
        self._buf["id"] = np.arange(n_vocab, dtype=np.int32)

    def accept(self, token: int) -> None:
        """common_sampler_accept: the chain's history (penalties, DRY) gets `token`."""
        L.llama_sampler_accept(self._chain, token)

    def accept_prompt(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.accept(t)

    def apply(self, logits: np.ndarray) -> tuple[np.ndarray, int]:
        """Run the chain over raw logits; return (candidates after the chain, selected index).

        The candidate array is a copy (structured TOKEN_DATA), sorted by p
        descending if the chain left it unsorted, as get_candidates(sorted=true) does.
        """
        buf = self._buf
        buf["id"] = np.arange(len(buf), dtype=np.int32)
        buf["logit"] = logits
        buf["p"] = 0.0
        arr = L.llama_token_data_array(
            data=buf.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=len(buf), selected=-1, sorted=False)
        L.llama_sampler_apply(self._chain, ctypes.byref(arr))
        n = int(arr.size)
        addr = ctypes.cast(arr.data, ctypes.c_void_p).value
        view = np.frombuffer((ctypes.c_char * (n * TOKEN_DATA.itemsize)).from_address(addr), dtype=TOKEN_DATA)
        cands = view.copy()
        selected = int(arr.selected)
        if not arr.sorted:
            sel_id = int(cands["id"][selected]) if 0 <= selected < n else None
            order = np.argsort(-cands["p"], kind="stable")
            cands = cands[order]
            if sel_id is not None:
                selected = int(np.nonzero(cands["id"] == sel_id)[0][0])
        return cands, selected

    def close(self) -> None:
        if self._chain is not None:
            L.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self):
        self.close()
