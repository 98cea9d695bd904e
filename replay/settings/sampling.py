"""The sampling settings llama-server applies to a request, computed as the server computes them,
with where each value came from.

    defaults = server_sampling(flags=ours, recorded=rec.flags, props=rec.props, model_meta=model.meta)
    eff = effective(endpoint, request_body, defaults, echo=generation_settings)
    eff.params            # SamplingParams for the sampler chain
    eff.sources["top_k"]  # "request", "command line", "/props", "server.flags", "model file", "default", ...

The server's layers (b11434; research notes in the module of each rule):

    1. llama-server's built-in defaults                      common/common.h:227-300
    2. its command line (flags: ours, else the transcript's)  common/arg.cpp
    3. the model file's general.sampling.* keys, for settings whose flag was not given
       (the flag sets a user_sampling_config bit)            common/common.cpp:1087-1146
    4. the request's fields                                  tools/server/server-schema.cpp:519-551
    5. the response's own echo (/completion's generation_settings; the OpenAI endpoints' under
       __verbose when the request asked for verbose, as `record` does), when the transcript has it:
       the values the server really used; where it disagrees with 1-4 the echo wins and a note says so

/props' default_generation_settings.params, captured by `record`, is the server's merge of 1-3
(except n_predict, stop, logit bias and grammar, which it does not show); where it disagrees with
our own merge it wins (source "/props"), except over a flag given on our command line.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from replay.errors import TranscriptError
from replay.numerics.floats import widened
from replay.settings.table import BY_ATTR, recorded_where, rows

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
INT32 = 2**31

# common/common.h:264-274
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_CANONICAL = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill", "penalties",
              "adaptive_p")


def _sampler_names() -> dict[str, str]:
    """common_sampler_types_from_names (common/sampling.cpp:959-1019): the canonical names, for those
    with '_' also the kebab-case and the no-underscore spellings, and three more aliases."""
    names = {n: n for n in _CANONICAL}
    for n in _CANONICAL:
        if "_" in n:
            names[n.replace("_", "-")] = n
            names[n.replace("_", "")] = n
    names.update(nucleus="top_p", temp="temperature", typ="typ_p")
    return names


SAMPLER_NAMES = _sampler_names()
# common_sampler_type_to_chr (common/sampling.cpp:925-940); case-sensitive
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}


def samplers_from_names(names: list[str]) -> tuple[str, ...]:
    """Each name lower-cased and looked up; unknown ones dropped (the server only warns)."""
    return tuple(SAMPLER_NAMES[n.lower()] for n in names if n.lower() in SAMPLER_NAMES)


def samplers_from_chars(chars: str) -> tuple[str, ...]:
    """One letter per sampler, read character by character (no ';' splitting); unknown ones dropped."""
    return tuple(SAMPLER_CHARS[c] for c in chars if c in SAMPLER_CHARS)


@dataclass
class SamplingParams:
    """What the target sampler chain is built from (common_params_sampling, as the server fills it)."""

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
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    min_keep: int = 0
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    logit_bias: list[tuple[Any, float]] = field(default_factory=list)  # (token id, or text to tokenize, bias)
    eog_bias: bool = False  # also -inf on every end-of-generation token (--ignore-eos / "ignore_eos": true)
    n_probs: int = 0
    post_sampling_probs: bool = False


@dataclass(frozen=True)
class Grammar:
    """A grammar the server samples under (common/sampling.cpp:225-311)."""

    text: str  # GBNF
    kind: str = "user"  # "user" | "output_format" | "tool_calls" (common_grammar_type)
    lazy: bool = False
    trigger_patterns: tuple[str, ...] = ()  # regexes, after the server's word/pattern mapping
    trigger_tokens: tuple[int, ...] = ()
    generation_prompt: str = ""  # fed to an output_format / tool_calls grammar that is not lazy


@dataclass(frozen=True)
class Effective:
    """The settings one request was sampled with, and where each came from."""

    params: SamplingParams
    n_predict: int  # -1: no limit
    stop: tuple[str, ...]
    grammar: Grammar | None
    sources: Mapping[str, str]
    notes: tuple[str, ...] = ()

    def describe(self) -> list[tuple[str, Any, str]]:
        """(setting, value, source) of every value that is not llama-server's built-in default, as
        JSON would hold it (tuples as lists)."""
        builtin = SamplingParams()
        out = []
        for name, src in self.sources.items():
            if name in ("n_predict", "stop", "grammar"):
                value = {"n_predict": self.n_predict, "stop": list(self.stop),
                         "grammar": self.grammar.kind if self.grammar else None}[name]
                if value in (-1, [], None):
                    continue
            else:
                value = getattr(self.params, name)
                default = getattr(builtin, name)
                if value == default or (isinstance(value, float) and widened(value) == widened(default)):
                    continue
            out.append((_spelling(name), list(value) if isinstance(value, tuple) else value, src))
        return out


def _spelling(name: str) -> str:
    """A setting as llama-server spells its flag (--top-k); request-only fields keep their name."""
    attr = {"eog_bias": "ignore_eos", "stop": "antiprompt"}.get(name, name)
    return BY_ATTR[attr].flag if attr in BY_ATTR else name


# --- C parsing, as the server does it ---------------------------------------------------------

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_LIBC.strtof.restype = ctypes.c_float
_LIBC.strtof.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
_LIBC.strtol.restype = ctypes.c_long
_LIBC.strtol.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]


def _c_number(text: str, kind: str) -> float | int | None:
    """strtof / strtol(…, 10) of a model-file value, as common_init_sampler_from_model reads it: None
    unless at least a numeric prefix parses (common/common.cpp:1099-1110); strtol's long is
    truncated to the int32 field."""
    raw = text.encode()
    buf = ctypes.create_string_buffer(raw)
    end = ctypes.c_char_p()
    if kind == "int":
        v = _LIBC.strtol(buf, ctypes.byref(end), 10)
        value: float | int = ctypes.c_int32(v).value
    else:
        value = float(_LIBC.strtof(buf, ctypes.byref(end)))
    consumed = ctypes.cast(end, ctypes.c_void_p).value - ctypes.addressof(buf)
    return value if raw and consumed > 0 else None


# --- layer 1-3: what every request starts from ------------------------------------------------

Layer = dict[str, tuple[Any, str]]  # attr -> (value, source)

# /props default_generation_settings.params shows these (task_params::to_json(only_metrics),
# tools/server/server-task.cpp:42-86); n_predict there is always -1 and is not used
_PROPS_KEYS = {s.generation: s for s in rows("sampling") if s.generation} | {"samplers": None}
_NOT_IN_PROPS = {"n_predict", "stop", "logit_bias", "grammar", "dry_sequence_breakers"}


def server_sampling(*, flags: Mapping[str, Any] | None = None, recorded: Mapping[str, Any] | None = None,
                    props: Mapping | None = None, model_meta: Callable[[str], str | None] | None = None) -> Layer:
    """The server's sampling defaults (layers 1-3), each with its source. `flags` are ours by attr,
    `recorded` the transcript's by flag name, `model_meta(key)` reads the target's GGUF metadata
    as libllama renders it (llama_model_meta_val_str, what the server parses)."""
    given: dict[str, tuple[Any, str]] = {}
    for s in rows("sampling"):
        for src, value in (("command line", (flags or {}).get(s.attr)), (recorded_where(recorded), (recorded or {}).get(s.flag))):
            value = s.parse(value)
            if value is not None and value != ():
                given[s.attr] = (value, src)
                break
    layer: Layer = {}
    for s in rows("sampling"):
        if s.attr in given:
            layer[s.attr] = given[s.attr]
        else:
            layer[s.attr] = (s.default, "default")
    # --samplers (names, sets a bit) / --sampling-seq (chars, sets no bit)
    if "samplers" in given:
        layer["samplers"] = (samplers_from_names(str(given["samplers"][0]).split(";")), given["samplers"][1])
    elif "sampling_seq" in given:
        layer["samplers"] = (samplers_from_chars(str(given["sampling_seq"][0])), given["sampling_seq"][1])
    else:
        layer["samplers"] = (DEFAULT_SAMPLERS, "default")
    # the model file, where the flag (bit) was not given
    if model_meta is not None:
        for s in rows("sampling"):
            if not s.gguf or s.attr in given:
                continue
            text = model_meta(s.gguf)
            if not text:
                continue
            if s.attr == "samplers":
                layer["samplers"] = (samplers_from_names(text.split(";")), "model file")
                continue
            value = _c_number(text, s.kind)
            if value is not None:
                layer[s.attr] = (value, "model file")
    # the server's own report of the merge, where `record` captured it
    reported = ((props or {}).get("default_generation_settings") or {}).get("params")
    if isinstance(reported, Mapping):
        for key, value in reported.items():
            if key not in _PROPS_KEYS or key in _NOT_IN_PROPS or value is None:
                continue
            attr = "samplers" if key == "samplers" else _PROPS_KEYS[key].attr
            ours = given.get(attr) or (given.get("sampling_seq") if attr == "samplers" else None)
            if ours is not None and ours[1] == "command line":
                continue  # the user says otherwise (--samplers or --sampling-seq)
            if key == "samplers":
                v = samplers_from_names(list(value))
            elif attr == "seed":
                v = int(value)
            else:
                v = _PROPS_KEYS[key].parse(value)
            if not _same(layer.get(attr, (None,))[0], v):  # where it agrees, the lower layer says why
                layer[attr] = (v, "/props")
    return layer


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to float32 precision (/props prints the server's floats widened)."""
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return a == b


