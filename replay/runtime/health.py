"""Which libllama builds and CPU variants run on this host: known by running them, before one is
loaded in-process or given to a llama-server.

CPU flags say what a host should run (runtime/variants.py: `runnable`, ggml's own `score`). That is
not enough: on a Sapphire Rapids class VM that advertises AMX and runs a small AMX program, ggml's
AMX kernels die all the same (SIGILL at `tilezero` in `tinygemm_kernel_amx`, b11434's sapphirerapids
variant; SIGSEGV at `ldtilecfg` in `ggml_backend_amx_mul_mat`, a -march=native build). A process that
computes with such kernels is lost, so each library and variant is first run in a subprocess
(runtime/health_probe.py): it loads the library and the variant, a small quantized model whose weights
take ggml's extra-buffer paths (AMX: ggml-cpu/amx/amx.cpp:145-190; the CPU repack:
ggml-cpu/repack.cpp:4974ff), and decodes a prompt batch, a verify-sized batch and single tokens (AMX
computes several rows with tiles, one row with AVX-512 VNNI: ggml-cpu/amx/mmq.cpp:2435), first without
extra buffer types (what `--no-repack` runs) and then with them. How the subprocess ends is the
verdict (`Health`), kept per host and library under the cache root (`health/`): each is probed once.

Fault injection, for the hosts that have no AMX: SPEC_REPLAY_INJECT_CRASH names variants whose probe
dies of a signal once it computes with extra buffer types, as the AMX kernels do
(`sapphirerapids:SIGILL,haswell:SIGSEGV`; `:always` dies before the first decode too; `native` names
a library with its CPU backend linked in, llama-cpp-python's own among them).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from replay.paths import cache_root

LIB_ENV = "SPEC_REPLAY_LIBLLAMA"  # the libllama (file or directory) the binding loads; unset: llama-cpp-python's own
VARIANT_ENV = "SPEC_REPLAY_CPU_VARIANT"  # which libggml-cpu-<variant>.so of a release-style build it loads
CHILD_ENV = "SPEC_REPLAY_HEALTH_PROBE"  # set in the probe's own process: it runs what it is told to, unchecked
INJECT_ENV = "SPEC_REPLAY_INJECT_CRASH"
CACHE_ENV = "SPEC_REPLAY_HEALTH_CACHE"  # where verdicts are kept (default: <cache root>/health)
NATIVE = "native"  # the name of a library whose one CPU backend is linked in (no variants)
PROBE_VERSION = 1  # bumped when the probe's model or decodes change: every verdict is then probed again
TIMEOUT = 300.0  # seconds; the probe takes about one on an idle host
OK = "ok"
NOT_RUN = "not run"


@dataclass(frozen=True)
class Health:
    """How a library (and CPU variant) ran the probe: `plain` without extra buffer types, `extra`
    with them (the CPU repack, AMX), each "ok", the signal it died of ("SIGILL"), "hung", "not run"
    (it died before), or "error: ..." (the probe could not run it: not a crash). `buffers` are the
    extra buffer types the probe model's weights took."""

    name: str  # the variant, or NATIVE for a library whose CPU backend is linked in
    plain: str
    extra: str
    buffers: tuple[str, ...] = ()
    injected: bool = False  # the verdict comes from SPEC_REPLAY_INJECT_CRASH

    def runs(self, repack: bool = True) -> bool:
        """Does it compute here: with extra buffer types (`repack`, llama.cpp's default) or without
        (--no-repack)?

        >>> h = Health("sapphirerapids", OK, "SIGILL", ("AMX", "CPU_REPACK"))
        >>> h.runs(), h.runs(repack=False)
        (False, True)
        """
        return self.plain == OK and (not repack or self.extra == OK)

    @property
    def crashed(self) -> bool:
        """It died of a signal or hung (not: the probe could not run it)."""
        return any(v.startswith("SIG") or v == "hung" for v in (self.plain, self.extra))

    def describe(self, label: str | None = None) -> str:
        """One line on what runs, as --version, check and the reports say it.

        >>> print(Health("sapphirerapids", OK, "SIGILL", ("AMX", "CPU_REPACK")).describe())
        sapphirerapids: crashes on this host (SIGILL with its AMX, CPU_REPACK weights; runs with --no-repack)
        >>> print(Health("zen4", OK, OK, ("CPU_REPACK",)).describe())
        zen4: runs on this host
        >>> print(Health("native", "SIGSEGV", NOT_RUN).describe("llama-cpp-python's own libllama"))
        llama-cpp-python's own libllama: crashes on this host (SIGSEGV)
        """
        who = label or self.name
        fake = " (injected: SPEC_REPLAY_INJECT_CRASH)" if self.injected else ""
        if self.runs():
            return f"{who}: runs on this host"
        if self.plain == OK:
            weights = f" with its {', '.join(self.buffers)} weights" if self.buffers else " with extra buffer types"
            what = "crashes on this host" if self.crashed else "fails on this host"
            return f"{who}: {what} ({self.extra}{weights}; runs with --no-repack){fake}"
        what = "crashes on this host" if self.crashed else "cannot run on this host"
        return f"{who}: {what} ({self.plain}){fake}"


