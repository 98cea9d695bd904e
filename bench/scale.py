"""The scale part of the benchmark (bench.py runs it): workers, threads, Ray, and the patched server.

* one JSONL of N_RECORDS independent records (a speculating server's responses, SmolLM2), recovered
  by `spec-replay recover` with 1 worker x 1 thread, 1 worker x 2 threads, 2 workers x 1 thread, and
  2 Ray actors x 1 thread on a local 2-CPU head; every output is checked byte-identical; a quarter
  of it traced with 1 and 2 workers (the same JSON);
* the patched llama-server (spec-replay patch) against the unpatched one, both speculating, with
  n_probs 0 and 5: generated tokens per second of the same requests, measured alternately.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.build import BuildSpec, ensure_built
from replay.llamacpp.http import post_json
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.proof.patch_proof import pinned_tree, saved_patch
from replay.proof.patches import server_patch
from replay.transcripts.format import dumps

N_RECORDS = 64
N_PREDICT = 32
N_TRACED = 16
SERVER_REPS = 3


def _recover(src: Path, model: Path, out: Path, *extra: str) -> float:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "replay.cli", "recover", str(src), "-m", str(model), "-o", str(out),
                        "--force", *extra], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"recover {' '.join(extra)} failed: {p.stderr[-2000:]}")
    return time.perf_counter() - t


def _trace(src: Path, model: Path, *extra: str) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "replay.cli", "trace", str(src), "-m", str(model), "--json", *extra],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"trace {' '.join(extra)} failed: {p.stderr[-2000:]}")
    return time.perf_counter() - t, p.stdout


def _ray_head() -> tuple[str, str]:
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([ray, "start", "--head", "--num-cpus", "2", "--port", str(port), "--node-ip-address", "127.0.0.1",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True,
                   env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    return ray, f"127.0.0.1:{port}"


def workers_rows(spec: LlamaServer, spec_info: dict, smol: Path, tmp: Path) -> list[list]:
    lines = []
    for k in range(N_RECORDS):
        b = {"prompt": f"Story {k}: once upon a time", "n_predict": N_PREDICT, "n_probs": 5, "temperature": 0.8,
             "seed": k + 1, "cache_prompt": False, "ignore_eos": True}
        lines.append(dumps(record_one(spec.url, RequestItem("/completion", b), spec_info), indent=None))
    src = tmp / "scale.jsonl"
    src.write_text("\n".join(lines) + "\n")
    runs = {"1x1": ("-t", "1"), "1x2": ("-t", "2"), "2x1": ("--workers", "2", "-t", "1")}
    t: dict[str, float] = {}
    outs: dict[str, bytes] = {}
    for name, extra in runs.items():
        t[name] = _recover(src, smol, tmp / f"scale-{name}.jsonl", *extra)
        outs[name] = (tmp / f"scale-{name}.jsonl").read_bytes()
    ray, addr = _ray_head()
    try:
        t["ray"] = _recover(src, smol, tmp / "scale-ray.jsonl", "--ray", addr, "--workers", "2", "-t", "1")
        outs["ray"] = (tmp / "scale-ray.jsonl").read_bytes()
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True)
    assert len(set(outs.values())) == 1, "the outputs differ between worker counts"
    n = N_RECORDS * N_PREDICT
    few = tmp / "trace.jsonl"  # trace replays drafting too: a quarter of the file keeps the bench short
    few.write_text("\n".join(lines[:N_TRACED]) + "\n")
    t["trace1"], trace1 = _trace(few, smol, "-t", "1")
    t["trace2"], trace2 = _trace(few, smol, "--workers", "2", "-t", "1")
    assert trace1 == trace2, "trace --workers 2 printed something else than one worker"

    def fig(a: str, b: str) -> str:
        return f"{t[a]:.1f} s vs {t[b]:.1f} s ({n / t[a]:.0f} vs {n / t[b]:.0f} tok/s)"
    return [
        [f"recover {N_RECORDS} records: 2 workers x 1 thread / 1 worker x 1 thread (speed-up)",
         f"{t['1x1'] / t['2x1']:.2f}x", fig("2x1", "1x1"), ">= 1.6x on 2 cores"],
        ["  2 workers x 1 thread / 1 worker x 2 threads (speed-up)", f"{t['1x2'] / t['2x1']:.2f}x",
         fig("2x1", "1x2"), "> 1x"],
        ["  Ray, 2 actors x 1 thread / --workers 2 x 1 thread (time)", f"{t['ray'] / t['2x1']:.2f}x",
         fig("ray", "2x1") + "; Ray start-up included, head started before", "<= 1.3x"],
        ["  outputs of all four", "identical", f"{len(outs['1x1'])} bytes each", "identical"],
        [f"trace {N_TRACED} of those records: 2 workers x 1 thread / 1 worker x 1 thread (speed-up)",
         f"{t['trace1'] / t['trace2']:.2f}x", f"{t['trace2']:.1f} s vs {t['trace1']:.1f} s; the same JSON", "> 1x"],
    ]


def _tok_per_s(url: str, n_probs: int) -> float:
    b = {"prompt": "Once upon a time", "n_predict": 200, "n_probs": n_probs, "temperature": 0.8, "seed": 1,
         "ignore_eos": True, "cache_prompt": False}
    t = time.perf_counter()
    r = post_json(url, "/completion", b)
    wall = time.perf_counter() - t
    return r["timings"]["predicted_n"] / wall


def patched_server_rows(smol: Path) -> list[list]:
    plain = ensure_built(BuildSpec("b11434"))
    patch = server_patch(pinned_tree("b11434"))
    patched = ensure_built(BuildSpec("b11434", patch=saved_patch(patch.diff, f"server-{patch.profile}")))
    cfg = ServerConfig(smol, draft_model=smol, spec_types=("draft-simple",), n_ctx=4096)
    best: dict[tuple[str, int], float] = {}
    with LlamaServer(cfg, binary=plain.server) as a, LlamaServer(cfg, binary=patched.server) as b:
        print(f"servers: {a.kernels.describe()}", file=sys.stderr)
        for url in (a.url, b.url):
            _tok_per_s(url, 5)  # warm
        for _ in range(SERVER_REPS):
            for name, url in (("unpatched", a.url), ("patched", b.url)):
                for n_probs in (0, 5):
                    v = _tok_per_s(url, n_probs)
                    best[(name, n_probs)] = max(best.get((name, n_probs), 0.0), v)
    rows = []
    for n_probs in (0, 5):
        p, u = best[("patched", n_probs)], best[("unpatched", n_probs)]
        rows.append([f"patched / unpatched speculating server, n_probs {n_probs} (tok/s)", f"{p / u:.2f}x",
                     f"{p:.1f} vs {u:.1f} tok/s", ">= 0.95x" if n_probs == 0 else "(the cost of real probs)"])
    return rows