# --- layer 4: the request ---------------------------------------------------------------------

# request field -> (attr, kind, clamp) as server-schema.cpp reads it; "hard" limits make the
# server refuse the request (a transcript cannot hold one), clamps are silent
_CLAMP: dict[str, tuple[float, float, bool]] = {
    "temp": (0.0, math.inf, False), "top_k": (0, INT32 - 1, False), "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, False), "xtc_probability": (0.0, 1.0, False), "xtc_threshold": (0.0, 1.0, False),
    "mirostat": (0, 2, False), "penalty_last_n": (0, INT32 - 1, True), "dry_allowed_length": (0, INT32 - 1, True),
    "dry_penalty_last_n": (0, INT32 - 1, True), "n_predict": (-1, INT32 - 1, True),
    "adaptive_decay": (0.0, 0.99, True), "adaptive_target": (-math.inf, 1.0, False),
}


def _request_number(body: Mapping, key: str, kind: str) -> float | int | None:
    """body[key] as the server's nlohmann get<int|float> reads it (booleans count as 0/1, floats are
    truncated to ints); null or absent: None; anything else is a TranscriptError naming the field."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise TranscriptError(f"\"{key}\" must be a number, got {str(v)[:20]}")
    if kind == "int":
        if not -INT32 <= v < INT32:
            raise TranscriptError(f"\"{key}\" must be a 32-bit integer, got {str(v)[:20]}")
        return int(v)
    return float(v)


def _first(body: Mapping, names: tuple[str, ...]) -> str | None:
    """The first of `names` present and not null (server-schema.cpp:585-588)."""
    return next((n for n in names if body.get(n) is not None), None)


def requested_n_probs(endpoint: str, body: Mapping) -> int:
    """How many alternatives the request asked for (tools/server/server-common.cpp:1472-1486,
    server-schema.cpp:179-181).

    /v1/chat/completions: `logprobs: true` means `top_logprobs` (20 when absent or not a number);
    a body n_probs is then ignored. Elsewhere `n_probs`, else its alias `logprobs`, where a
    JSON boolean counts as 0 or 1 (`"logprobs": true` on /completion asks for 1)."""
    if endpoint == "/v1/chat/completions":
        lp = body.get("logprobs")
        if lp is True:
            top = body.get("top_logprobs")
            return int(top) if isinstance(top, int) and not isinstance(top, bool) else 20
        if lp is False:
            body = {k: v for k, v in body.items() if k != "logprobs"} | {"logprobs": 0}
        elif lp is not None and not isinstance(lp, (int, float)):
            body = {k: v for k, v in body.items() if k != "logprobs"}
    key = _first(body, ("n_probs", "logprobs"))
    if key is None:
        return 0
    return max(int(_request_number(body, key, "int")), 0)


def parse_logit_bias(v: Any, *, cli: bool = False) -> list[tuple[Any, float]]:
    """A logit-bias list as the server reads it (server-schema.cpp:434-473): `[[tok|text, bias|false],
    ...]` or `{"tok"|"text": bias}`; false means -inf, `true` and other values skip the entry, ids
    are kept (the chain drops ids outside the vocabulary). With `cli`, -l's "TOKEN(+/-)BIAS" strings."""
    if cli:
        out = []
        for item in v:
            for sign in ("+", "-"):
                tok, sep, bias = item.partition(sign)
                if sep and tok.strip().isdigit():
                    try:
                        b = float(bias)
                    except ValueError:
                        raise TranscriptError(f"-l {item!r} is not TOKEN_ID(+/-)BIAS") from None
                    out.append((int(tok), b if sign == "+" else -b))
                    break
            else:
                raise TranscriptError(f"-l {item!r} is not TOKEN_ID(+/-)BIAS")
        return out
    if not v:
        return []
    if not isinstance(v, (list, dict)):
        raise TranscriptError("\"logit_bias\" must be a list of [token, bias] pairs or an object")
    out = []
    for item in (v.items() if isinstance(v, dict) else v):
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            continue  # skipped by the server
        tok, bias = item
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            continue
        if isinstance(v, dict):
            try:
                tok = int(tok)
            except ValueError:
                pass
        if isinstance(tok, bool) or not isinstance(tok, (int, str)):
            continue
        out.append((tok, float(bias)))
    return out


