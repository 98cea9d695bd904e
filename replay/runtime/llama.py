"""Small owning Python objects over libllama's C API (llama-cpp-python's ctypes bindings).

    Model    llama_model_load_from_file / llama_model_free, plus the vocabulary
    Context  llama_init_from_model / llama_free, decode, logits rows, KV removal
    Batch    llama_batch_init / llama_batch_free

Each object frees its handle exactly once (close() is idempotent, __del__ calls
it), and a Context is closed before the Model it was made from. Every
llama_decode return code is checked and named (include/llama.h: 0 ok, 1 no KV
slot, 2 aborted, -1 invalid batch, < -1 fatal).
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from replay.errors import DecodeError, ModelError
from replay.runtime.binding import L, loaded_health
from replay.runtime.gguf import check_gguf
from replay.runtime.staging import staging
from replay.settings.cache_types import GGML_CACHE_TYPES

# --- logging: libllama is quiet unless SPEC_REPLAY_VERBOSE is set -------------

_verbose = bool(os.environ.get("SPEC_REPLAY_VERBOSE"))


_sinks: list = []  # callables given each line libllama logs (add_log_sink), besides stderr with -v
# a thread's own capture of the lines libllama logs from it (a model's load log: two models may load at once)
_captures: dict[int, Callable[[str], None]] = {}


def _log(level, text, user_data):  # pragma: no cover - C callback
    line = text.decode("utf-8", "replace")
    for sink in _sinks:
        sink(line)
    mine = _captures.get(threading.get_ident())
    if mine is not None:
        mine(line)
    if _verbose:
        try:
            os.write(2, text)
        except OSError:
            pass


def extra_buffers(lines: list[str]) -> tuple[str, ...]:
    """The extra buffer types a model's weights took, from libllama's load log (src/llama-model.cpp:
    "load_tensors: %12s model buffer size"): all but the plain CPU ones.

    >>> extra_buffers(["load_tensors:   CPU_Mapped model buffer size =  0.95 MiB\\n",
    ...                "load_tensors:   CPU_REPACK model buffer size =  0.21 MiB\\n"])
    ('CPU_REPACK',)
    """
    found = []
    for line in "".join(lines).splitlines():
        words = line.split()
        if len(words) > 2 and words[0] == "load_tensors:" and "model buffer size" in line:
            if words[1] not in ("CPU", "CPU_Mapped", "CPU_Model") and words[1] not in found:
                found.append(words[1])
    return tuple(found)


def add_log_sink(sink) -> None:
    """Give `sink` every line libllama logs from now on (the health probe reads the buffer types the
    model's weights took from them)."""
    _sinks.append(sink)


_log_cb = None  # the ctypes callback, made once the binding is loaded and kept alive here


def set_verbose(flag: bool) -> None:
    global _verbose
    _verbose = flag


def verbose() -> bool:
    """Whether -v (or SPEC_REPLAY_VERBOSE) asked for logs and details."""
    return _verbose


_backend_ready = False


def _backend() -> None:
    global _backend_ready, _log_cb
    if not _backend_ready:
        _log_cb = L.llama_log_callback(_log)
        L.llama_log_set(_log_cb, ctypes.c_void_p(0))
        L.llama_backend_init()
        _backend_ready = True





class _Owner:
    """One owner per C handle: close() frees it once; `with` and garbage collection close too
    (also when __init__ failed before it took a handle)."""

    _ptr = None

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Model(_Owner):
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: Path | str, *, n_gpu_layers: int = 0, use_extra_bufts: bool = True,
                 no_host: bool = False):
        _backend()
        self.path = check_gguf(path)
        verdict = loaded_health()
        if use_extra_bufts and verdict is not None and not verdict.runs(repack=True):
            raise ModelError(verdict.describe(f"the {verdict.name} kernels loaded here") + ": load the model with "
                             "--no-repack only if the server ran so; else recover on a host that runs them")
        params = L.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers  # runtime/backend.py: 0 unless this libllama can offload
        # llama-server's --no-repack (-nr) and --no-host (common/arg.cpp): no extra buffer types (the CPU
        # repack of Q4_0/Q4_K/IQ4_NL/Q8_0 weights, AMX), no host buffer; both change the kernels
        params.use_extra_bufts = use_extra_bufts
        params.no_host = no_host
        # a model's nextn (MTP) layers, where it has them: llama-server loads them when it drafts with
        # them (common/common.cpp:1683, load_mtp), else skips their tensors (e.g. src/models/hy-v3.cpp:34-36);
        # they take no part in the target's own graph, so loading them always changes no value (only
        # memory: a large model's nextn layers are a layer's weights each, mapped, not copied)
        if hasattr(params, "load_mtp"):
            params.load_mtp = True
        self.use_extra_bufts, self.no_host = use_extra_bufts, no_host
        lines: list[str] = []
        me = threading.get_ident()
        _captures[me] = lines.append
        try:
            ptr = L.llama_model_load_from_file(str(self.path).encode(), params)
        finally:
            del _captures[me]
        # the extra buffer types its weights took (libllama's "load_tensors: CPU_REPACK model buffer size"):
        # none means the model computes as with --no-repack
        self.buffers = extra_buffers(lines)
        if not ptr:
            raise ModelError(f"libllama could not load {self.path} (not a supported GGUF model?)")
        self._ptr = ptr
        self.vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self._contexts: list[Context] = []

    @property
    def ptr(self):
        if self._ptr is None:
            raise RuntimeError("model is closed")
        return self._ptr

    @functools.cached_property
    def n_layer_nextn(self) -> int:
        """The model's nextn (MTP) layers: 0 for a model without them (llama_model_n_layer_nextn)."""
        return int(L.llama_model_n_layer_nextn(self.ptr))

    @functools.cached_property
    def n_embd_out(self) -> int:
        """The width of the hidden state an MTP context takes per token (llama_model_n_embd_out)."""
        return int(L.llama_model_n_embd_out(self.ptr))

    def close(self) -> None:
        for ctx in list(getattr(self, "_contexts", ())):  # none yet when __init__ failed
            ctx.close()
        if self._ptr is not None:
            L.llama_model_free(self._ptr)
            self._ptr = None

    # --- vocabulary ------------------------------------------------------

    def _spm_unrepresentable(self, text: str, parse_special: bool) -> str | None:
        """A character an SPM vocabulary without byte-fallback tokens cannot encode, if any.

        llama.cpp's SPM tokenizer looks such a character up with `token_to_id.at()`
        (src/llama-vocab.cpp, llm_tokenizer_spm_session::resegment) and the uncaught
        std::out_of_range aborts the process; real SPM models have <0xNN> byte tokens, the
        tiny fixture does not."""
        if getattr(self, "_spm_chars", None) is None:
            self._spm_chars = frozenset()
            self._spm_specials: tuple[str, ...] = ()
            if int(L.llama_vocab_type(self.vocab)) == 1 and not self._has_byte_tokens():  # LLAMA_VOCAB_TYPE_SPM
                texts = [(L.llama_vocab_get_text(self.vocab, t) or b"").decode("utf-8", "replace")
                         for t in range(self.n_vocab)]
                if "<0x41>" not in texts:
                    self._spm_chars = frozenset(x for x in texts if len(x) == 1)
                    self._spm_specials = tuple(sorted((x for x in texts if len(x) > 1), key=len, reverse=True))
        if not self._spm_chars:
            return None
        if parse_special:
            for sp in self._spm_specials:
                text = text.replace(sp, "")
        return next((c for c in text.replace(" ", "\u2581") if c not in self._spm_chars), None)

    def _has_byte_tokens(self) -> bool:
        """Whether the vocabulary has the byte-fallback token <0x41>, looked for in id order up to it (real
        SPM vocabularies hold their 256 byte tokens near the start: Llama's from id 3, Gemma 3's from 238)."""
        for t in range(self.n_vocab):
            if L.llama_vocab_get_text(self.vocab, t) == b"<0x41>":
                return True
        return False

    def tokenize(self, text: str | bytes, *, add_special: bool, parse_special: bool) -> list[int]:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        bad = self._spm_unrepresentable(raw.decode("utf-8", "replace"), parse_special)
        if bad is not None:
            raise ModelError(f"{self.path.name} cannot tokenize {bad!r}: its SPM vocabulary has no byte-fallback "
                             "tokens for characters outside it (the text comes from another model?)")
        n_max = len(raw) + 8
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (L.llama_token * n_max)()
            n = L.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def _check_id(self, token: int) -> None:
        # libllama throws std::out_of_range (and the process aborts) for ids outside the vocabulary
        if not 0 <= token < self.n_vocab:
            raise ModelError(f"token id {token} is outside {self.path.name}'s vocabulary ({self.n_vocab} tokens): "
                             "the transcript comes from another model")

    def piece(self, token: int, *, special: bool = True) -> bytes:
        """The bytes of one token (llama_token_to_piece, no leading-space stripping)."""
        self._check_id(token)
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        self._check_id(token)
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def eog_ids(self) -> tuple[int, ...]:
        """Every end-of-generation id (EOS, EOT, ...), looked up once per model."""
        return tuple(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))

    @property
    def eos(self) -> int:
        return int(L.llama_vocab_eos(self.vocab))

    @property
    def bos(self) -> int:
        return int(L.llama_vocab_bos(self.vocab))

    @property
    def add_bos(self) -> bool:
        return bool(L.llama_vocab_get_add_bos(self.vocab))

    @property
    def n_swa(self) -> int:
        """The sliding-window size of the model's SWA layers (0: no sliding-window attention)."""
        return int(L.llama_model_n_swa(self.ptr))

    def chat_template(self) -> str | None:
        t = L.llama_model_chat_template(self.ptr, None)
        return t.decode("utf-8") if t else None

    def desc(self) -> str:
        """libllama's description, "<arch> <size> <file type>" (llama_model_desc, src/llama-model.cpp): its
        file type part is what llama-server reports as /props model_ftype (llama_ftype_name)."""
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.ptr, buf, 256)
        return buf.value.decode("utf-8", "replace")

    def size_bytes(self) -> int:
        """The weights' size in bytes (llama_model_size: /v1/models meta.size)."""
        return int(L.llama_model_size(self.ptr))

    def n_params(self) -> int:
        """The parameter count (llama_model_n_params: /v1/models meta.n_params)."""
        return int(L.llama_model_n_params(self.ptr))

    def meta(self, key: str) -> str | None:
        """A metadata value as libllama renders it (llama_model_meta_val_str: the text the server's
        own readers parse), or None if the file has no such (non-array) key."""
        buf = ctypes.create_string_buffer(512)
        n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, 512)
        if n >= 512:
            buf = ctypes.create_string_buffer(n + 1)
            n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", "replace") if n >= 0 else None


