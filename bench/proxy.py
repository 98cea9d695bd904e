"""`spec-replay proxy` against the server directly, side by side in one run.

    python3 bench/proxy.py            # 8 requests each way, 8 streamed each way, then 8 concurrent clients

A b11434 llama-server (SmolLM2 Q4_1, its Q2_K requantisation as draft-simple, one slot, -t 2) and
`spec-replay proxy` in front of it (one worker, started from the command line as a user starts it) are
sent the same chat requests (24 tokens, temperature 1, top_logprobs 3, seeds 1..8) with the OpenAI SDK:
first one at a time, alternating direct and through the proxy (the proxy's first request, which chooses
the engine, is a warm-up and not counted), then the same requests streamed (seeds 11..18), then 8 clients
at once, each way. Printed: the mean time of a response each way and their ratio; for the streams, the mean
time to the first token's event and to the stream's end, each way; the requests per second of the 8
clients each way and their ratio.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from openai import AsyncOpenAI, OpenAI  # noqa: E402

from replay.llamacpp import models  # noqa: E402
from replay.llamacpp.build import BuildSpec, ensure_built  # noqa: E402
from replay.llamacpp.kernels import variants_that_run  # noqa: E402
from replay.llamacpp.process import LlamaServer, ServerConfig, free_port  # noqa: E402

N = 8


def request(seed: int) -> dict:
    return dict(model="m", messages=[{"role": "user", "content": f"Write a short story about lighthouse {seed}."}],
                max_tokens=24, temperature=1.0, seed=seed, logprobs=True, top_logprobs=3)


def start_proxy(upstream: str, config: ServerConfig, variant: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "replay.cli", "proxy", upstream, *config.args(), "--port", str(port),
                          "--server-cpu", variant, "-v"], stdout=subprocess.DEVNULL,
                         stderr=open(os.environ.get("PROXY_LOG", os.devnull), "w"),
                         env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return p, url
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the proxy did not start")


def one(base: str, seed: int) -> float:
    t0 = time.perf_counter()
    OpenAI(base_url=base + "/v1", api_key="none").chat.completions.create(**request(seed))
    return time.perf_counter() - t0


def streamed(base: str, seed: int) -> tuple[float, float]:
    """(seconds to the first event that carries a token, seconds to the stream's end)"""
    t0, first = time.perf_counter(), None
    for chunk in OpenAI(base_url=base + "/v1", api_key="none").chat.completions.create(**request(seed), stream=True):
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


async def concurrent(base: str) -> float:
    async with AsyncOpenAI(base_url=base + "/v1", api_key="none") as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(c.chat.completions.create(**request(100 + s)) for s in range(N)))
        return N / (time.perf_counter() - t0)


def main() -> None:
    bins = ensure_built(BuildSpec("b11434"))
    target = models.smollm2()
    config = ServerConfig(target, draft_model=models.smollm2_draft(bins.quantize), spec_types=("draft-simple",))
    server = LlamaServer(config, binary=bins.server)
    server.start()
    proxy = None
    try:
        proxy, url = start_proxy(server.url, config, variants_that_run(bins.bin_dir)[0])
        one(url, 99)  # the engine is chosen on the proxy's first request
        direct, through = [], []
        for s in range(1, N + 1):
            direct.append(one(server.url, s))
            through.append(one(url, s))
        d, p = sum(direct) / N, sum(through) / N
        print(f"one at a time: direct {d:.3f} s, through the proxy {p:.3f} s a response: {p / d:.1f}x")
        sd, sp = [], []
        for s in range(11, N + 11):
            sd.append(streamed(server.url, s))
            sp.append(streamed(url, s))
        (fd, ed), (fp, ep) = ([sum(x) / N for x in zip(*t)] for t in (sd, sp))
        print(f"streamed, one at a time: the first token's event directly {fd:.3f} s, through the proxy {fp:.3f} s "
              f"({fp / fd:.1f}x); the stream's end {ed:.3f} s, {ep:.3f} s ({ep / ed:.1f}x)")
        rd, rp = asyncio.run(concurrent(server.url)), asyncio.run(concurrent(url))
        print(f"{N} clients at once: direct {rd:.2f} requests/s, through the proxy {rp:.2f}: {rd / rp:.1f}x fewer")
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=30)
        server.stop()


if __name__ == "__main__":
    main()
