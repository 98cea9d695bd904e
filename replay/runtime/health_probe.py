"""The health probe's own process: `python -m replay.runtime.health_probe MODEL NAME`.

Runs in a subprocess started by runtime/health.py, with the libllama and CPU variant to judge named
in its environment (runtime/binding.py reads them; CHILD_ENV tells it not to ask for a verdict on
itself). It writes MODEL first if it does not exist yet (the probe model below), then, once without
and once with extra buffer types (llama_model_params.use_extra_bufts, what llama-server's
`--no-repack` turns off: common/arg.cpp, `-nr`), loads it and decodes, printing `ok plain` and
`ok extra` after each, and which extra buffer types the weights took (`buffers AMX,CPU_REPACK`,
from libllama's own log of the model's buffers). A crash ends the process with its signal; the
parent reads how it ended.

The probe model: a two-layer Llama whose thirteen weight matrices are each of another type, quantized
by the library's own ggml (ggml_quantize_chunk), at sizes every extra-buffer path accepts: rows of
256 (K-quants' QK_K, ggml-cpu/amx/amx.cpp:161-183) and a multiple of 32 of them (AMX's TILE_N * 2;
the repack's 4, 8 or 16 interleaved rows, ggml-cpu/repack.cpp:4974ff). The decodes: a prompt batch of
80 rows, a verify batch of 5 rows with every row's logits, and 3 single tokens: AMX computes one
row with AVX-512 VNNI and several with tiles (amx/mmq.cpp:2435), the repack one row with gemv and
several with gemm.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np

# name, ggml type (gguf.GGMLQuantizationType name) of each layer's matrices; the AMX types first
LAYER_TYPES = (
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
     "ffn_up": "Q6_K", "ffn_down": "IQ4_XS"},
    {"attn_q": "IQ4_NL", "attn_k": "Q2_K", "attn_v": "Q3_K", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
     "ffn_up": "Q8_0", "ffn_down": "Q4_0"},
)
OUTPUT_TYPE = "Q4_K"
N_EMBD, N_FF, N_HEAD, N_VOCAB, N_CTX = 256, 512, 4, 96, 512
PROMPT, VERIFY, SINGLES = 80, 5, 3


def _shapes() -> list[tuple[str, tuple[int, int], str]]:
    """(tensor name, (rows, columns), type) of every weight, in the order they are written."""
    out = [("token_embd.weight", (N_VOCAB, N_EMBD), "F32")]
    for il, types in enumerate(LAYER_TYPES):
        for name, typ in types.items():
            rows, cols = {"ffn_gate": (N_FF, N_EMBD), "ffn_up": (N_FF, N_EMBD),
                          "ffn_down": (N_EMBD, N_FF)}.get(name, (N_EMBD, N_EMBD))
            out.append((f"blk.{il}.{name}.weight", (rows, cols), typ))
        out += [(f"blk.{il}.attn_norm.weight", (1, N_EMBD), "F32"), (f"blk.{il}.ffn_norm.weight", (1, N_EMBD), "F32")]
    out += [("output_norm.weight", (1, N_EMBD), "F32"), ("output.weight", (N_VOCAB, N_EMBD), OUTPUT_TYPE)]
    return out


def write_probe_model(path: Path, ggml_base: ctypes.CDLL) -> None:
    """The probe model, deterministic (weights from one seeded generator), quantized by `ggml_base`'s
    ggml_quantize_chunk; written to a temporary name and moved into place."""
    import gguf
    quantize = ggml_base.ggml_quantize_chunk
    quantize.restype = ctypes.c_size_t
    quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_void_p]
    rng = np.random.default_rng(20261202)
    w = gguf.GGUFWriter(str(path) + f".{os.getpid()}.tmp", "llama")
    w.add_name("spec-replay kernel health probe")
    w.add_vocab_size(N_VOCAB)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(len(LAYER_TYPES))
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(N_VOCAB)])
    w.add_token_scores([0.0] * N_VOCAB)
    w.add_token_types([int(gguf.TokenType.NORMAL)] * N_VOCAB)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    for name, (rows, cols), typ in _shapes():
        if typ == "F32":
            data = (1.0 + 0.1 * rng.standard_normal((rows, cols))) if "norm" in name else rng.standard_normal((rows, cols))
            w.add_tensor(name, np.ascontiguousarray(data.reshape(-1) if rows == 1 else data, dtype=np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[typ]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        src = np.ascontiguousarray(rng.standard_normal((rows, cols)) * 0.05, dtype=np.float32)
        dst = np.zeros((rows, cols // block * size), dtype=np.uint8)
        got = quantize(int(qtype), src.ctypes.data, dst.ctypes.data, 0, rows, cols, None)
        if got != dst.size:
            raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes of {typ}, expected {dst.size}")
        w.add_tensor(name, dst, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + f".{os.getpid()}.tmp", path)


def _library_dir() -> Path:
    from replay.runtime.binding import loaded_path
    lib = loaded_path()
    if lib is not None:
        return lib.parent
    import llama_cpp
    return Path(llama_cpp.__file__).parent / "lib"


def _decode(model_path: Path, extra: bool, crash=None) -> None:
    """Load the model (with or without extra buffer types) and decode the probe's batches. With
    `extra`, the extra buffer types its weights took (from libllama's log) are printed before the
    first decode, and an injected crash (health.injected_crash) happens there."""
    from replay.runtime.llama import Context, Model
    with Model(model_path, use_extra_bufts=extra) as model:
        if extra:
            print(f"buffers {','.join(model.buffers)}", flush=True)
        if crash is not None:
            os.kill(os.getpid(), crash[0])
        with Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=min(4, os.cpu_count() or 2)) as ctx:
            ids = [int(t) for t in np.random.default_rng(7).integers(2, N_VOCAB, PROMPT + VERIFY + SINGLES)]
            ctx.decode(ids[:PROMPT], 0)
            rows = [ctx.logits(-1)]
            ctx.decode(ids[PROMPT:PROMPT + VERIFY], PROMPT, [True] * VERIFY)
            rows += [ctx.logits(i) for i in range(VERIFY)]
            for k in range(SINGLES):
                pos = PROMPT + VERIFY + k
                ctx.decode([ids[pos]], pos)
                rows.append(ctx.logits(-1))
            if not all(np.isfinite(r).all() for r in rows):
                raise RuntimeError("the probe's logits are not finite")


def main(argv: list[str]) -> int:  # pragma: no cover - runs in the probe's subprocess
    from replay.runtime import health
    from replay.runtime.binding import load
    model_path, name = Path(argv[0]), argv[1]
    crash = health.injected_crash(name)
    try:
        load()
        if not model_path.exists():
            model_path.parent.mkdir(parents=True, exist_ok=True)
            write_probe_model(model_path, ctypes.CDLL(str(_library_dir() / "libggml-base.so")))
        _decode(model_path, False, crash if crash is not None and crash[1] else None)
        print("ok plain", flush=True)
        _decode(model_path, True, crash)
        print("ok extra", flush=True)
    except Exception as e:  # not a crash: the probe could not run the library (reported, not kept)
        print(f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        return 3
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
