"""llama-cpp-python's ctypes binding, loaded over the libllama the replay should evaluate with.

By default that is the libllama llama-cpp-python ships (its vendored llama.cpp, 0c1e570 = b11311).
A server built from another llama.cpp build computes with that build's ggml kernels; a draft model's
argmax at a near-tie, or the last bits of a logprob, follow those kernels. Replaying on the build's
own libllama (the shared library our CMakeLists.txt builds beside llama-server) makes the replay
bit-exact there too.

The binding declares every function of its own llama.h at import (llama_cpp/llama_cpp.py:
`ctypes_function` looks each symbol up), and loads `$LLAMA_CPP_LIB_PATH/libllama.so` when that is
set (llama_cpp/llama_cpp.py:36-43). An older libllama lacks the newest symbols (b10705: llama_process,
llama_batch_ext_*, ...): those become functions that raise if called. What the replay does call must
have the binding's ABI; `abi_differences` checks that against the build's own include/llama.h before
the library is loaded: each struct the replay passes by value or pointer has the binding's fields in
the binding's order and sizes, each function the replay calls takes as many arguments.

Everything in the package reaches libllama through `L` below, which imports the binding on first
use. `use_libllama` (and `use_cpu_variant`) must be called before that: a run's engine does it once
(runtime/engine.py EngineChoice.apply), in the driver and in every worker it starts, from the value the
worker is given. Only a process that was told nothing (the health probe's, which gets it in its
environment: runtime/health.py) reads SPEC_REPLAY_LIBLLAMA and SPEC_REPLAY_CPU_VARIANT.
"""
from __future__ import annotations

import ctypes
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path

from replay.errors import BindingError
from replay.runtime import health as _health
from replay.runtime.health import LIB_ENV as ENV
from replay.runtime.health import VARIANT_ENV  # which libggml-cpu-<variant>.so of a release-style build to load

# What the replay passes to libllama: structs (by value or through pointers) ...
STRUCTS = ("llama_model_params", "llama_context_params", "llama_batch", "llama_token_data",
           "llama_token_data_array", "llama_sampler_chain_params", "llama_logit_bias")
# ... and functions (tests/test_binding.py checks this covers every `L.llama_*(` call in replay/).
FUNCTIONS = (
    "llama_backend_init", "llama_log_set", "llama_supports_gpu_offload",
    "llama_model_default_params", "llama_model_load_from_file", "llama_model_free", "llama_model_get_vocab",
    "llama_model_meta_val_str", "llama_model_chat_template", "llama_model_desc", "llama_model_size",
    "llama_model_n_params",
    "llama_context_default_params", "llama_init_from_model", "llama_free", "llama_n_ctx", "llama_n_ubatch",
    "llama_decode", "llama_set_n_threads", "llama_get_logits_ith", "llama_get_memory", "llama_memory_clear", "llama_memory_seq_rm",
    "llama_memory_seq_pos_min", "llama_memory_seq_pos_max", "llama_model_n_swa",
    "llama_batch_init", "llama_batch_free",
    "llama_state_seq_get_size_ext", "llama_state_seq_get_data_ext", "llama_state_seq_set_data_ext",
    "llama_tokenize", "llama_token_to_piece", "llama_vocab_n_tokens", "llama_vocab_type", "llama_vocab_get_text",
    "llama_vocab_is_eog", "llama_vocab_bos", "llama_vocab_eos", "llama_vocab_get_add_bos",
    "llama_vocab_get_suppress_tokens",
    "llama_sampler_chain_default_params", "llama_sampler_chain_init", "llama_sampler_chain_add",
    "llama_sampler_free", "llama_sampler_clone", "llama_sampler_apply", "llama_sampler_accept",
    "llama_sampler_init_temp", "llama_sampler_init_temp_ext", "llama_sampler_init_top_k", "llama_sampler_init_top_p",
    "llama_sampler_init_min_p", "llama_sampler_init_typical", "llama_sampler_init_xtc",
    "llama_sampler_init_top_n_sigma", "llama_sampler_init_penalties", "llama_sampler_init_dry",
    "llama_sampler_init_mirostat", "llama_sampler_init_mirostat_v2", "llama_sampler_init_logit_bias",
    "llama_sampler_init_grammar", "llama_sampler_init_grammar_lazy_patterns", "llama_sampler_init_infill",
    "llama_sampler_init_dist", "llama_sampler_init_adaptive_p",
)
# ... and those only MTP drafting calls (the extended batch, llama_process, the nextn layer count): from
# b11434's llama.h, absent from older builds, which therefore load and fail only where MTP is asked of
# them (a BindingError naming the function); tests/test_binding.py checks this list too
MTP_FUNCTIONS = (
    "llama_batch_ext_init", "llama_batch_ext_free", "llama_batch_ext_clear", "llama_batch_ext_add_token",
    "llama_batch_ext_set_pos", "llama_batch_ext_set_embd_token", "llama_batch_ext_set_output_logits",
    "llama_process", "llama_model_n_layer_nextn", "llama_model_n_embd_out", "llama_n_rs_seq",
)