def model_params(flags: dict) -> dict:
    """Model's keyword arguments for llama-server's model-load flags (settings table attrs: --no-repack,
    --no-host). The server loads a draft model with them too (common_base_params_to_speculative).

    >>> model_params({"no_repack": True}), model_params({})
    ({'use_extra_bufts': False, 'no_host': False}, {'use_extra_bufts': True, 'no_host': False})
    """
    return {"use_extra_bufts": not flags.get("no_repack"), "no_host": bool(flags.get("no_host"))}


class Batch:
    """A llama_batch with room for `capacity` tokens of one sequence."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._b = L.llama_batch_init(capacity, 0, 1)
        self._freed = False

    def fill(self, tokens: Sequence[int], pos0: int, outputs: Sequence[bool], seq_id: int = 0) -> None:
        n = len(tokens)
        assert n <= self.capacity and len(outputs) == n
        b = self._b
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_id
            b.logits[i] = bool(outputs[i])

    @property
    def raw(self):
        return self._b

    def close(self) -> None:
        if not self._freed:
            L.llama_batch_free(self._b)
            self._freed = True

    def __del__(self):
        self.close()


FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


class Context(_Owner):
    """A decoding context, configured like llama-server's (`-c`, `-b`, `-ub`, `-fa`, `-ctk/-ctv`, `--swa-full`,
    `-t`)."""

    def __init__(self, model: Model, *, n_ctx: int = 2048, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: int = 2, n_threads_batch: int | None = None, flash_attn: str = "auto", type_k: str = "f16", type_v: str = "f16",
                 swa_full: bool = False, n_seq_max: int = 1, kv_unified: bool = False, mtp_of: "Context | None" = None,
                 n_outputs_max: int = 0, n_rs_seq: int = 0):
        self.model = model
        self.n_decodes = 0  # llama_decode calls that succeeded, and the batch rows they decoded
        self.n_rows = 0
        self.batches: Counter[int] = Counter()  # the same calls by their rows
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_batch, n_ubatch
        # a unified cache for n slots sizes the sliding-window cache for all of them:
        # min(n_ctx, n_swa * n_seq_max + n_ubatch) cells (src/llama-kv-cache-iswa.cpp:73)
        p.n_seq_max = n_seq_max
        p.kv_unified = kv_unified
        # llama_context::graph_compute (src/llama-context.cpp:2612) runs a one-token decode on n_threads and
        # a batch of two rows or more on n_threads_batch (llama-server: -t and -tb, -tb defaulting to -t). A
        # batch's values do not depend on its thread count (each output summed in one order), a one-token
        # decode's do (single_row_threads): the server's -t for those, `n_threads_batch` (None: the same)
        # only sets the speed of batches
        p.n_threads = n_threads
        p.n_threads_batch = n_threads_batch or n_threads
        self.threads = self.n_threads = n_threads  # threads: as made (the server's -t)
        self._threads_batch = p.n_threads_batch
        p.flash_attn_type = FLASH_ATTN[flash_attn]
        p.type_k, p.type_v = GGML_CACHE_TYPES[type_k], GGML_CACHE_TYPES[type_v]
        p.swa_full = swa_full
        p.no_perf = True
        if n_outputs_max:
            p.n_outputs_max = n_outputs_max
        # recurrent-state snapshots per sequence (settings/config.py rollback_snapshots); libllama clamps the
        # request to 0 on architectures that do not roll back that way, so `self.n_rs_seq` is read back
        # (asked only of a build with MTP: its llama_n_rs_seq)
        p.n_rs_seq = n_rs_seq
        if mtp_of is not None:
            # an MTP draft context over the target context `mtp_of` (common/speculative.cpp:2603-2617):
            # ctx_type MTP, n_rs_seq 0, one output row per sequence
            p.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
            p.ctx_other = mtp_of.ptr
            p.n_rs_seq = 0
            p.n_outputs_max_per_seq = 1
        ptr = L.llama_init_from_model(model.ptr, p)
        if not ptr:
            raise ModelError(f"libllama could not create a context (n_ctx={n_ctx}) for {model.path}")
        self._ptr = ptr
        self.n_ctx = min(n_ctx, int(L.llama_n_ctx(ptr)))  # libllama may round up; the limit is what was asked
        self.n_rs_seq = int(L.llama_n_rs_seq(ptr)) if n_rs_seq > 0 else 0
        self.n_batch = n_batch
        self.n_ubatch = int(L.llama_n_ubatch(ptr))
        self.n_vocab = model.n_vocab
        self.kv_tokens: list[int] = []  # the token in each KV position 0..len-1 (sequence 0)
        self._batch = Batch(n_batch)
        self._row_type = ctypes.c_float * self.n_vocab
        self._ext = None  # a llama_batch_ext, made on first use (process)
        model._contexts.append(self)

    @property
    def ptr(self):
        if self._ptr is None:
            raise RuntimeError("context is closed")
        return self._ptr

    def close(self) -> None:
        if self._ptr is not None:
            self._batch.close()
            if self._ext is not None:
                L.llama_batch_ext_free(self._ext)
                self._ext = None
            L.llama_free(self._ptr)
            self._ptr = None
            if self in self.model._contexts:
                self.model._contexts.remove(self)

    def decode(self, tokens: Sequence[int], pos0: int, outputs: Sequence[bool] | None = None, seq_id: int = 0) -> None:
        """Decode one batch (<= n_batch tokens) at positions pos0.. ; `outputs` marks rows that get logits."""
        if pos0 + len(tokens) > self.n_ctx:
            raise ModelError(f"the context is too small: {pos0 + len(tokens)} tokens needed, n_ctx is {self.n_ctx}")
        if len(tokens) > self.n_batch:
            raise DecodeError(-1, f"a batch of {len(tokens)} tokens exceeds n_batch {self.n_batch} (-b)")
        outs = outputs if outputs is not None else [False] * (len(tokens) - 1) + [True]
        self._batch.fill(tokens, pos0, outs, seq_id)
        rc = L.llama_decode(self.ptr, self._batch.raw)
        if rc != 0:
            self.kv_tokens = []  # unknown state: the next user starts from scratch
            raise DecodeError(rc)
        self._decoded(tokens, pos0, seq_id)

    def process(self, tokens: Sequence[int], pos0: int, hidden: np.ndarray, outputs: Sequence[bool]) -> None:
        """Decode one batch in which each token carries a hidden-state row (`hidden`, [len(tokens),
        n_embd_out] float32) as an MTP context takes it: llama_batch_ext_add_token, _set_pos,
        _set_embd_token (the row is copied into the batch, llama-batch.cpp:1200-1234),
        _set_output_logits, then llama_process (DECODE), as common_batch::get renders the server's
        batches (common/common.cpp:2202-2240)."""
        n = len(tokens)
        if pos0 + n > self.n_ctx:
            raise ModelError(f"the context is too small: {pos0 + n} tokens needed, n_ctx is {self.n_ctx}")
        rows = np.ascontiguousarray(hidden, dtype=np.float32)
        if rows.shape != (n, self.model.n_embd_out):
            raise ValueError(f"hidden rows {rows.shape}, want ({n}, {self.model.n_embd_out})")
        if self._ext is None:
            self._ext = L.llama_batch_ext_init(self.ptr)
            if not self._ext:
                raise ModelError("libllama could not make an extended batch")
        b = self._ext
        L.llama_batch_ext_clear(b)
        pos = ctypes.c_int32()
        for k, tok in enumerate(tokens):
            idx = int(L.llama_batch_ext_add_token(b, 0, int(tok)))
            if idx < 0:
                raise DecodeError(-1, f"llama_batch_ext_add_token: {idx}")
            pos.value = pos0 + k
            row = rows[k]
            embd = L.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1])
            if not (L.llama_batch_ext_set_pos(b, idx, ctypes.byref(pos))
                    and L.llama_batch_ext_set_embd_token(b, idx, embd)
                    and (not outputs[k] or L.llama_batch_ext_set_output_logits(b, idx, True))):
                raise DecodeError(-1, "an extended batch refused a token's position, hidden row or output")
        rc = L.llama_process(self.ptr, L.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            self.kv_tokens = []
            raise DecodeError(rc)
        self._decoded(tokens, pos0, 0)

    def _decoded(self, tokens: Sequence[int], pos0: int, seq_id: int) -> None:
        """Count a decode that succeeded and follow sequence 0's tokens in the KV."""
        self.n_decodes += 1
        self.n_rows += len(tokens)
        self.batches[len(tokens)] += 1
        if seq_id == 0:
            if pos0 <= len(self.kv_tokens):
                self.kv_tokens[pos0:] = tokens
            else:
                self.kv_tokens = []

    def keep_hidden(self, masked: bool) -> None:
        """Keep the hidden state the nextn layers read (llama_set_embeddings_nextn, llama-ext.h:96): for
        every batch row (`masked` False, a target's) or the output rows (True, an MTP context's)."""
        staging().set_embeddings_nextn(self.ptr, True, masked)

    def hidden_rows(self, n: int) -> np.ndarray:
        """A copy of the hidden-state rows of the last batch's `n` entries (unmasked: by batch index),
        [n, n_embd_out] float32 (llama_get_embeddings_nextn)."""
        ptr = staging().get_embeddings_nextn(self.ptr)
        if not ptr:
            raise DecodeError(-1, "libllama kept no hidden states (llama_get_embeddings_nextn)")
        return np.ctypeslib.as_array(ptr, shape=(n, self.model.n_embd_out)).copy()

    def hidden_row(self, i: int) -> np.ndarray:
        """A copy of the hidden state of batch entry `i` of the last batch, which libllama maps to its
        output row in a masked context (llama_get_embeddings_nextn_ith)."""
        ptr = staging().get_embeddings_nextn_ith(self.ptr, i)
        if not ptr:
            raise DecodeError(-1, f"libllama kept no hidden state for output row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd_out,)).copy()

    def nextn_layer(self, offset: int) -> None:
        """Which nextn layer an MTP context's graph runs (llama_set_nextn_layer_offset, llama-ext.h:101)."""
        staging().set_nextn_layer_offset(self.ptr, offset)

    def single_row_threads(self, n: int) -> None:
        """The threads of the next one-token decodes (llama_set_n_threads; batches keep theirs).

        One token decoded alone over 512 KV cells or more takes ggml-cpu's split-KV flash-attention path
        (ggml/src/ggml-cpu/ops.cpp:9489 use_split_kv_path: one query row, f16/f32 KV, nek1 >= 512), which
        sums the KV in one chunk per thread (:9492 chunk_size = ceil(nek1 / nth)): its values depend on
        the thread count. With one thread it is a single chunk, bit for bit the row a batch of two rows
        or more computes at any thread count (the non-split path): what a verify batch computed."""
        if n != self.n_threads:
            L.llama_set_n_threads(self.ptr, n, self._threads_batch)
            self.n_threads = n

    def logits(self, i: int) -> np.ndarray:
        """A copy of the logits of output row `i` of the last batch (-1 = last), float32 [n_vocab]."""
        ptr = L.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise DecodeError(-1, f"libllama kept no logits for batch row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def logits_view(self, i: int) -> np.ndarray:
        """Row `i` of the last batch's logits without a copy: valid only until the next decode (the
        per-token path of recover reads each row once, before decoding on)."""
        ptr = L.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise DecodeError(-1, f"libllama kept no logits for batch row {i}")
        return np.frombuffer(self._row_type.from_address(ctypes.addressof(ptr.contents)), dtype=np.float32)

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> None:
        L.llama_memory_seq_rm(L.llama_get_memory(self.ptr), seq_id, p0, p1)
        if seq_id == 0:
            if p1 < 0 or p1 >= len(self.kv_tokens):
                del self.kv_tokens[p0:]
            else:
                self.kv_tokens = []  # a hole: no longer a plain prefix

    def pos_min(self, seq_id: int = 0) -> int:
        """llama_memory_seq_pos_min: the smallest position the memory holds for the sequence (-1: none;
        a sliding-window cache drops cells that fell out of the window, a recurrent one keeps only its last)."""
        return int(L.llama_memory_seq_pos_min(L.llama_get_memory(self.ptr), seq_id))

    def pos_max(self, seq_id: int = 0) -> int:
        return int(L.llama_memory_seq_pos_max(L.llama_get_memory(self.ptr), seq_id))

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ptr), True)
        self.kv_tokens = []

    def removes_suffixes(self) -> bool:
        """Can this context's memory drop a sequence's last positions? common_context_can_seq_rm
        (common/common.cpp:1549-1590): with recurrent-state snapshots (n_rs_seq > 0), up to that many, and
        nothing is probed (RS); else decode two tokens, try to remove the second, clear. False for
        recurrent and hybrid models without snapshots (the server then verifies drafts from checkpoints)."""
        if self.n_rs_seq > 0:
            return True
        self.clear()
        self.decode([0, 0], 0, [False, True])
        ok = bool(L.llama_memory_seq_rm(L.llama_get_memory(self.ptr), 0, 1, -1))
        self.clear()
        return ok

    def save_partial(self, seq_id: int = 0) -> bytes:
        """The sequence's partial state (recurrent or SWA cells only: LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY),
        as the server's speculative checkpoint takes it (common_prompt_checkpoint.update_tgt)."""
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        n = int(L.llama_state_seq_get_size_ext(self.ptr, seq_id, flags))
        buf = (ctypes.c_ubyte * n)()
        got = int(L.llama_state_seq_get_data_ext(self.ptr, buf, n, seq_id, flags))
        if got != n:
            raise ModelError(f"libllama saved {got} of {n} bytes of a sequence state")
        return bytes(buf)

    def load_partial(self, data: bytes, seq_id: int = 0) -> None:
        """Restore a state from save_partial (common_prompt_checkpoint.load_tgt)."""
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        if int(L.llama_state_seq_set_data_ext(self.ptr, buf, len(data), seq_id,
                                              L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) == 0:
            raise ModelError("libllama could not restore a sequence state")
