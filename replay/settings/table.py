"""llama-server's settings that change what a replay must do, one row each.

Every command that takes server flags builds its options from this table (cli/options.py), the
config objects are generated from it (settings/config.py, settings/sampling.py), `record` writes
the transcript's `server.flags` from it, and the test harness starts servers with it
(llamacpp/process.py). A setting is spelled exactly as llama-server spells it: the first flag
is the long name of `common/arg.cpp` (b11434), the aliases are the other names it accepts there.

Columns:

    flag, aliases   as in common/arg.cpp's common_arg({...}) (line cited in `source`)
    attr            the Python name of the value (common_params' field name where there is one)
    group           "speculative" | "context" | "sampling"   (the config object it belongs to)
    kind            int | float | choice | path | str | flag (no value) | list (comma-separated or
                    repeated, like --spec-type) | strings (repeated, each kept whole, like -r)
    default         llama-server's built-in default (common/common.h); the same in every build
                    spec-replay replays (builds/loop_shapes.py), which `since` says have the flag
    transcript      the key of the older `server.speculative` block of transcripts recorded before
                    `server.flags` ("ngram.mod-n-match" is the key "mod-n-match" of its "ngram" object)
    props           where a running server reports it: a dotted path in GET /props
    generation      the key under which /completion's `generation_settings` (and
                    /props' default_generation_settings.params) echo it
    request         the request fields that override it, in the server's precedence order
                    (tools/server/server-schema.cpp: the first present and non-null wins)
    gguf            the model file's key that supplies it when the flag was not given
                    (common/common.cpp:1087-1146, only for flags with `user_bit`)
    user_bit        giving the flag sets its bit in user_sampling_config, so the model file's key
                    no longer applies (common/arg.cpp; --sampling-seq sets none)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from replay.settings.cache_types import GGML_CACHE_TYPES

# common/speculative.cpp: common_speculative_all_types_str (b11434); replay support in loop/replayable.py
SPEC_TYPES = ("none", "draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
              "draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark")  # speculative.cpp:72-84
KV_CACHE_TYPES = tuple(GGML_CACHE_TYPES)  # common/arg.cpp:304-314, one table with their ggml ids


@dataclass(frozen=True)
class Setting:
    """One llama-server flag (see the module docstring for the columns)."""

    flag: str
    attr: str
    group: str
    kind: str
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    transcript: str | None = None
    props: str | None = None
    generation: str | None = None
    since: int | None = None  # the first build that has the flag (builds/loop_shapes.py), None: every known build
    request: tuple[str, ...] = ()
    gguf: str | None = None
    user_bit: bool = False
    source: str = ""  # common/arg.cpp line (b11434)
    pattern: str | None = None  # a str value must match this (fullmatch), as llama-server's parser requires

    @property
    def names(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)

    def parse(self, value: Any) -> Any:
        """A value as llama-server would take it on its command line (strings from the shell or a
        transcript, or already-typed values); raises ValueError naming the flag."""
        if value is None:
            return None
        if self.kind in ("int", "float"):
            return self._number(value)
        if self.kind == "flag":
            if not isinstance(value, bool):
                raise ValueError(f"{self.flag} takes no value, got {value!r}")
            return value
        if self.kind == "strings":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
                raise ValueError(f"{self.flag}: cannot read {value!r}")
            return tuple(items)
        if self.kind == "list":
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise ValueError(f"{self.flag}: cannot read {value!r}")
            out = tuple(str(x).strip() for x in items if str(x).strip())
            bad = [x for x in out if self.choices and x not in self.choices]
            if bad:
                raise ValueError(f"{self.flag}: unknown value {bad[0]!r} (llama-server takes "
                                 f"{', '.join(self.choices or ())})")
            return out
        if self.pattern is not None and not re.fullmatch(self.pattern, str(value)):
            raise ValueError(f"{self.flag}: cannot read {value!r}")
        if self.kind == "choice" and str(value) not in (self.choices or ()):
            raise ValueError(f"{self.flag}: {value!r} is not one of {', '.join(self.choices or ())}")
        return str(value)

    def _number(self, value: Any) -> int | float:
        what = "an integer" if self.kind == "int" else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{self.flag} takes {what}, got {value!r}")
        try:
            x = float(value)
            if self.kind == "int":
                if not x.is_integer():
                    raise ValueError
                return int(value) if not isinstance(value, float) else int(x)
            if x != x or x in (float("inf"), float("-inf")):
                raise ValueError
            return x
        except ValueError:
            raise ValueError(f"{self.flag} takes {what}, got {value!r}") from None


def _smp(flag: str, attr: str, kind: str, default: Any, help: str, *, gguf: str | None = None, bit: bool = False,
         echo: str | None | bool = True, **kw) -> Setting:
    """A sampling row: echoed under its own name unless `echo` says otherwise (None: not echoed)."""
    generation = attr if echo is True else echo
    return Setting(flag, attr, "sampling", kind, default, help, gguf=f"general.sampling.{gguf}" if gguf else None,
                   user_bit=bit, generation=generation, **kw)


def _spec(flag: str, attr: str, kind: str, default: Any, help: str, *, ngram: str | None = None, **kw) -> Setting:
    return Setting(flag, attr, "speculative", kind, default, help,
                   transcript=kw.pop("transcript", None) or (f"ngram.{ngram}" if ngram else attr), **kw)


SETTINGS: tuple[Setting, ...] = (
    # --- speculative decoding (common/arg.cpp:4150-4400, common/common.h:326-372) -------------------
    _spec("--spec-type", "spec_types", "list", (), "speculative types, comma-separated or repeated",
          choices=SPEC_TYPES, metavar="TYPE[,TYPE]", transcript="types", generation="speculative.types",
          source="common/arg.cpp:4274"),
    _spec("--spec-draft-model", "draft_model", "path", None, "draft model for draft-simple",
          aliases=("-md", "--model-draft"), metavar="FNAME", source="common/arg.cpp:4266"),
    _spec("--spec-draft-type-k", "draft_cache_type_k", "choice", "f16", "KV cache type for K of the draft model",
          aliases=("-ctkd", "--cache-type-k-draft"), choices=KV_CACHE_TYPES, source="common/arg.cpp:4100"),
    _spec("--spec-draft-type-v", "draft_cache_type_v", "choice", "f16", "KV cache type for V of the draft model",
          aliases=("-ctvd", "--cache-type-v-draft"), choices=KV_CACHE_TYPES, source="common/arg.cpp:4113"),
    _spec("--spec-draft-threads", "draft_threads", "int", -1,
          "threads of the draft model's decodes (not given: the target's -t). Past 256 positions a one-token "
          "decode splits its KV sum by thread, so the count moves the draft's values and can move its drafts; "
          "0 or less given: the server machine's cores (give the count)",
          aliases=("-td", "--threads-draft"), metavar="N", source="common/arg.cpp:3992"),
    _spec("--spec-draft-n-max", "draft_n_max", "int", 3, "tokens to draft per step (draft-simple)",
          metavar="N", source="common/arg.cpp:4150"),
    _spec("--spec-draft-n-min", "draft_n_min", "int", 0, "minimum draft length, shorter drafts are dropped",
          metavar="N", source="common/arg.cpp:4160"),
    _spec("--spec-draft-p-min", "draft_p_min", "float", 0.0, "stop drafting below this draft probability",
          aliases=("--draft-p-min",), metavar="P", source="common/arg.cpp:4207"),
    _spec("--spec-draft-sampling", "draft_sampling", "choice", "greedy",
          "greedy: the draft's argmax, verified by sample-and-match; probabilistic: sampled, verified by "
          "rejection", choices=("greedy", "probabilistic"), since=11368, source="common/arg.cpp:4223"),
    _spec("--spec-ngram-simple-size-n", "ngram_simple_size_n", "int", 12, "ngram-simple lookup length",
          ngram="simple-size-n", metavar="N", source="common/arg.cpp:4315"),
    _spec("--spec-ngram-simple-size-m", "ngram_simple_size_m", "int", 48, "ngram-simple draft length",
          ngram="simple-size-m", metavar="N", source="common/arg.cpp:4325"),
    _spec("--spec-ngram-simple-min-hits", "ngram_simple_min_hits", "int", 1,
          "accepted for completeness: ngram-simple drafting never reads it (common/ngram-map.cpp:49-112)",
          ngram="simple-min-hits", metavar="N", source="common/arg.cpp:4335"),
    _spec("--spec-ngram-map-k-size-n", "ngram_map_k_size_n", "int", 12, "ngram-map-k key length",
          ngram="map-k-size-n", metavar="N", source="common/arg.cpp:4346"),
    _spec("--spec-ngram-map-k-size-m", "ngram_map_k_size_m", "int", 48, "ngram-map-k draft length",
          ngram="map-k-size-m", metavar="N", source="common/arg.cpp:4356"),
    _spec("--spec-ngram-map-k-min-hits", "ngram_map_k_min_hits", "int", 1, "ngram-map-k minimum hits",
          ngram="map-k-min-hits", metavar="N", source="common/arg.cpp:4366"),
    _spec("--spec-ngram-map-k4v-size-n", "ngram_map_k4v_size_n", "int", 12, "ngram-map-k4v key length",
          ngram="map-k4v-size-n", metavar="N", source="common/arg.cpp:4377"),
    _spec("--spec-ngram-map-k4v-size-m", "ngram_map_k4v_size_m", "int", 48, "ngram-map-k4v draft length",
          ngram="map-k4v-size-m", metavar="N", source="common/arg.cpp:4387"),
    _spec("--spec-ngram-map-k4v-min-hits", "ngram_map_k4v_min_hits", "int", 1, "ngram-map-k4v minimum hits",
          ngram="map-k4v-min-hits", metavar="N", source="common/arg.cpp:4397"),
    _spec("--spec-ngram-mod-n-match", "ngram_mod_n_match", "int", 24, "ngram-mod lookup length",
          ngram="mod-n-match", metavar="N", source="common/arg.cpp:4304"),
    _spec("--spec-ngram-mod-n-max", "ngram_mod_n_max", "int", 64, "ngram-mod maximum draft length",
          ngram="mod-n-max", metavar="N", source="common/arg.cpp:4294"),
    _spec("--spec-ngram-mod-n-min", "ngram_mod_n_min", "int", 48, "ngram-mod minimum draft length",
          ngram="mod-n-min", metavar="N", source="common/arg.cpp:4284"),

    # --- context: what changes the numerics or the loop's limits (common/common.h:454-504) -----------
    Setting("--ctx-size", "n_ctx", "context", "int", 0,
            "context size (0: the model's; a replay then takes the transcript's /props n_ctx, else 2048)",
            aliases=("-c",), metavar="N", transcript="n_ctx", props="default_generation_settings.n_ctx",
            source="common/arg.cpp:1642"),
    Setting("--batch-size", "n_batch", "context", "int", 2048, "logical batch size (prompt batches)",
            aliases=("-b",), metavar="N", transcript="n_batch", source="common/arg.cpp:1672"),
    Setting("--ubatch-size", "n_ubatch", "context", "int", 512, "physical batch size (ubatches)",
            aliases=("-ub",), metavar="N", transcript="n_ubatch", source="common/arg.cpp:1679"),
    Setting("--flash-attn", "flash_attn", "context", "choice", "auto", "flash attention",
            aliases=("-fa",), choices=("on", "off", "auto"), transcript="flash_attn",
            source="common/arg.cpp:1757"),
    Setting("--cache-type-k", "cache_type_k", "context", "choice", "f16", "KV cache type for K",
            aliases=("-ctk",), choices=KV_CACHE_TYPES, transcript="cache_type_k", source="common/arg.cpp:2440"),
    Setting("--cache-type-v", "cache_type_v", "context", "choice", "f16", "KV cache type for V",
            aliases=("-ctv",), choices=KV_CACHE_TYPES, transcript="cache_type_v", source="common/arg.cpp:2453"),
    Setting("--swa-full", "swa_full", "context", "flag", False,
            "full-size KV cache for sliding-window attention layers (changes which cells SWA layers read)",
            transcript="swa_full", source="common/arg.cpp:1693"),
    Setting("--ctx-checkpoints", "n_ctx_checkpoints", "context", "int", 32,
            "context checkpoints kept per slot (0: none). A sliding-window, recurrent or hybrid target is then "
            "cut into other prompt batches (schedule/prompt.py)", aliases=("-ctxcp", "--swa-checkpoints"),
            metavar="N", transcript="n_ctx_checkpoints", source="common/arg.cpp:1701"),
    Setting("--checkpoint-min-step", "checkpoint_min_step", "context", "int", 8192,
            "minimum spacing between context checkpoints in tokens (user-message cuts of chat prompts)",
            aliases=("-cms",), metavar="N", transcript="checkpoint_min_step", source="common/arg.cpp:1709"),
    Setting("--kv-unified", "kv_unified", "context", "flag", False,
            "one KV buffer for all slots (default with -np auto); sizes the sliding-window cache for every slot",
            aliases=("-kvu",), transcript="kv_unified", source="common/arg.cpp:1727"),
    Setting("--cache-ram", "cache_ram_mib", "context", "int", 8192,
            "the host prompt cache in MiB (0: none). With 0 (or --no-cache-idle-slots) a unified cache keeps idle "
            "slots' cells, which widen the KV view of every later decode (settings/config.py idle_cells_kept)",
            aliases=("-cram",), metavar="N", transcript="cache_ram_mib", source="common/arg.cpp:1719"),
    Setting("--no-cache-idle-slots", "no_cache_idle_slots", "context", "flag", False,
            "idle slots are not saved and cleared when a task starts: on a unified cache their cells stay and "
            "widen the KV view of later decodes", transcript="no_cache_idle_slots", source="common/arg.cpp:1735"),
    Setting("--gpu-layers", "n_gpu_layers", "context", "str", "auto",
            "layers offloaded to a GPU: N, auto or all. The server's: with a GPU its values come from other "
            "kernels than a CPU replay's (judged like batching, see recover). A replay offloads the same "
            "layers when its llama-cpp-python was built with GPU support",
            aliases=("-ngl", "--n-gpu-layers"), metavar="N", transcript="n_gpu_layers", pattern=r"auto|all|-?[0-9]+",
            source="common/arg.cpp:2792"),
    Setting("--device", "devices", "context", "str", None,
            "devices the server offloaded to (comma-separated, none = CPU only); a device other than the "
            "CPU means other kernels than a CPU replay's", aliases=("-dev",), metavar="<dev1,dev2,..>",
            transcript="device", source="common/arg.cpp:2741"),
    Setting("--no-repack", "no_repack", "context", "flag", False,
            "no extra buffer types when loading the model: neither the CPU repack of Q4_0/Q4_K/IQ4_NL/Q8_0 weights "
            "nor AMX; changes the kernels, so the values (llama-server's --repack is the default)",
            aliases=("-nr",), transcript="no_repack", source="common/arg.cpp:2425"),
    Setting("--special", "special", "context", "flag", False,
            "special tokens output enabled: a control token's piece (<|im_end|>) is sent as text in `token`, "
            "`bytes` and top_logprobs; without it the server sends it empty (tools/server/server-context.cpp:2124), "
            "as the repaired entries then do", aliases=("-sp",), transcript="special", source="common/arg.cpp:1898"),
    Setting("--no-host", "no_host", "context", "flag", False,
            "bypass the host buffer so extra buffer types can be used (changes where weights live, so kernels)",
            transcript="no_host", source="common/arg.cpp:2433"),
    Setting("--threads", "threads", "context", "int", -1,
            "CPU threads of one-token decodes (-1: all cores); past 256 positions they change values "
            "(flash attention splits the KV by thread): the replay decodes with the server's, 2 when unknown", aliases=("-t",), metavar="N",
            transcript="threads", source="common/arg.cpp:1520"),
    Setting("--parallel", "n_parallel", "context", "int", -1, "server slots (-1: auto, 4 with a unified KV cache)",
            aliases=("-np",), metavar="N", transcript="n_parallel", props="total_slots",
            source="common/arg.cpp:2547"),

    # --- sampling: the defaults every request starts from (common/common.h:227-300); a request field
    # overrides them, the model file's general.sampling.* keys supply those whose flag was not given
    _smp("--temp", "temp", "float", 0.8, "temperature", aliases=("--temperature",), request=("temperature",),
         gguf="temp", bit=True, echo="temperature", source="common/arg.cpp:2018"),
    _smp("--top-k", "top_k", "int", 40, "top-k sampling (0: off)", request=("top_k",), gguf="top_k", bit=True,
         source="common/arg.cpp:2027"),
    _smp("--top-p", "top_p", "float", 0.95, "top-p sampling (1.0: off)", request=("top_p",), gguf="top_p", bit=True,
         source="common/arg.cpp:2035"),
    _smp("--min-p", "min_p", "float", 0.05, "min-p sampling (0.0: off)", request=("min_p",), gguf="min_p", bit=True,
         source="common/arg.cpp:2043"),
    _smp("--top-nsigma", "top_n_sigma", "float", -1.0, "top-n-sigma sampling (-1: off)",
         aliases=("--top-n-sigma",), request=("top_n_sigma",), source="common/arg.cpp:2051"),
    _smp("--xtc-probability", "xtc_probability", "float", 0.0, "xtc probability (0.0: off)",
         request=("xtc_probability",), gguf="xtc_probability", bit=True, source="common/arg.cpp:2058"),
    _smp("--xtc-threshold", "xtc_threshold", "float", 0.1, "xtc threshold", request=("xtc_threshold",),
         gguf="xtc_threshold", bit=True, source="common/arg.cpp:2066"),
    _smp("--typical", "typ_p", "float", 1.0, "locally typical sampling (1.0: off)", aliases=("--typical-p",),
         request=("typical_p",), echo="typical_p", source="common/arg.cpp:2074"),
    _smp("--repeat-last-n", "penalty_last_n", "int", 64, "last n tokens the repeat penalty sees",
         request=("repeat_last_n",), gguf="penalty_last_n", bit=True, echo="repeat_last_n",
         source="common/arg.cpp:2081"),
    _smp("--repeat-penalty", "penalty_repeat", "float", 1.0, "repeat penalty (1.0: off)",
         request=("repeat_penalty",), gguf="penalty_repeat", bit=True, echo="repeat_penalty",
         source="common/arg.cpp:2093"),
    _smp("--presence-penalty", "penalty_present", "float", 0.0, "presence penalty",
         request=("presence_penalty",), echo="presence_penalty", source="common/arg.cpp:2107"),
    _smp("--frequency-penalty", "penalty_freq", "float", 0.0, "frequency penalty",
         request=("frequency_penalty",), echo="frequency_penalty", source="common/arg.cpp:2118"),
    _smp("--dry-multiplier", "dry_multiplier", "float", 0.0, "DRY multiplier (0.0: off)",
         request=("dry_multiplier",), source="common/arg.cpp:2129"),
    _smp("--dry-base", "dry_base", "float", 1.75, "DRY base (values below 1 are ignored)", request=("dry_base",),
         source="common/arg.cpp:2136"),
    _smp("--dry-allowed-length", "dry_allowed_length", "int", 2, "DRY allowed length",
         request=("dry_allowed_length",), source="common/arg.cpp:2147"),
    _smp("--dry-penalty-last-n", "dry_penalty_last_n", "int", 64, "DRY penalty window",
         request=("dry_penalty_last_n",), source="common/arg.cpp:2154"),
    _smp("--dry-sequence-breaker", "dry_sequence_breakers", "strings", ("\n", ":", "\"", "*"),
         "a DRY sequence breaker (repeatable; the first one replaces the defaults, 'none' clears them)",
         request=("dry_sequence_breakers",), source="common/arg.cpp:2164"),
    _smp("--dynatemp-range", "dynatemp_range", "float", 0.0, "dynamic temperature range (0.0: off)",
         request=("dynatemp_range",), source="common/arg.cpp:2210"),
    _smp("--dynatemp-exp", "dynatemp_exponent", "float", 1.0, "dynamic temperature exponent",
         request=("dynatemp_exponent",), source="common/arg.cpp:2217"),
    _smp("--mirostat", "mirostat", "int", 0, "mirostat (0: off, 1, 2)", request=("mirostat",), gguf="mirostat",
         bit=True, source="common/arg.cpp:2224"),
    _smp("--mirostat-lr", "mirostat_eta", "float", 0.1, "mirostat learning rate (eta)", request=("mirostat_eta",),
         gguf="mirostat_eta", bit=True, source="common/arg.cpp:2233"),
    _smp("--mirostat-ent", "mirostat_tau", "float", 5.0, "mirostat target entropy (tau)",
         request=("mirostat_tau",), gguf="mirostat_tau", bit=True, source="common/arg.cpp:2241"),
    _smp("--adaptive-target", "adaptive_target", "float", -1.0, "adaptive-p target", request=("adaptive_target",),
         source="common/arg.cpp:2190"),
    _smp("--adaptive-decay", "adaptive_decay", "float", 0.9, "adaptive-p decay", request=("adaptive_decay",),
         source="common/arg.cpp:2200"),
    _smp("--samplers", "samplers", "str", "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature",
         "the sampler chain, names separated by ';'", request=("samplers",), gguf="sequence", bit=True,
         source="common/arg.cpp:1988"),
    _smp("--sampling-seq", "sampling_seq", "str", "edskypmxt",
         "the sampler chain as one letter per sampler (sets no user bit: a model file's sequence wins)",
         aliases=("--sampler-seq",), echo=None, source="common/arg.cpp:2004"),
    _smp("--seed", "seed", "int", -1, "RNG seed (-1: random)", aliases=("-s",), request=("seed",),
         source="common/arg.cpp:1997"),
    _smp("--predict", "n_predict", "int", -1, "tokens to predict when a request does not say (-1: no limit)",
         aliases=("--n-predict", "-n"), request=("n_predict", "max_completion_tokens", "max_tokens"),
         source="common/arg.cpp:1661"),
    _smp("--ignore-eos", "ignore_eos", "flag", False, "never sample end-of-generation tokens",
         request=("ignore_eos",), source="common/arg.cpp:2011"),
    _smp("--logit-bias", "logit_bias", "strings", (), "TOKEN_ID(+/-)BIAS, repeatable (e.g. 15043+1, 15043-inf)",
         aliases=("-l",), request=("logit_bias",), source="common/arg.cpp:2249"),
    _smp("--reverse-prompt", "antiprompt", "strings", (), "stop string used when a request gives none (repeatable)",
         aliases=("-r",), request=("stop",), echo="stop", source="common/arg.cpp:1891"),
    _smp("--grammar", "grammar", "str", None, "a GBNF grammar every request starts with", request=("grammar",),
         source="common/arg.cpp:2271"),
    _smp("--grammar-file", "grammar_file", "path", None, "a file holding that grammar", echo=None,
         source="common/arg.cpp:2278"),
    _smp("--json-schema", "json_schema", "str", None, "a JSON schema every request starts with", aliases=("-j",),
         request=("json_schema",), echo=None, source="common/arg.cpp:2285"),
    _smp("--json-schema-file", "json_schema_file", "path", None, "a file holding that schema", aliases=("-jf",),
         echo=None, source="common/arg.cpp:2292"),
)

GROUPS = ("speculative", "context", "sampling")
BY_ATTR: dict[str, Setting] = {s.attr: s for s in SETTINGS}
BY_FLAG: dict[str, Setting] = {n: s for s in SETTINGS for n in s.names}


def rows(*groups: str) -> tuple[Setting, ...]:
    """The settings of `groups`, in table order."""
    unknown = set(groups) - set(GROUPS)
    assert not unknown, f"unknown settings group(s) {unknown}"
    return tuple(s for s in SETTINGS if s.group in groups)


@dataclass(frozen=True)
class Unreplayed:
    """A llama-server flag (or request field) the replay does not reproduce: what it changes, whether
    recover is unaffected (it needs only the target's values of the tokens the server emitted, not the
    loop's choices), and the values that change nothing (its default) and pass."""

    name: str
    why: str
    recover_ok: bool
    inert: tuple = ()
    aliases: tuple[str, ...] = ()
    source: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def refuses(self, value: Any, command: str) -> bool:
        """Does `command` ("recover" or "trace") refuse this flag or field set to `value`?

        >>> UNREPLAYED_FLAGS["--cache-reuse"].refuses(0, "recover"), UNREPLAYED_FLAGS["--cache-reuse"].refuses("256", "recover")
        (False, True)
        >>> UNREPLAYED_FIELDS["n_indent"].refuses(4, "recover"), UNREPLAYED_FIELDS["n_indent"].refuses(4, "trace")
        (False, True)
        """
        if value is None or value in self.inert or str(value) in map(str, self.inert):
            return False
        return command == "trace" or not self.recover_ok


_NOT_SAMPLED_HERE = "sampling runs as a ggml graph on the backend (experimental), not through the CPU sampler chain"
UNREPLAYED_FLAGS: dict[str, Unreplayed] = {u.name: u for u in (
    Unreplayed("--cache-reuse", "reuses chunks of earlier prompts' KV by shifting them (n_cache_reuse), so "
               "timings.cache_n no longer means a kept prefix and the prompt's KV is not one the replay builds",
               recover_ok=False, inert=(0,), source="common/arg.cpp:3592"),
    Unreplayed("--lora", "applies a LoRA adapter to the target: its values are not the model file's",
               recover_ok=False, source="common/arg.cpp:2958"),
    Unreplayed("--lora-scaled", "applies scaled LoRA adapters to the target: its values are not the model file's",
               recover_ok=False, source="common/arg.cpp:2968"),
    Unreplayed("--override-kv", "overrides the model file's metadata (hyperparameters, tokenizer, sampling keys)",
               recover_ok=False, source="common/arg.cpp:2938"),
    Unreplayed("--reasoning-budget", "the reasoning-budget sampler forces the end of thinking after N tokens",
               recover_ok=False, inert=(-1,), source="common/arg.cpp:3730"),
    Unreplayed("--backend-sampling", _NOT_SAMPLED_HERE, recover_ok=False, inert=(False,), aliases=("-bs",),
               source="common/arg.cpp:2309"),
    Unreplayed("--spec-synth-len", "accepts drafts at random for benchmarking (server_sample_and_accept_synth): "
               "the loop's choices are not the rejection rule's", recover_ok=True, source="common/arg.cpp:4167"),
    Unreplayed("--spec-synth-rates", "accepts drafts at random for benchmarking (server_sample_and_accept_synth): "
               "the loop's choices are not the rejection rule's", recover_ok=True, source="common/arg.cpp:4180"),
    Unreplayed("--no-spec-draft-backend-sampling", "samples the draft on the host instead of the backend (the "
               "default, which trace replays)", recover_ok=True, inert=(False,), source="common/arg.cpp:4215"),
)}
UNREPLAYED_FIELDS: dict[str, Unreplayed] = {u.name: u for u in (
    Unreplayed("t_max_predict_ms", "stops generation after a wall-clock limit", recover_ok=True, inert=(0, -1),
               source="tools/server/server-schema.cpp:74"),
    Unreplayed("n_indent", "stops at a line indented less than n_indent", recover_ok=True, inert=(0,),
               source="tools/server/server-schema.cpp:50"),
    Unreplayed("backend_sampling", _NOT_SAMPLED_HERE, recover_ok=False, inert=(False,),
               source="tools/server/server-schema.cpp:187"),
)}
UNREPLAYED_BY_FLAG: dict[str, Unreplayed] = {n: u for u in UNREPLAYED_FLAGS.values() for n in u.names}
# flags that change how a chat request is rendered: kept as recorded, and judged where a chat prompt is
# rebuilt from its messages (tokens/prompt_ids.py); recorded prompt_tokens make them irrelevant
CHAT_TEMPLATE_FLAGS = ("--chat-template", "--chat-template-file", "--chat-template-kwargs", "--jinja", "--no-jinja")


def unreplayed(recorded: Mapping | None, request: Mapping | None, command: str) -> str | None:
    """The first recorded server flag or request field that `command` cannot reproduce, as a one-line
    reason naming it, or None.

    >>> print(unreplayed({"--lora": "a.gguf"}, {}, "recover"))
    --lora a.gguf: applies a LoRA adapter to the target: its values are not the model file's; not replayed
    >>> unreplayed({"--spec-synth-len": "3"}, {"t_max_predict_ms": 500}, "recover") is None
    True
    >>> print(unreplayed({}, {"t_max_predict_ms": 500}, "trace"))
    "t_max_predict_ms": 500 in the request: stops generation after a wall-clock limit; not replayed by trace (recover is unaffected)
    """
    for name, value in (recorded or {}).items():
        u = UNREPLAYED_BY_FLAG.get(name)
        if u is not None and u.refuses(value, command):
            shown = "" if value is True else f" {value}"
            return f"{name}{shown}: {u.why}; not replayed" + (" by trace (recover is unaffected)" if u.recover_ok else "")
    for name, u in UNREPLAYED_FIELDS.items():
        value = (request or {}).get(name)
        if u.refuses(value, command):
            return (f"\"{name}\": {value!r} in the request: {u.why}; not replayed"
                    + (" by trace (recover is unaffected)" if u.recover_ok else ""))
    return None


class RecordedFlags(dict):
    """A transcript's server flags by flag name, and the block they were read from (`where`: what a
    setting's source is called, "server.flags" or the legacy "server.speculative")."""

    def __init__(self, *args: Any, where: str = "server.flags", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.where = where


def recorded_where(recorded: Mapping | None) -> str:
    """The source name of values read from `recorded` (RecordedFlags.where; a plain mapping: server.flags)."""
    return getattr(recorded, "where", "server.flags")