@dataclass(frozen=True)
class LibChoice:
    """Which libllama to evaluate with: `path` None is the binding's own; `why` for the report line."""

    path: Path | None
    why: str
    header: Path | None = None
    warning: str | None = None  # a library was found but cannot be used
    hint: str | None = None  # how to make the build's own library available

    def describe(self) -> str:
        what = str(self.path) if self.path else "llama-cpp-python's own (llama.cpp 0c1e570 = b11311)"
        return f"{what}, chosen by {self.why}"


# --- reading a llama.h ------------------------------------------------------------------------------

def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_structs(text: str) -> dict[str, list[str]]:
    """{struct name: its field names in order} of a llama.h (typedef'd or not; a function-pointer
    field is named by its pointer)."""
    out: dict[str, list[str]] = {}
    for name, body in re.findall(r"struct\s+(\w+)\s*\{(.*?)\}\s*\w*\s*;", _strip_comments(text), flags=re.S):
        fields = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            m = re.match(r".*\(\s*\*\s*(\w+)\s*\)", decl) or re.match(r".*?(\w+)\s*(?:\[\s*\w+\s*\])?$", decl)
            if m:
                fields.append(m.group(1))
        out[name] = fields
    return out


def header_functions(text: str) -> dict[str, int]:
    """{function name: number of parameters} of every LLAMA_API declaration in a llama.h (also those
    wrapped in DEPRECATED(...)); parameters are counted at parenthesis depth 0."""
    out: dict[str, int] = {}
    flat = " ".join(_strip_comments(text).split())
    for m in re.finditer(r"LLAMA_API\s+(?:DEPRECATED\(\s*)?", flat):
        start = flat.find("(", m.end())
        name = re.search(r"(\w+)\s*$", flat[m.end():start]) if start > 0 else None
        if name is None:
            continue
        depth, k = 0, start
        while k < len(flat):
            depth += flat[k] == "("
            depth -= flat[k] == ")"
            k += 1
            if depth == 0:
                break
        params = flat[start + 1:k - 1].strip()
        out[name.group(1)] = 0 if params == "void" else _count_params(params)
    return out


def _count_params(text: str) -> int:
    """Comma-separated items at parenthesis depth 0 (a trailing comma adds none)."""
    depth, n, item = 0, 0, False
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            n, item = n + item, False
        elif not ch.isspace():
            item = True
    return n + item


