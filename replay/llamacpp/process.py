"""Start and stop a real llama-server for tests and commands.

    with LlamaServer(ServerConfig(smol, draft_model=smol, spec_types=("draft-simple",))) as srv:
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
from pathlib import Path
from typing import Any

from replay.errors import ServerError
from replay.llamacpp.http import get_json
from replay.llamacpp.kernels import Kernels, runnable_program
from replay.settings import BY_ATTR, SETTINGS, flags_block

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


class ServerConfig:
    """A llama-server command line: the model and any flags of the settings table, by attr.

        ServerConfig(model, draft_model=draft, spec_types=("draft-simple",), n_ctx=256)

    Unless given, the replay-friendly values: one slot (`-np 1`), `-c 2048`, `-t 2`. Flags are
    written as llama-server spells them (settings/table.py); `extra_args` are passed as they are.
    """

    DEFAULTS = {"n_parallel": 1, "n_ctx": 2048, "threads": 2}

    def __init__(self, model: Path | str, *, extra_args: tuple[str, ...] = (), **flags: Any):
        unknown = set(flags) - set(BY_ATTR)
        if unknown:
            raise ValueError(f"not llama-server settings: {', '.join(sorted(unknown))}")
        self.model = Path(model)
        self.extra_args = tuple(extra_args)
        self.flags = {**self.DEFAULTS, **{k: BY_ATTR[k].parse(v) for k, v in flags.items() if v is not None}}

    def get(self, attr: str) -> Any:
        """A flag's value (None when not given): config.get("draft_model")."""
        return self.flags.get(attr)

    def __eq__(self, other) -> bool:
        return isinstance(other, ServerConfig) and (self.model, self.flags, self.extra_args) == \
            (other.model, other.flags, other.extra_args)

    def __repr__(self) -> str:
        return f"ServerConfig({self.model.name}, {' '.join(self.args()[2:])})"

    def with_flags(self, **flags: Any) -> "ServerConfig":
        return ServerConfig(self.model, extra_args=self.extra_args, **{**self.flags, **flags})

    def args(self) -> list[str]:
        a = ["-m", str(self.model)]
        for s in SETTINGS:
            v = self.flags.get(s.attr)
            if v is None:
                continue
            if s.kind == "list":
                for item in v:
                    a += [s.flag, item]
            elif s.kind == "flag":  # takes no value: given or not
                if v:
                    a.append(s.flag)
            else:
                a += [s.flag, str(v)]
        return a + list(self.extra_args)

    def flags_block(self) -> dict:
        """The transcript's `server.flags`: the flags the HTTP API does not expose."""
        return flags_block(self.flags)


class LlamaServer:
    """A running llama-server process (context manager)."""

    def __init__(self, config: ServerConfig, *, binary: Path | None = None, startup_timeout: float = 120.0,
                 log_path: Path | None = None):
        if binary is None:
            from replay.llamacpp.build import ensure_built
            binary = ensure_built().server
        self.config = config
        self.binary = Path(binary)
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.kernels: Kernels | None = None  # what it computes with: the best CPU variant that runs here

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.kernels = runnable_program(self.binary, repack=not self.config.get("no_repack"))
        cmd = [str(self.kernels.program), *self.config.args(), "--host", "127.0.0.1", "--port", str(self.port)]
        log = open(self.log_path, "wb")
        log.write(f"spec-replay: {self.kernels.program} computes with {self.kernels.describe()}\n".encode())
        log.flush()
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
