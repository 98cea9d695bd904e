"""The CPU variant a release llama-server loads on a machine, from what its user knows of that machine.

    server_variant(said) -> ServerCpu    a variant name, a CPU model name, a /proc/cpuinfo flags line,
                                         or llama-server's system_info log line

A release build carries one `libggml-cpu-<variant>.so` per x86 level and loads the runnable one of highest
score (ggml/src/ggml-cpu/arch/x86/cpu-feats.cpp:263-322; runtime/variants.py `score`). So the machine's
CPU flags decide the variant; a user replaying a colleague's transcripts knows the machine by one of:

- its `/proc/cpuinfo` `flags` line (`flags : fpu vme ... avx2 ...`): scored as ggml scores it;
- its CPU model name (`AMD EPYC 7763 64-Core Processor`, `Intel(R) Xeon(R) Platinum 8480+`): the family's
  flags (the table below), then scored;
- llama-server's `system_info:` line (`CPU : SSE3 = 1 | ... | AVX2 = 1 | ...`): the features the loaded
  variant was compiled with (ggml/src/ggml-cpu/ggml-cpu.cpp:547-583), matched to the variant built with
  exactly those.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from replay.errors import UsageError
from replay.runtime.variants import VARIANTS, runnable

_HSW = "sse4_2 avx f16c fma avx2 bmi2"
_AVX512 = _HSW + " avx512f avx512cd avx512vl avx512dq avx512bw"
# CPU families by model name: (pattern, family, /proc/cpuinfo flags that decide the variant). First match wins.
FAMILIES: tuple[tuple[str, str, str], ...] = (
    (r"EPYC\s+\d{3}[45]\b|EPYC\s+[49]\d{2}[45]|Threadripper\s+(PRO\s+)?[79]\d{3}|Ryzen\s+\w+\s+[79]\d{3}",
     "AMD Zen 4/5", _AVX512 + " avx512vbmi avx512_vnni avx512_bf16"),
    (r"EPYC\s+\d{3}[123][A-Z]?\b|EPYC\s+7\d{2}[123]|Threadripper|Ryzen", "AMD Zen 1-3", _HSW),
    (r"Xeon.*\b(Platinum|Gold|Silver|Bronze)\s+\d[45]\d{2}|Xeon.*\b6\d{3}P\b|Xeon.*\bMax\b",
     "Intel Sapphire/Emerald/Granite Rapids", _AVX512 + " avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 avx_vnni"),
    (r"Xeon.*\b6\d{3}E\b", "Intel Sierra Forest", _HSW + " avx_vnni"),
    (r"Xeon.*\b(Platinum|Gold|Silver)\s+83\d{2}H", "Intel Cooper Lake", _AVX512 + " avx512_vnni avx512_bf16"),
    (r"Xeon.*\b(Platinum|Gold|Silver)\s+\d3\d{2}", "Intel Ice Lake-SP", _AVX512 + " avx512vbmi avx512_vnni"),
    (r"Xeon.*\b(Platinum|Gold|Silver|Bronze)\s+\d2\d{2}", "Intel Cascade Lake", _AVX512 + " avx512_vnni"),
    (r"Xeon.*\b(Platinum|Gold|Silver|Bronze)\s+\d1\d{2}|Xeon.*\bW-21\d{2}", "Intel Skylake-SP", _AVX512),
    (r"Core.*Ultra|i[3579]-1[234]\d{3}|i[3579]-1[234]\d{2}[A-Z]", "Intel Alder Lake and later", _HSW + " avx_vnni"),
    (r"i[3579]-1[01]\d{2}G\d|i[3579]-11\d{3}", "Intel Ice/Tiger/Rocket Lake", _AVX512 + " avx512vbmi avx512_vnni"),
    (r"i[3579]-([4-9]\d{3}|10\d{3})|Xeon.*E[35]-\d{4}\s*v[34]|Xeon.*E-2\d{3}", "Intel Haswell to Comet Lake", _HSW),
)

# system_info feature names (ggml-cpu.cpp:547-583) as runtime/variants.py names them
_INFO_FEATURES = {"AVX": "AVX", "AVX_VNNI": "AVX_VNNI", "AVX2": "AVX2", "F16C": "F16C", "FMA": "FMA", "BMI2": "BMI2",
                  "AVX512": "AVX512", "AVX512_VBMI": "AVX512_VBMI", "AVX512_VNNI": "AVX512_VNNI",
                  "AVX512_BF16": "AVX512_BF16", "AMX_INT8": "AMX_INT8"}


@dataclass(frozen=True)
class ServerCpu:
    """The variant, and how it was read from what the user said (the report's words)."""

    variant: str
    how: str


def server_variant(said: str) -> ServerCpu:
    """The variant a release llama-server loads on the machine `said` describes; UsageError in one line
    where it describes none this table knows.

    >>> server_variant("haswell").variant
    'haswell'
    >>> server_variant("AMD EPYC 7763 64-Core Processor").variant
    'haswell'
    >>> server_variant("AMD EPYC 9654 96-Core Processor").variant
    'zen4'
    >>> server_variant("Intel(R) Xeon(R) Platinum 8480+").variant
    'sapphirerapids'
    >>> server_variant("Intel(R) Core(TM) i7-12700K").variant
    'alderlake'
    >>> server_variant("flags : fpu vme sse4_2 avx f16c fma avx2 bmi2").variant
    'haswell'
    >>> server_variant("system_info: n_threads = 8 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | F16C = 1 | LLAMAFILE = 1 |").variant
    'ivybridge'
    >>> server_variant("CPU : SSE3 = 1 | SSSE3 = 1 | LLAMAFILE = 1 | REPACK = 1 |").variant
    'sse42'
    """
    text = " ".join(said.split())
    if text in VARIANTS:
        return ServerCpu(text, "given")
    if re.search(r"\b[A-Z0-9_]+ = [01]\b", text):
        return _from_system_info(text)
    m = re.match(r"^(flags\s*:\s*)?(.*)$", text)
    words = set((m.group(2) if m else text).split())
    if "sse2" in words or "sse4_2" in words or "avx" in words or (m and m.group(1)):
        best = runnable(list(VARIANTS), words)
        if best:
            return ServerCpu(best[0], "its /proc/cpuinfo flags, as ggml scores them")
    for pattern, family, flags in FAMILIES:
        if re.search(pattern, text, flags=re.I):
            best = runnable(list(VARIANTS), flags.split())
            return ServerCpu(best[0], f"{family} ({text}), as ggml scores its flags")
    raise UsageError(f"--server-cpu {said!r}: not a CPU variant ({', '.join(VARIANTS)}), nor a CPU model this table "
                     "knows: give the `flags` line of the server machine's /proc/cpuinfo, or llama-server's "
                     "system_info log line")


def _from_system_info(text: str) -> ServerCpu:
    on = {name for name, v in re.findall(r"\b([A-Z0-9_]+) = (\d+)", text) if v != "0"}
    want = {_INFO_FEATURES[f] for f in on if f in _INFO_FEATURES}
    for v in VARIANTS.values():
        have = {f for f in v.features if f not in ("SSE42", "AMX_TILE")}
        if have == want and want:
            return ServerCpu(v.name, "llama-server's system_info line (the features its CPU backend was built with)")
    if not want:
        return ServerCpu("sse42" if "SSE3" in on else "x64", "llama-server's system_info line (no AVX)")
    raise UsageError(f"--server-cpu: the system_info line's CPU features ({', '.join(sorted(want))}) are no release "
                     "variant's: the server was a native build (-march=native); give --libllama a build of its flags")