def _binding_module():
    """llama_cpp.llama_cpp's declarations without loading a library: the module is already imported
    once a choice is being checked in-process, or we read the declarations from its source."""
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise BindingError("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    return Path(list(spec.submodule_search_locations)[0])


def binding_layout() -> tuple[dict[str, list[str]], dict[str, int]]:
    """The binding's structs and parameter counts, read from llama_cpp/llama_cpp.py's declarations
    (`class NAME(ctypes.Structure)` with `_fields_`, `@ctypes_function("NAME", [argtypes], restype)`)
    so that checking a library does not load one."""
    src = (_binding_module() / "llama_cpp.py").read_text()
    structs: dict[str, list[str]] = {}
    for name in STRUCTS:
        m = re.search(rf"\n{name}\._fields_ = \[(.*?)\n\]", src, flags=re.S) or \
            re.search(rf"class {name}\(ctypes\.Structure\):.*?_fields_ = \[(.*?)\n    \]", src, flags=re.S)
        if not m:
            raise BindingError(f"llama-cpp-python's binding has no struct {name}")
        structs[name] = re.findall(r"\(\s*\"(\w+)\"", m.group(1))
    funcs: dict[str, int] = {}
    for m in re.finditer(r"@ctypes_function\(\s*\"(\w+)\",\s*\[(.*?)\],", src, flags=re.S):
        funcs[m.group(1)] = _count_params(m.group(2))
    return structs, funcs


def abi_differences(header_text: str) -> list[str]:
    """What the replay uses that a llama.h declares differently from the binding: structs whose field
    names (in order) differ, functions with another number of parameters or missing. Empty when the
    library can be called through the binding."""
    h_structs, h_funcs = header_structs(header_text), header_functions(header_text)
    b_structs, b_funcs = binding_layout()
    out = []
    for name in STRUCTS:
        theirs, ours = h_structs.get(name, []), b_structs[name]
        if theirs != ours:
            extra = [f for f in theirs if f not in ours][:3]
            lack = [f for f in ours if f not in theirs][:3]
            what = "; ".join(x for x in (extra and f"has {', '.join(extra)}", lack and f"lacks {', '.join(lack)}") if x)
            out.append(f"struct {name} differs ({what or 'field order'})")
    for name in FUNCTIONS:
        if name not in h_funcs:
            out.append(f"{name} is not declared")
        elif name in b_funcs and h_funcs[name] != b_funcs[name]:
            out.append(f"{name} takes {h_funcs[name]} parameters, the binding {b_funcs[name]}")
    return out


# --- choosing and loading ---------------------------------------------------------------------------

def library_file(path: Path) -> Path | None:
    """libllama.so in `path` (a file, or a directory holding it), else None."""
    p = Path(path)
    if p.is_file():
        return p
    for cand in (p / "libllama.so", p / "libllama.dylib"):
        if cand.is_file():
            return cand
    return None


def header_near(lib: Path, source: Path | None = None) -> Path | None:
    """The include/llama.h that declares `lib`: in `source` if given, else up from the library's
    directory (a checkout's build/bin, or our cache's build/bin beside src/)."""
    roots = [Path(source)] if source is not None else []
    for d in dict.fromkeys((Path(lib).absolute().parent, Path(lib).resolve().parent)):  # as given, then its target
        for _ in range(4):
            roots += [d, d / "src"]
            d = d.parent
    for r in roots:
        h = r / "include" / "llama.h"
        if h.is_file():
            return h
    return None


def check_library(lib: Path, header: Path | None) -> list[str]:
    """Why `lib` cannot be used through the binding (empty: it can)."""
    if header is None:
        return [f"no include/llama.h found beside {lib} to check its ABI against the binding"]
    return abi_differences(header.read_text(errors="replace"))


_loaded: types.ModuleType | None = None
_loaded_path: Path | None = None
_loaded_variant: str | None = None  # the CPU variant in use (None: a build with one ggml-cpu linked in)
_loaded_health: "_health.Health | None" = None  # its verdict on this host (runtime/health.py)


_UNSET = object()
_want_lib: "Path | None | object" = _UNSET  # the libllama to load, as given (None: the binding's own)
_want_variant: "str | None | object" = _UNSET  # the CPU variant to load (None: the best that runs here)


def use_cpu_variant(name: str | None) -> None:
    """Load this CPU variant of a release-style libllama (runtime/variants.py) when the binding loads;
    None: the best one that runs on this host (by its CPU flags, as llama-server picks, then by the
    health verdicts: runtime/health.py)."""
    global _want_variant
    if _loaded is not None and name is not None and name != _loaded_variant:
        raise BindingError(f"the {_loaded_variant or 'linked-in'} CPU kernels are already loaded in this process; "
                           f"cannot switch to {name}")
    _want_variant = name


def variant_in_process() -> tuple[bool, str | None]:
    """(whether libllama is loaded in this process, its CPU variant), without loading it."""
    return _loaded is not None, _loaded_variant


def loaded_variant() -> str | None:
    """The CPU variant in use (None: the library links one ggml-cpu in), loading the binding if needed."""
    load()
    return _loaded_variant


def keeps(choice: LibChoice, *, strict: bool = True) -> bool:
    """Whether `choice` would leave another libllama, already loaded in this process, in place (a process
    holds one ggml); with `strict` that is a BindingError instead. False when nothing is loaded yet or
    the loaded one is the choice."""
    want = None if choice.path is None else Path(choice.path).resolve()
    if _loaded is None or want == _loaded_path:
        return False
    if strict:
        have = _loaded_path or "llama-cpp-python's own libllama"
        raise BindingError(f"libllama is already loaded from {have}; cannot switch to {want or 'the binding'}'s "
                           "in the same process")
    return True


def use_libllama(choice: LibChoice, *, strict: bool = True) -> bool:
    """Evaluate with `choice` from now on. It must come before libllama is loaded: once one is, another
    cannot be (a process holds one ggml). Then `strict` raises, else the loaded one stays and False is
    returned."""
    global _want_lib
    if keeps(choice, strict=strict):
        return False
    if _loaded is None:  # as given, not resolved: the CPU variants looked for are those of the directory given
        _want_lib = None if choice.path is None else Path(choice.path).absolute()
    return True


def chosen_dir() -> Path | None:
    """The directory of the libllama this process loads (or loaded), as given; None: the binding's own."""
    want = _want_lib if _want_lib is not _UNSET else os.environ.get(ENV) or None
    lib = library_file(Path(want)) if want else None
    return lib.parent if lib else None


def loaded_path() -> Path | None:
    """The libllama file in use (None: llama-cpp-python's own), loading the binding if needed."""
    load()
    return _loaded_path


def library_in_use() -> str:
    """The path of the libllama file in use, llama-cpp-python's own included (reports name it)."""
    path = loaded_path()
    return str(path) if path is not None else str(bundled_dir() / "libllama.so")


def load() -> types.ModuleType:
    """Import llama_cpp over the chosen libllama (use_libllama, else the binding's own), with the chosen
    CPU variant (use_cpu_variant, else the best that runs here), once the library and variant are known
    to run on this host (runtime/health.py: probed in a subprocess first)."""
    global _loaded, _loaded_path, _loaded_variant, _loaded_health
    if _loaded is not None:
        return _loaded
    # what this process was told (use_libllama), else what its environment says (the health probe's child)
    want = _want_lib if _want_lib is not _UNSET else os.environ.get(ENV) or None
    variant = _want_variant if _want_variant is not _UNSET else os.environ.get(VARIANT_ENV) or None
    if not want:
        _loaded_health = _require_runs(bundled_dir(), None, bundled=True)
        # its own: not a library a parent process (or the user's shell) pointed the binding at
        os.environ.pop("LLAMA_CPP_LIB_PATH", None)
        import llama_cpp
        _loaded = llama_cpp
        return llama_cpp
    lib = library_file(Path(want))
    if lib is None:
        raise BindingError(f"{want}: no libllama.so there")
    name = _cpu_variant_to_load(lib.parent, variant)
    _loaded_health = _require_runs(lib.parent, name)
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib.parent)
    absent_names: list[str] = []
    original = ctypes.CDLL.__getattr__

    def lookup(self, name):
        try:
            return original(self, name)
        except AttributeError:
            if name.startswith("__"):
                raise
            absent_names.append(name)
            return _absent(name, lib)

    ctypes.CDLL.__getattr__ = lookup  # the binding looks every symbol up at import
    try:
        import llama_cpp
    except (OSError, RuntimeError) as e:
        raise BindingError(f"cannot load {lib}: {str(e).splitlines()[0]}") from None
    finally:
        ctypes.CDLL.__getattr__ = original
    used_absent = sorted(set(absent_names) & set(FUNCTIONS))
    if used_absent:
        raise BindingError(f"{lib} lacks {', '.join(used_absent)}, which the replay calls")
    _loaded_variant = _load_cpu_backend(lib.parent, name)
    _loaded, _loaded_path = llama_cpp, lib.resolve()
    return llama_cpp


