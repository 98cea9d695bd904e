"""`spec-replay proxy`'s memory over many requests.

    python3 bench/proxy_memory.py [N]              # N requests (10,000 if left out), one client after another
    python3 bench/proxy_memory.py [N] --recorded   # the same, in front of a recorded upstream

A b11434 llama-server running the tiny fixture target drafted by the tiny draft model (draft-simple, one
slot, -c 256) and `spec-replay proxy` in front of it (one worker, from the command line as a user starts
it) are sent N /completion requests, alternately asking for probabilities (24 tokens, n_probs 3, a seed
each: filled by the worker) and not (passed through). Every N/10 requests it prints the resident memory
(VmRSS) of the proxy's process and of its worker, and at the end the growth of each from the first line
to the last. Every response must be 200, and every one that asked for probabilities exact (X-Spec-Replay-Filled
sent), else it stops.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replay.llamacpp.build import BuildSpec, ensure_built  # noqa: E402
from replay.llamacpp.kernels import variants_that_run  # noqa: E402
from replay.llamacpp.process import LlamaServer, ServerConfig, free_port  # noqa: E402
from replay.paths import FIXTURES  # noqa: E402

TARGET, DRAFT = FIXTURES / "tiny-target.gguf", FIXTURES / "tiny-draft.gguf"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def workers(pid: int) -> list[int]:
    """The proxy's replay workers: the processes its forkserver forked."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return [w for child in kids.get(pid, []) for w in kids.get(child, [])]


def post(url: str, body: dict, endpoint: str = "/completion") -> tuple[int, dict]:
    req = urllib.request.Request(url + endpoint, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {"x-spec-replay-unfilled": e.read().decode()[:300]}


def recorded_upstream(t: dict) -> str:
    """An upstream answering as the b11434 server `t` was recorded from (tests/test_proxy.py
    recorded_server), on loopback in a thread of this process: its URL."""
    import asyncio
    import threading
    sys.path.insert(0, str(REPO / "tests"))
    from aiohttp import web
    from test_proxy import recorded_server
    port, ready = free_port(), threading.Event()

    def serve() -> None:
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(recorded_server(t))
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()
    threading.Thread(target=serve, daemon=True).start()
    ready.wait(30)
    return f"http://127.0.0.1:{port}"


def main_recorded(n: int) -> None:
    """The proxy (one worker, from the command line) in front of a recorded upstream: the committed
    tiny-v1-chat transcript's server (b11434, the tiny target drafted by the tiny draft), answering every
    chat request with that response; every other request asks for logprobs (filled by the worker), the
    rest ask for none (passed through)."""
    t = json.loads((FIXTURES / "transcripts" / "tiny-v1-chat.json").read_text())
    asks = {k: v for k, v in t["request"].items() if k not in t["added_fields"] or k == "cache_prompt"}
    plain = {k: v for k, v in asks.items() if k not in ("logprobs", "top_logprobs")}
    upstream = recorded_upstream(t)
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "replay.cli", "proxy", upstream, "-m", str(TARGET), "--port",
                              str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url)
        print(f"recorded upstream (tiny-v1-chat.json, b11434), {n} requests, every other one filled; "
              f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
        _drive(url, proxy, n, lambda k: asks if k % 2 else plain, t["endpoint"])
    finally:
        proxy.terminate()
        proxy.wait(timeout=90)


def _wait(url: str) -> None:
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)


def _drive(url: str, proxy: subprocess.Popen, n: int, body_of: Callable[[int], dict], endpoint: str) -> None:
    print(f"{'requests':>9} {'proxy MiB':>10} {'worker MiB':>11} {'s':>7}")
    first, started, filled, row = None, time.perf_counter(), 0, None
    for k in range(1, n + 1):
        status, headers = post(url, body_of(k), endpoint)
        if status != 200 or (k % 2 and "x-spec-replay-filled" not in headers):
            sys.exit(f"request {k}: HTTP {status}, {headers.get('x-spec-replay-unfilled', 'not filled')}")
        filled += int(headers.get("x-spec-replay-filled", "0"))
        if k % max(1, n // 10) == 0:
            w = workers(proxy.pid)
            row = (rss_kib(proxy.pid) / 1024, sum(rss_kib(p) for p in w) / 1024)
            first = first or row
            print(f"{k:>9} {row[0]:>10.1f} {row[1]:>11.1f} {time.perf_counter() - started:>7.0f}", flush=True)
    print(f"growth from the first line to the last: proxy {row[0] - first[0]:+.1f} MiB, "
          f"worker {row[1] - first[1]:+.1f} MiB; {filled} values filled")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 10_000
    if "--recorded" in sys.argv:
        return main_recorded(n)
    built = ensure_built(BuildSpec("b11434"))
    variant = variants_that_run(built.bin_dir)[0]
    cfg = ServerConfig(TARGET, n_ctx=256, draft_model=DRAFT, spec_types=("draft-simple",))
    with LlamaServer(cfg, binary=built.server) as srv:
        port = free_port()
        argv = [sys.executable, "-m", "replay.cli", "proxy", srv.url, "-m", str(TARGET), "-md", str(DRAFT),
                "--spec-type", "draft-simple", "-c", "256", "-np", "1", "--server-cpu", variant, "--port", str(port)]
        proxy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(url)
            print(f"b11434 ({variant}), tiny target + tiny draft, {n} requests, every other one filled; "
                  f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
            _drive(url, proxy, n, lambda k: {"prompt": "bcdbc" + "ab" * (k % 7), "n_predict": 24, "temperature": 1.0,
                                              "seed": k, "cache_prompt": False, **({"n_probs": 3} if k % 2 else {})},
                   "/completion")
        finally:
            proxy.terminate()
            proxy.wait(timeout=90)


if __name__ == "__main__":
    main()