# --- fault injection -------------------------------------------------------------------------------

def injected_crash(name: str, environ: dict | None = None) -> tuple[int, bool] | None:
    """(the signal, whether before the first decode too) that SPEC_REPLAY_INJECT_CRASH gives the probe
    of `name`, or None.

    >>> injected_crash("sapphirerapids", {INJECT_ENV: "sapphirerapids:SIGILL, zen4:SIGSEGV:always"})
    (<Signals.SIGILL: 4>, False)
    >>> injected_crash("zen4", {INJECT_ENV: "sapphirerapids:SIGILL,zen4:SIGSEGV:always"})
    (<Signals.SIGSEGV: 11>, True)
    >>> injected_crash("haswell", {INJECT_ENV: "sapphirerapids:SIGILL"}) is None
    True
    """
    spec = (environ if environ is not None else os.environ).get(INJECT_ENV, "")
    for item in spec.split(","):
        parts = [p.strip() for p in item.split(":")]
        if len(parts) >= 2 and parts[0] == name:
            try:
                sig = signal.Signals[parts[1].upper() if parts[1].upper().startswith("SIG") else "SIG" + parts[1].upper()]
            except KeyError:
                raise ValueError(f"{INJECT_ENV}: {parts[1]!r} is not a signal name") from None
            return sig, len(parts) > 2 and parts[2] == "always"
    return None


# --- the host and the library, as a verdict's key --------------------------------------------------