def bundled_dir() -> Path:
    """Where llama-cpp-python keeps its own libllama and ggml (llama_cpp/lib), without loading them."""
    return _binding_module() / "lib"


def library_label(lib_dir: Path | None) -> str:
    return "llama-cpp-python's own libllama" if lib_dir is None or Path(lib_dir) == bundled_dir() else \
        f"the libllama in {lib_dir}"


def _require_runs(lib_dir: Path, variant: str | None, *, bundled: bool = False) -> "_health.Health | None":
    """The verdict on the library (and variant) about to be loaded; a BindingError when it does not
    run here even without extra buffer types. The probe's own process loads what it is told to."""
    if os.environ.get(_health.CHILD_ENV):
        return None
    h = _health.health(lib_dir, variant or _health.NATIVE, bundled=bundled)
    assert h is not None
    if not h.runs(repack=False):
        what = f"the {variant} CPU kernels of {lib_dir}" if variant else library_label(None if bundled else lib_dir)
        fix = (" (scripts/setup builds one that runs here)" if bundled else
               "; give --server-cpu another variant" if variant else "")
        raise BindingError(h.describe(what) + fix)
    return h


def loaded_health() -> "_health.Health | None":
    """The verdict on the library and variant loaded in this process (None: not judged, in the probe
    itself), loading the binding if needed."""
    load()
    return _loaded_health


