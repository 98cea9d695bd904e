"""Start and stop a real llama-server for tests and commands.

    with LlamaServer(ServerConfig(model=smol, draft=smol, spec_types=("draft-simple",))) as srv:
        post_json(srv.url, "/completion", {...})

The server runs on a free loopback port with its log captured to a file; it is
stopped on exit from the `with` block whatever happened inside it (test
failure, Ctrl-C), and at interpreter exit as a last resort.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ServerError
from .http import get_json

SPEC_TYPES = ("draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

_live: set[subprocess.Popen] = set()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - last resort
    for proc in list(_live):
        _terminate(proc)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _live.discard(proc)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the server gets SIGTERM if we die without cleaning up (e.g. SIGKILL of pytest)."""
    try:
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerConfig:
    """A llama-server command line. Defaults are the replay-friendly ones:
    one slot (`-np 1`), a fixed context and thread count."""

    model: Path
    draft: Path | None = None
    spec_types: tuple[str, ...] = ()
    draft_sampling: str | None = None  # "greedy" | "probabilistic" (b11434 only)
    draft_n_max: int | None = None
    draft_n_min: int | None = None
    draft_p_min: float | None = None
    n_parallel: int = 1
    n_ctx: int = 2048
    threads: int = 2
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for t in self.spec_types:
            if t not in SPEC_TYPES:
                raise ValueError(f"unsupported --spec-type {t!r}; supported: {', '.join(SPEC_TYPES)}")
        if self.draft_sampling not in (None, "greedy", "probabilistic"):
            raise ValueError(f"--spec-draft-sampling must be greedy or probabilistic, got {self.draft_sampling!r}")

    def args(self) -> list[str]:
        a = ["-m", str(self.model), "-np", str(self.n_parallel), "-c", str(self.n_ctx), "-t", str(self.threads)]
        if self.draft is not None:
            a += ["-md", str(self.draft)]
        for t in self.spec_types:
            a += ["--spec-type", t]
        if self.draft_sampling is not None:
            a += ["--spec-draft-sampling", self.draft_sampling]
        if self.draft_n_max is not None:
            a += ["--spec-draft-n-max", str(self.draft_n_max)]
        if self.draft_n_min is not None:
            a += ["--spec-draft-n-min", str(self.draft_n_min)]
        if self.draft_p_min is not None:
            a += ["--spec-draft-p-min", str(self.draft_p_min)]
        return a + list(self.extra_args)

    def speculative(self) -> dict:
        """The speculative configuration the HTTP API does not expose, for transcripts."""
        return {
            "types": list(self.spec_types),
            "draft_model": str(self.draft) if self.draft else None,
            "draft_sampling": self.draft_sampling or "greedy",
            "draft_n_max": self.draft_n_max,
            "draft_n_min": self.draft_n_min,
            "draft_p_min": self.draft_p_min,
            "n_parallel": self.n_parallel,
            "n_ctx": self.n_ctx,
            "threads": self.threads,
        }


class LlamaServer:
    """A running llama-server process (context manager)."""

    def __init__(self, config: ServerConfig, *, binary: Path | None = None, startup_timeout: float = 120.0,
                 log_path: Path | None = None):
        if binary is None:
            from .build import ensure_built
            binary = ensure_built().server
        self.config = config
        self.binary = Path(binary)
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("server already started")
        cmd = [str(self.binary), *self.config.args(), "--host", "127.0.0.1", "--port", str(self.port)]
        log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.pop("LLAMA_ARG_HOST", None)
        # a new session: Ctrl-C in a terminal reaches us, and we stop it ourselves
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        _live.add(self.proc)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"llama-server exited with code {self.proc.returncode} during start-up: "
                                  f"{self.last_log_line()} (log: {self.log_path})")
            try:
                health = get_json(self.url, "/health", timeout=2.0)
                if isinstance(health, dict) and health.get("status") == "ok":
                    return
            except ServerError:
                pass
            time.sleep(0.1)
        raise ServerError(f"llama-server did not become healthy within {self.startup_timeout:.0f}s (log: {self.log_path})")

    def last_log_line(self) -> str:
        try:
            lines = [l for l in self.log_path.read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            _terminate(self.proc)
            self.proc = None
