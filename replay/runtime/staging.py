"""libllama's staging API (src/llama-ext.h): what MTP heads, EAGLE-3 and DFlash drafting call.

llama-ext.h declares its functions with LLAMA_API but outside `extern "C"`, so a build exports them
under their C++ (Itanium) mangled names (`nm -D libllama.so`), which llama-cpp-python's binding does
not bind. They are looked up here once per library, by those names, in the library the binding loaded
(runtime/binding.py library_in_use). A library without one (a build older than the MTP drafter, or
one built with other compilers' mangling) is a BindingError naming it, never a crash.

    set_embeddings_nextn(ctx, value, masked)   llama-ext.h:96; cparams.embeddings_nextn(_masked):
                                               the hidden state before the nextn layer, kept for every
                                               batch row (unmasked) or for the output rows (masked)
    get_embeddings_nextn(ctx) -> float*        llama-ext.h:119; row k = batch entry k (unmasked)
    get_embeddings_nextn_ith(ctx, i) -> float* llama-ext.h:122; batch entry i (its output row, masked)
    set_nextn_layer_offset(ctx, i)             llama-ext.h:101; which of several nextn layers an MTP
                                               context's graph runs (chained heads)
    get_ctx_other(ctx) -> ctx*                 llama-ext.h:131
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

from replay.errors import BindingError

_c = ctypes
# name: (mangled symbol, restype, argtypes); each as b11434 exports it (llama-ext.h:96-131)
SYMBOLS: dict[str, tuple[str, Any, list]] = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb", None,
                             [_c.c_void_p, _c.c_bool, _c.c_bool]),
    "get_embeddings_nextn": ("_Z26llama_get_embeddings_nextnP13llama_context", _c.POINTER(_c.c_float),
                             [_c.c_void_p]),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti", _c.POINTER(_c.c_float),
                                 [_c.c_void_p, _c.c_int32]),
    "set_nextn_layer_offset": ("_Z28llama_set_nextn_layer_offsetP13llama_contexti", None,
                               [_c.c_void_p, _c.c_int32]),
    "get_ctx_other": ("_Z19llama_get_ctx_otherP13llama_context", _c.c_void_p, [_c.c_void_p]),
}


@dataclass(frozen=True)
class Staging:
    """The staging functions of one libllama, ready to call (ctypes functions)."""

    library: str
    fns: dict

    def __getattr__(self, name: str):
        try:
            return self.fns[name]
        except KeyError:
            raise AttributeError(name) from None


@functools.cache
def staging_of(library: str) -> Staging:
    """The staging API of the libllama at `library` (already loaded by the binding: the same handle).

    A missing symbol is a BindingError in one line naming the library and what needs it."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as e:
        raise BindingError(f"cannot open {library}: {str(e).splitlines()[0]}") from None
    fns, missing = {}, []
    for name, (symbol, restype, argtypes) in SYMBOLS.items():
        try:
            f = getattr(lib, symbol)
        except AttributeError:
            missing.append(symbol)
            continue
        f.restype, f.argtypes = restype, argtypes
        fns[name] = f
    if missing:
        raise BindingError(f"{library} lacks llama-ext.h's {', '.join(missing)}: MTP drafting needs a libllama that "
                           "exports the staging API (b11434 does); give --libllama such a build")
    return Staging(library, fns)


def staging() -> Staging:
    """The staging API of the libllama in use."""
    from replay.runtime.binding import library_in_use
    return staging_of(library_in_use())