def _cpu_variant_to_load(bin_dir: Path, name: str | None) -> str | None:
    """The variant of a release-style build to load: `name`, checked against what this CPU has, or
    the best this host runs with extra buffer types (runtime/variants.py: runnable, then the health
    verdicts); None for a build with one CPU backend linked in."""
    from replay.runtime.variants import host_cpu_flags, runnable, variants_in
    present = variants_in(bin_dir)
    if not present:
        if name:
            raise BindingError(f"{bin_dir} holds one CPU backend linked in, not the {name} variant "
                               "(a release-style build: spec-replay build --cpu variants)")
        return None
    can = runnable(present, host_cpu_flags())
    if name is None:
        if not can:
            raise BindingError(f"this CPU runs none of the CPU variants in {bin_dir} ({', '.join(present)})")
        if os.environ.get(_health.CHILD_ENV):
            return can[0]
        best, failed = _health.first_that_runs(bin_dir, can)
        if best is None:
            raise BindingError(f"none of the CPU variants in {bin_dir} runs on this host: "
                               + "; ".join(h.describe() for h in failed))
        return best
    if name not in present:
        raise BindingError(f"{bin_dir} has no {name} CPU variant (it has {', '.join(present)})")
    if name not in can:
        raise BindingError(f"this CPU cannot run the {name} CPU variant (it runs {', '.join(can) or 'none'})")
    return name


def _load_cpu_backend(bin_dir: Path, name: str | None) -> str | None:
    """A release-style build (GGML_BACKEND_DL) links no CPU backend in: load the variant `name`
    (_cpu_variant_to_load) with ggml_backend_load before anything else asks for a backend
    (llama_backend_init would scan the Python executable's directory instead: src/llama.cpp:122-135,
    ggml-backend-reg.cpp:480-502). None for a build without variants."""
    from replay.runtime.variants import library_of
    if name is None:
        return None
    ggml = ctypes.CDLL(str(bin_dir / "libggml.so"))
    ggml.ggml_backend_load.argtypes, ggml.ggml_backend_load.restype = [ctypes.c_char_p], ctypes.c_void_p
    # ggml's "load_backend: loaded CPU backend from ..." goes to stderr before llama_log_set can route it
    # (runtime/llama.py: set_verbose); the choice is reported by the caller instead
    quiet = _LOG_CALLBACK(lambda level, text, data: None)
    ggml.ggml_log_set.argtypes, ggml.ggml_log_set.restype = [_LOG_CALLBACK, ctypes.c_void_p], None
    ggml.ggml_log_set(quiet, None)
    try:
        reg = ggml.ggml_backend_load(str(library_of(bin_dir, name)).encode())
    finally:
        ggml.ggml_log_set(_LOG_CALLBACK(), None)  # NULL: ggml's default logger until libllama's is set
    if not reg:
        raise BindingError(f"ggml could not load {library_of(bin_dir, name)}")
    return name


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _absent(name: str, lib: Path):
    def call(*_args, **_kw):
        raise BindingError(f"{lib} has no {name} (an older libllama)")
    call.__name__ = name
    return call


class _Lazy(types.ModuleType):
    """`L.llama_decode(...)`: the binding, imported on first attribute use. After that the module's
    names are copied onto this object, so later lookups cost what a module attribute costs."""

    def __getattr__(self, name: str):
        mod = load()
        self.__dict__.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
        return getattr(mod, name)


L = _Lazy("replay.runtime.binding.L")