def _samplers_field(v: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    """The request's "samplers": a list of names, or a string of letters; other types are ignored."""
    if isinstance(v, list):
        if not all(isinstance(x, str) for x in v):
            raise TranscriptError("\"samplers\" must be a list of names")
        return samplers_from_names(v)
    if isinstance(v, str):
        return samplers_from_chars(v)
    return default


def _dry_base(body: Mapping, p: SamplingParams) -> Any:
    """A dry_base below 1 falls back to the server's (server-schema.cpp:142-147)."""
    v = _request_number(body, "dry_base", "float")
    return v if v >= 1.0 else None


def _dry_sequence_breakers(body: Mapping, p: SamplingParams) -> Any:
    b = body["dry_sequence_breakers"]
    if not (isinstance(b, list) and b and all(isinstance(x, str) for x in b)):
        raise TranscriptError("\"dry_sequence_breakers\" must be a non-empty list of strings")
    return tuple(b)


def _seed(body: Mapping, p: SamplingParams) -> Any:
    seed = body["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool) or not -1 <= seed < 2**32:
        raise TranscriptError(f"\"seed\" {str(seed)[:20]} is not a 32-bit seed")
    return seed & 0xFFFFFFFF


def _min_keep(body: Mapping, p: SamplingParams) -> Any:
    v = _request_number(body, "min_keep", "int")
    if v < 0:
        raise TranscriptError("\"min_keep\" must not be negative")
    return v


def _samplers(body: Mapping, p: SamplingParams) -> Any:
    """"samplers" counts as given when present at all: a null or another type keeps the server's
    chain, and is still the request's (server-schema.cpp)."""
    return _samplers_field(body["samplers"], p.samplers)


# request fields read by a rule of their own, not as a plain clamped number of the table
# (tools/server/server-schema.cpp): a rule runs when its field is given (not null; "samplers":
# present) and returns the value, or None to keep the server's
_OWN_RULES: dict[str, Callable[[Mapping, SamplingParams], Any]] = {
    "dry_base": _dry_base,
    "dry_sequence_breakers": _dry_sequence_breakers,
    "seed": _seed,
    "samplers": _samplers,
    "min_keep": _min_keep,
}
_GIVEN_WHEN_PRESENT = {"samplers"}
# request fields that are not sampling parameters, or that interact (read below)
_NOT_PARAMS = {"n_predict", "logit_bias", "antiprompt", "grammar", "json_schema", "ignore_eos"}


def effective(endpoint: str, body: Mapping, defaults: Layer, *, echo: Mapping | None = None) -> Effective:
    """The settings the server sampled `body` with (module docstring, layers 4 and 5): the server's
    defaults, then each request field by the table (numbers, clamped as the server clamps them) or
    by its own rule, then the fields that interact (logit bias and ignore_eos), the limits, and the
    server's echo where it was recorded."""
    p = SamplingParams()
    sources: dict[str, str] = {}
    for attr, (value, src) in defaults.items():
        if attr in ("samplers",) or hasattr(p, attr) and attr not in ("logit_bias", "ignore_eos"):
            setattr(p, attr, tuple(value) if isinstance(value, list) else value)
            sources[attr] = src
    p.seed &= 0xFFFFFFFF
    for s in rows("sampling"):
        if not s.request or s.attr in _NOT_PARAMS or s.attr in _OWN_RULES:
            continue
        key = _first(body, s.request)
        if key is not None:
            setattr(p, s.attr, _clamped(key, _request_number(body, key, s.kind), s.attr))
            sources[s.attr] = "request"
    for attr, rule in _OWN_RULES.items():
        if body.get(attr) is not None or (attr in _GIVEN_WHEN_PRESENT and attr in body):
            v = rule(body, p)
            if v is not None:
                setattr(p, attr, v)
                sources[attr] = "request"
    _logit_bias(body, defaults, p, sources)
    p.n_probs = requested_n_probs(endpoint, body)
    p.post_sampling_probs = bool(body.get("post_sampling_probs"))
    n_predict, sources["n_predict"] = _n_predict(body, defaults)
    stop, sources["stop"] = _stop(body, defaults)
    p.temp = widened(p.temp) if p.temp == p.temp else p.temp
    eff = Effective(p, n_predict, stop, None, sources)
    return reconcile(eff, echo) if echo else eff


def _clamped(key: str, v: float, attr: str) -> float:
    """A request number inside what the server takes: out-of-range values are clamped, or refused
    where the server refuses them (_CLAMP)."""
    lo, hi, hard = _CLAMP.get(attr, (-math.inf, math.inf, False))
    if lo <= v <= hi:
        return v
    if hard:
        raise TranscriptError(f"\"{key}\" {v} is outside what the server accepts ({lo} to {hi})")
    return min(max(v, lo), hi)


def _logit_bias(body: Mapping, defaults: Layer, p: SamplingParams, sources: dict[str, str]) -> None:
    """-l and --ignore-eos at the server; a request's list replaces both, and its ignore_eos adds the
    end-of-generation biases again (server-schema.cpp:434-485)."""
    p.logit_bias = parse_logit_bias(defaults["logit_bias"][0], cli=True)
    sources["logit_bias"] = defaults["logit_bias"][1]
    p.eog_bias = bool(defaults["ignore_eos"][0])
    sources["eog_bias"] = defaults["ignore_eos"][1]
    if body.get("logit_bias") is not None:
        p.logit_bias, p.eog_bias = parse_logit_bias(body["logit_bias"]), False
        sources["logit_bias"] = sources["eog_bias"] = "request"
    if body.get("ignore_eos") is True:
        p.eog_bias, sources["eog_bias"] = True, "request"


def _n_predict(body: Mapping, defaults: Layer) -> tuple[int, str]:
    """The request's n_predict (or max_tokens...), -1 keeping the server's -n (server-context.cpp:1950-1951)."""
    key = _first(body, BY_ATTR["n_predict"].request)
    if key is not None:
        v = _request_number(body, key, "int")
        if not -1 <= v < INT32:
            raise TranscriptError(f"\"{key}\" {v} is outside what the server accepts (-1 and up)")
        if v != -1:
            return v, "request"
    return defaults["n_predict"]


def _stop(body: Mapping, defaults: Layer) -> tuple[tuple[str, ...], str]:
    """The request's stop strings; an empty list falls back to the server's -r (server-schema.cpp:499-502)."""
    if body.get("stop") is not None:
        requested = body["stop"]
        requested = [requested] if isinstance(requested, str) else requested
        if not isinstance(requested, list) or not all(isinstance(x, str) for x in requested):
            raise TranscriptError("\"stop\" must be a string or a list of strings")
        if requested:
            return tuple(requested), "request"
    return tuple(defaults["antiprompt"][0] or ()), defaults["antiprompt"][1]


# --- layer 5: the server's own echo -----------------------------------------------------------

def check_echo(echo: Any) -> None:
    """Raise ValueError naming the field for an echo the server could not have sent."""
    if not isinstance(echo, Mapping):
        raise ValueError("\"generation_settings\" must be an object")

    def strings(key: str) -> None:
        v = echo.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ValueError(f"\"generation_settings.{key}\" must be a list of strings")

    for s in rows("sampling"):
        key = s.generation
        if not key or echo.get(key) is None:
            continue
        if s.attr in ("samplers", "antiprompt", "dry_sequence_breakers"):
            strings(key)
        elif s.attr == "logit_bias":
            if not isinstance(echo[key], list) or not all(isinstance(x, Mapping) for x in echo[key]):
                raise ValueError("\"generation_settings.logit_bias\" must be a list of objects")
        elif s.attr == "grammar":
            if not isinstance(echo[key], str):
                raise ValueError("\"generation_settings.grammar\" must be a string")
        else:
            try:
                s.parse(echo[key])
            except ValueError as e:
                raise ValueError(f"\"generation_settings.{key}\": {e}") from e
    if echo.get("generation_prompt") is not None and not isinstance(echo["generation_prompt"], str):
        raise ValueError("\"generation_settings.generation_prompt\" must be a string")
    triggers = echo.get("grammar_triggers")
    if triggers is not None:
        ok = isinstance(triggers, list) and all(
            isinstance(t, Mapping) and isinstance(t.get("type"), int) and isinstance(t.get("value", ""), str)
            and (t.get("token") is None or isinstance(t.get("token"), int)) for t in triggers)
        if not ok:
            raise ValueError("\"generation_settings.grammar_triggers\" must be a list of {type, value, token}")


def reconcile(eff: Effective, echo: Mapping) -> Effective:
    """Take the values the server echoed in generation_settings (task_params::to_json,
    server-task.cpp:95-144) where they differ from ours; say which, in a note."""
    p = replace(eff.params)
    sources = dict(eff.sources)
    differ = []
    for s in rows("sampling"):
        key = s.generation
        if not key or key not in echo or s.attr in ("antiprompt", "logit_bias", "grammar", "n_predict", "seed",
                                                     "ignore_eos"):
            continue
        value = echo[key]
        if s.attr == "samplers":
            theirs = samplers_from_names(list(value)) if isinstance(value, list) else p.samplers
        else:
            try:
                theirs = s.parse(value)
            except ValueError:
                continue
        ours = getattr(p, s.attr)
        same = tuple(ours) == tuple(theirs) if isinstance(ours, tuple) else \
            (ours == theirs or (isinstance(theirs, float) and widened(ours) == widened(theirs)))
        if not same:
            differ.append(f"{key} {ours!r} -> {theirs!r}")
            setattr(p, s.attr, tuple(theirs) if isinstance(theirs, list) else theirs)
            sources[s.attr] = "generation_settings"
    n_predict = eff.n_predict
    if isinstance(echo.get("n_predict"), int) and echo["n_predict"] != -1 and echo["n_predict"] != n_predict:
        differ.append(f"n_predict {n_predict} -> {echo['n_predict']}")
        n_predict, sources["n_predict"] = echo["n_predict"], "generation_settings"
    stop = eff.stop
    if isinstance(echo.get("stop"), list) and tuple(echo["stop"]) != stop and \
            all(isinstance(x, str) for x in echo["stop"]):
        differ.append(f"stop {list(stop)} -> {echo['stop']}")
        stop, sources["stop"] = tuple(echo["stop"]), "generation_settings"
    notes = eff.notes
    if differ:
        notes += ("the server's generation_settings differ from the settings computed from its flags, model "
                  "file and the request; the server's are used: " + "; ".join(differ),)
    return Effective(p, n_predict, stop, eff.grammar, sources, notes)
