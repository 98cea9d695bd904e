"""The x86 CPU variants of a release-style ggml, and which of them this host can run.

Upstream builds its release binaries with GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON: one
`libggml-cpu-<name>.so` per entry of the table below (ggml/src/CMakeLists.txt:494-518, b11434),
each compiled with exactly its features on. At start `ggml_backend_load_best` (ggml/src/
ggml-backend-reg.cpp:480-572) loads, from the executable's directory and the working directory,
the one whose `ggml_backend_score` is highest; a variant scores 0 (cannot run) when the CPU lacks
one of its features (ggml/src/ggml-cpu/arch/x86/cpu-feats.cpp:263-322, `score`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

PREFIX, SUFFIX = "libggml-cpu-", ".so"


@dataclass(frozen=True)
class Variant:
    """One CPU backend: its name (the file's `libggml-cpu-<name>.so`) and the features it is built with."""

    name: str
    features: tuple[str, ...]

    @property
    def label(self) -> str:
        """The name and its widest SIMD, as a report says it.

        >>> VARIANTS["haswell"].label, VARIANTS["x64"].label, VARIANTS["zen4"].label
        ('haswell (AVX2)', 'x64 (SSE2)', 'zen4 (AVX-512 VBMI VNNI BF16)')
        """
        f = set(self.features)
        if "AMX_INT8" in f:
            widest = "AMX"
        elif "AVX512" in f:
            widest = " ".join(["AVX-512"] + [x.removeprefix("AVX512_") for x in self.features if x.startswith("AVX512_")])
        else:
            widest = next((name for feat, name in _WIDEST if feat in f), "SSE2")
        return f"{self.name} ({widest})"


# below AVX-512: the widest feature a variant has, as the label names it
_WIDEST = (("AVX_VNNI", "AVX2 VNNI"), ("AVX2", "AVX2"), ("FMA", "AVX FMA"), ("F16C", "AVX F16C"), ("AVX", "AVX"),
           ("SSE42", "SSE4.2"))
_HSW = ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2")
# ggml/src/CMakeLists.txt:494-518, in its order (x86, not MSVC)
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("x64", ()),
    Variant("sse42", ("SSE42",)),
    Variant("sandybridge", ("SSE42", "AVX")),
    Variant("ivybridge", ("SSE42", "AVX", "F16C")),
    Variant("piledriver", ("SSE42", "AVX", "F16C", "FMA")),
    Variant("haswell", _HSW),
    Variant("skylakex", _HSW + ("AVX512",)),
    Variant("cannonlake", _HSW + ("AVX512", "AVX512_VBMI")),
    Variant("cascadelake", _HSW + ("AVX512", "AVX512_VNNI")),
    Variant("icelake", _HSW + ("AVX512", "AVX512_VBMI", "AVX512_VNNI")),
    Variant("cooperlake", _HSW + ("AVX512", "AVX512_VNNI", "AVX512_BF16")),
    Variant("zen4", _HSW + ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")),
    Variant("alderlake", _HSW + ("AVX_VNNI",)),
    Variant("sapphirerapids", _HSW + ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8")),
)}

# what each feature needs of the CPU, as /proc/cpuinfo spells its flags (cpu-feats.cpp:263-322:
# AVX512 is F, CD, VL, DQ and BW together; AMX_TILE adds no check of its own)
CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "SSE42": ("sse4_2",), "AVX": ("avx",), "F16C": ("f16c",), "FMA": ("fma",), "AVX2": ("avx2",), "BMI2": ("bmi2",),
    "AVX_VNNI": ("avx_vnni",), "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "AVX512_VBMI": ("avx512vbmi",), "AVX512_VNNI": ("avx512_vnni",), "AVX512_BF16": ("avx512_bf16",),
    "AMX_TILE": (), "AMX_INT8": ("amx_int8",),
}
# the score bit of each feature (cpu-feats.cpp:266-319); every variant starts at 1
SCORE_BITS: dict[str, int] = {"FMA": 1, "F16C": 2, "SSE42": 4, "BMI2": 8, "AVX": 16, "AVX2": 32, "AVX_VNNI": 64,
                              "AVX512": 128, "AVX512_VBMI": 256, "AVX512_BF16": 512, "AVX512_VNNI": 1024,
                              "AMX_INT8": 2048, "AMX_TILE": 0}


def vectorised(name: str) -> bool:
    """Whether the variant's kernels use AVX or wider (the baseline x64 and sse42 do not: their quantized
    dot products run scalar or SSE paths, measured a tenth of the others' speed on a prompt). A name
    this table does not know counts as vectorised.

    >>> vectorised("haswell"), vectorised("sse42"), vectorised("x64"), vectorised("armv9")
    (True, False, False, True)
    """
    v = VARIANTS.get(name)
    return v is None or "AVX" in v.features


def score(variant: Variant, cpu_flags: Iterable[str]) -> int:
    """ggml_backend_score of `variant` on a CPU with these /proc/cpuinfo flags: 0 when it lacks a
    feature the variant is built with, else 1 plus the feature's bit for each (cpu-feats.cpp:263-322).
    The host loads the runnable variant of highest score.

    >>> avx2 = "fma sse4_2 avx f16c avx2 bmi2".split()
    >>> score(VARIANTS["haswell"], avx2), score(VARIANTS["skylakex"], avx2), score(VARIANTS["x64"], avx2)
    (64, 0, 1)
    """
    have = set(cpu_flags)
    total = 1
    for feat in variant.features:
        if not all(flag in have for flag in CPU_FLAGS[feat]):
            return 0
        total += SCORE_BITS[feat]
    return total


def host_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU flags (the first processor's `flags` line); empty where there is none."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    m = re.search(r"^flags\s*:\s*(.*)$", text, flags=re.M)
    return frozenset(m.group(1).split()) if m else frozenset()


def variants_in(bin_dir: Path) -> list[str]:
    """The variants whose libggml-cpu-<name>.so lie in `bin_dir`, in the table's order (unknown names
    last, sorted): empty for a build that links one ggml-cpu in (native, generic)."""
    names = sorted(p.name[len(PREFIX):-len(SUFFIX)] for p in Path(bin_dir).glob(f"{PREFIX}*{SUFFIX}"))
    return [n for n in VARIANTS if n in names] + [n for n in names if n not in VARIANTS]


def runnable(names: Iterable[str], cpu_flags: Iterable[str]) -> list[str]:
    """Of `names`, those this CPU runs, best (highest score) first: the order a host loads them in.

    >>> runnable(["x64", "sse42", "haswell", "zen4"], "fma sse4_2 avx f16c avx2 bmi2".split())
    ['haswell', 'sse42', 'x64']
    """
    flags = frozenset(cpu_flags)
    scored = [(score(VARIANTS[n], flags), -k, n) for k, n in enumerate(names) if n in VARIANTS]
    return [n for s, _k, n in sorted(scored, reverse=True) if s > 0]


def library_of(bin_dir: Path, name: str) -> Path:
    return Path(bin_dir) / f"{PREFIX}{name}{SUFFIX}"