def host_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """What a verdict depends on besides the library: the CPU (model, flags, microcode) and the kernel
    (which grants AMX tile state), so a cache shared by several machines keeps one verdict per kind."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""

    def field(name: str) -> str:
        m = re.search(rf"^{name}\s*:\s*(.*)$", text, flags=re.M)
        return m.group(1).strip() if m else ""
    flags = " ".join(sorted(field("flags").split()))
    return {"cpu": field("model name"), "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "microcode": field("microcode"), "kernel": platform.release(), "machine": platform.machine()}


def _file_ids(lib_dir: Path) -> list:
    out = []
    for f in sorted(Path(lib_dir).glob("lib*.so*")):
        if f.is_file():
            st = f.stat()
            out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def verdict_key(lib_dir: Path, name: str) -> str:
    """The cache key of one verdict: host, the library's files (name, size, mtime), the variant, the
    probe's version and any injected crash for it."""
    inj = injected_crash(name)
    parts = {"host": host_identity(), "lib": str(Path(lib_dir).resolve()), "files": _file_ids(lib_dir), "name": name,
             "probe": PROBE_VERSION, "inject": None if inj is None else [int(inj[0]), inj[1]]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def verdict_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else cache_root() / "health"


def probe_model_path() -> Path:
    """The probe's model (runtime/health_probe.py writes it on first use), beside the verdicts."""
    return verdict_dir() / f"probe-model-v{PROBE_VERSION}.gguf"


# --- running the probe -----------------------------------------------------------------------------

def parse_probe(name: str, returncode: int | None, stdout: str, injected: bool = False) -> Health:
    """The verdict from how the probe ended (`returncode` None: it hung) and the lines it printed
    (`buffers A,B`, `ok plain`, `ok extra`, `error MESSAGE`).

    >>> parse_probe("zen4", 0, "ok plain\\nbuffers CPU_REPACK\\nok extra\\n")
    Health(name='zen4', plain='ok', extra='ok', buffers=('CPU_REPACK',), injected=False)
    >>> parse_probe("sapphirerapids", -4, "ok plain\\nbuffers AMX,CPU_REPACK\\n").describe()
    'sapphirerapids: crashes on this host (SIGILL with its AMX, CPU_REPACK weights; runs with --no-repack)'
    >>> parse_probe("x64", 3, "error libllama could not load the model\\n").plain
    'error: libllama could not load the model'
    """
    lines = stdout.splitlines()
    done = {l.split()[1] for l in lines if l.startswith("ok ") and len(l.split()) > 1}
    buffers = next((tuple(b for b in l.split(None, 1)[1].split(",") if b) for l in lines
                    if l.startswith("buffers ") and len(l.split()) > 1), ())
    if returncode is None:
        end = "hung"
    elif returncode < 0:
        try:
            end = signal.Signals(-returncode).name
        except ValueError:
            end = f"signal {-returncode}"
    elif returncode == 0 and "extra" in done:
        end = OK
    else:
        msg = next((l.split(None, 1)[1] for l in reversed(lines) if l.startswith("error ") and len(l.split()) > 1),
                   f"exit {returncode}")
        end = f"error: {msg}"
    plain = OK if "plain" in done else end
    extra = OK if "extra" in done else (end if "plain" in done else NOT_RUN)
    return Health(name, plain, extra, buffers, injected)


def _run_probe(lib_dir: Path, name: str, *, bundled: bool) -> Health:
    env = dict(os.environ)
    env[CHILD_ENV] = "1"
    env[CACHE_ENV] = str(verdict_dir())
    if bundled:
        env.pop(LIB_ENV, None)
    else:
        env[LIB_ENV] = str(Path(lib_dir).absolute())
    if name == NATIVE:
        env.pop(VARIANT_ENV, None)
    else:
        env[VARIANT_ENV] = name
    cmd = [sys.executable, "-m", "replay.runtime.health_probe", str(probe_model_path()), name]
    try:
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        rc, out = done.returncode, done.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = None, (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "")
    return parse_probe(name, rc, out, injected=injected_crash(name) is not None)


def health(lib_dir: Path, name: str = NATIVE, *, bundled: bool = False, probe: bool = True) -> Health | None:
    """The verdict on `name` (a variant of the release-style library in `lib_dir`, or NATIVE for one
    whose CPU backend is linked in; `bundled`: llama-cpp-python's own), from the cache, else probed in
    a subprocess (None without `probe`). Crashes and clean runs are kept; an error of the probe itself
    is not."""
    path = verdict_dir() / f"{verdict_key(lib_dir, name)}.json"
    try:
        d = json.loads(path.read_text())
        return Health(d["name"], d["plain"], d["extra"], tuple(d.get("buffers", ())), bool(d.get("injected")))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not probe:
        return None
    got = _run_probe(lib_dir, name, bundled=bundled)
    if not (got.plain.startswith("error") or got.extra.startswith("error")):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(got)))
            os.replace(tmp, path)
        except OSError:  # a read-only cache: probed again next time
            pass
    return got


def first_that_runs(lib_dir: Path, names: Sequence[str], *, repack: bool = True,
                    on_probe: Callable[[str], None] | None = None) -> tuple[str | None, list[Health]]:
    """The first of `names` (best first: runtime/variants.py runnable) that runs here with (or, not
    `repack`, without) extra buffer types, and the verdicts of those before it that do not."""
    failed: list[Health] = []
    for n in names:
        known = health(lib_dir, n, probe=False)
        if known is None and on_probe is not None:
            on_probe(n)
        h = known or health(lib_dir, n)
        assert h is not None
        if h.runs(repack):
            return n, failed
        failed.append(h)
    return None, failed


def verdicts(lib_dir: Path, names: Iterable[str], *, probe: bool = True) -> dict[str, Health]:
    """{name: verdict} of every one of `names` (probed where not known, unless not `probe`)."""
    out = {}
    for n in names:
        h = health(lib_dir, n, probe=probe)
        if h is not None:
            out[n] = h
    return out
