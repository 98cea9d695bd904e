"""Which kernels computed the server's values, and which compute the replay's.

Bit-exact recovery needs the same kernels on both sides: the same backend (CPU, CUDA, Metal...),
the same SIMD code paths, the same batch composition. A replay runs on this machine's CPU through
llama-cpp-python's libllama, or offloads with `-ngl` when that libllama was built with GPU support
(llama_supports_gpu_offload). The server's backend is known from its flags (`-dev`, `-ngl`), or
declared with `--server-backend` for what no flag says (another CPU: ARM NEON against x86 AVX2, or
a build with other SIMD flags). Where the two differ, real values that disagree are judged like
batches shared with other requests (comparison/judgement.py: judge_numerics).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from replay.runtime.binding import L

CPU = "CPU"


@dataclass(frozen=True)
class Backend:
    """Where values are computed: `name` for reports, `n_gpu_layers` as libllama takes it."""

    name: str
    n_gpu_layers: int = 0


def gpu_offload_available() -> bool:
    """llama-cpp-python's libllama was built with a GPU backend (llama.h: llama_supports_gpu_offload)."""
    return bool(L.llama_supports_gpu_offload())


def replay_backend(n_gpu_layers: str | None) -> Backend:
    """The replay's backend for llama-server's `-ngl` value (N, auto, all; common/arg.cpp:2792-2808).
    Without GPU support in this libllama every layer stays on the CPU, as llama-server does then
    ("no usable GPU found, --gpu-layers option will be ignored")."""
    if not gpu_offload_available():
        return Backend(CPU)
    value = (n_gpu_layers or "auto").strip()
    layers = -1 if value in ("auto", "all") else int(value)  # 0c1e570 llama.h: negative = all layers
    return Backend(CPU, 0) if layers == 0 else Backend(f"GPU (-ngl {value})", layers)


def server_backend(flags: Mapping[str, object], declared: str | None = None) -> str:
    """The server's backend as far as its flags tell: `declared` (--server-backend) first, then
    `-dev` (a device list; `none` means CPU only), then an explicit `-ngl` other than 0 on a server
    we are told nothing else about: a GPU. Without any of these, the CPU."""
    if declared:
        return declared
    devices = flags.get("--device")
    if isinstance(devices, str) and devices.strip():
        names = [d.strip() for d in devices.split(",") if d.strip()]
        gpus = [d for d in names if d.lower() != "none" and not d.upper().startswith("CPU")]
        return ",".join(gpus) if gpus else CPU
    ngl = flags.get("--gpu-layers")
    if isinstance(ngl, str) and ngl not in ("0",):
        return f"GPU (-ngl {ngl})"
    return CPU


def kernels_differ(server: str, replay: Backend) -> str | None:
    """Why the server's kernels are not the replay's, or None when they are the same kind."""
    if server == replay.name:
        return None
    if server == CPU or replay.name == CPU:
        return f"the server computed on {server}, this replay on {replay.name}"
    return f"the server computed on {server}, this replay on {replay.name} (other devices or kernels)"
