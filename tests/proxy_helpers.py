"""`spec-replay proxy` started as a user starts it (the command line, the server's flags), and the values
the OpenAI SDK reads off its answers, for the live proxy tests."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from replay.llamacpp.process import free_port
from replay.proxy.filler import Filled, Filler


def workers_of(pid: int) -> dict[int, str]:
    """{pid: state} of the live processes two generations below `pid`: a proxy's replay workers, forked by
    its forkserver ("R" while one computes)."""
    kids: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # a zombie is dead, only not reaped yet
            kids.setdefault(int(fields[1]), []).append((int(stat.parent.name), fields[0]))
    return {w: state for child, _ in kids.get(pid, []) for w, state in kids.get(child, [])}


@contextlib.contextmanager
def running_proxy(upstream: str, args: list[str], log: Path, pids: list | None = None) -> Iterator[str]:
    """`spec-replay proxy UPSTREAM ARGS... --port P -v`, its stderr in `log` (its Popen appended to `pids`);
    yields its URL once /health answers through it."""
    port = free_port()
    argv = [sys.executable, "-m", "replay.cli", "proxy", upstream, *map(str, args), "--port", str(port), "-v"]
    with open(log, "w") as err:
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=os.environ.copy())
    if pids is not None:
        pids.append(p)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if p.poll() is not None:
                    pytest.fail(f"the proxy exited: {log.read_text()}")
                time.sleep(0.2)
        yield url
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(timeout=90)


def values(choice) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, logprob, top_logprobs) of a chat choice's tokens."""
    return [(c.token, c.logprob, [(a.token, a.logprob) for a in c.top_logprobs]) for c in choice.logprobs.content]


def streamed(chunks) -> list[tuple[str, float, list[tuple[str, float]]]]:
    out = []
    for ch in chunks:
        for c in ch.choices:
            if c.logprobs and c.logprobs.content:
                out += [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in c.logprobs.content]
    return out


def completion_values(choices) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(id, logprob, top) of /v1/completions choices (or a stream's chunks' choices, in order): llama-server
    sends them as `logprobs.content`, which the SDK's Completion keeps as an extra field."""
    out = []
    for c in choices:
        for e in ((c.logprobs.model_dump().get("content") or []) if c.logprobs else []):
            out.append((e["id"], e["logprob"], [(t["id"], t["logprob"]) for t in e["top_logprobs"]]))
    return out


def native_values(response: dict) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(id, logprob, top) of a /completion response's completion_probabilities."""
    return [(e["id"], e["logprob"], [(t["id"], t["logprob"]) for t in e["top_logprobs"]])
            for e in response["completion_probabilities"]]


def assert_same(got, truth, tol: float = 5e-4) -> None:
    """The server's tokens, and every value within `tol` of the truth's (a patched server's)."""
    assert [g[0] for g in got] == [t[0] for t in truth]
    for (tok, lp, top), (_, lp_t, top_t) in zip(got, truth):
        assert abs(lp - lp_t) <= tol, (tok, lp, lp_t)
        assert [a for a, _ in top] == [a for a, _ in top_t]
        assert all(abs(x - y) <= tol for (_, x), (_, y) in zip(top, top_t))


class SlowFiller(Filler):
    """A Filler whose every replay takes `seconds` longer: a replay of the tiny fixtures, which takes
    milliseconds, made as long as a real model's, so that a test can place an event inside one."""

    def __init__(self, *args, seconds: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = seconds

    def fill(self, transcript: dict, seq: int | None = None) -> Filled:
        time.sleep(self.seconds)
        return super().fill(transcript, seq)
