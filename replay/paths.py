"""Where spec-replay keeps what it downloads and builds: outside the repository.

The cache root is `$SPEC_REPLAY_CACHE`, else `~/.cache/spec-replay`:

    sdist/      pinned llama.cpp source packages, as pip downloaded them
    trees/<key>/src/   unpacked (and patched) llama.cpp trees
    trees/<key>/build/ their builds; bin/ holds llama-server, llama-speculative, llama-quantize
    superbuild/<key>/  the CMake superbuild directory of this repository's CMakeLists.txt
    ccache/     compiler cache shared by every tree
    models/     SmolLM2 and its requantised draft
    wheels/     the llama-cpp-python wheel built once
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "fixtures"


def cache_root() -> Path:
    """The cache root directory (not created)."""
    env = os.environ.get("SPEC_REPLAY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spec-replay"


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB chunks (models are hundreds of MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
