"""recover on the server's own schedule against the one-token schedule and against the server itself.

    python3 bench/schedule.py            # SmolLM2 (a Q2_K draft, then drafting for itself) and Gemma 3
    python3 bench/schedule.py haswell    # the servers on one variant: another machine's, as a user's colleague's

For each configuration a default-flag b11434 llama-server (4 slots, unified KV, flash attention auto)
is sent three chat requests in turn, each with a prompt of about 1,200 tokens, 64 tokens out, and
recorded with `record`. The same records are then recovered, each measurement in a fresh process:

- **server schedule**: `replay.recover()` as the command line runs it (every token's row computed in
  the kind of decode the server computed it in, schedule/rows.py), the CPU kernels given
  (`server_cpu`: the variant the server ran), so no probe;
- **one-token schedule**: the same, every row decoded alone on the server's `-t` (what recover did
  before schedule/rows.py): how far its values are from the server's schedule (max |diff| over
  every value written) and what it costs;
- **with the kernel probe**: the server schedule with the kernels found from the transcript, twice:
  with the probe cache off (`SPEC_REPLAY_PROBE_CACHE=0`: every candidate evaluates the prompt), and
  with an empty probe cache of its own (`SPEC_REPLAY_PROBE_CACHE=DIR`), as a user's first transcript of
  a model pays it (the model's kernel classes learnt from their signatures, then one probe per class).

Each recover time is the whole `replay.recover()` call: the model loaded, the contexts made, every
record replayed and written. The server's is its own `timings.prompt_ms + predicted_ms` summed over the
records (model load not counted), and beside it its start-up (the process started to /health ready, both
models loaded): what regenerating the records would add; the server is run again between the replays
(a fresh process, the same requests), the fastest of its runs kept as the replays' are. "records 2-3" is what each record after the
first adds: recover of the file less recover of its first record alone, against the server's time for
records 2 and 3 (a run's fixed cost, loading the models and the process, is the first record's). Timed
runs are measured alternately, twice, the fastest kept.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tabulate import tabulate  # noqa: E402

from replay.commands.record import RequestItem, record_one  # noqa: E402
from replay.llamacpp import models  # noqa: E402
from replay.llamacpp.build import BuildSpec, ensure_built  # noqa: E402
from replay.llamacpp.kernels import variants_that_run  # noqa: E402
from replay.llamacpp.process import LlamaServer, ServerConfig  # noqa: E402
from replay.transcripts.entries import record_entries  # noqa: E402
from replay.transcripts.format import dumps, final_response  # noqa: E402
from replay.transcripts.readers import read_text  # noqa: E402

STORY = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
         "in his book. ")
TOPICS = ("Retell the story in your own words.", "What did the keeper write, and why?",
          "Tell the story from the lamp's point of view.")
REPS = 2


def _requests(temp: float) -> list[RequestItem]:
    return [RequestItem("/v1/chat/completions", {"messages": [{"role": "user", "content": STORY * 46 + topic}],
                                                 "max_tokens": 64, "logprobs": True, "top_logprobs": 2,
                                                 "temperature": temp, "seed": 11 + k})
            for k, topic in enumerate(TOPICS)]


def _child(mode: str, transcript: str, model: str, cpu: str, out: str) -> None:
    """One measurement in this fresh process: prints the seconds replay.recover() took."""
    import replay
    if mode == "one-token":  # the schedule before schedule/rows.py: every row alone on the server's -t
        from replay.commands.recover import Recoverer
        Recoverer._scored = lambda self, rec, read: [None] * len(read.plan)
    from replay.commands.recover import RecoverOptions
    # the one-token schedule's real entries past 256 positions disagree with the server's, and recover would
    # write nothing: a tolerance of a nat lets it write the values it computed, to measure how far off they are
    options = RecoverOptions(tolerance=1.0) if mode == "one-token" else None
    t = time.perf_counter()
    res = replay.recover(transcript, model=model, server_cpu=None if mode.startswith("probe") else cpu, options=options,
                         say=lambda line, warning: None)
    seconds = time.perf_counter() - t
    if not res.repaired:
        raise SystemExit(f"{mode}: recover wrote nothing: {[r.summary()['counts'] for r in res.records]}")
    Path(out).write_text(res.repaired)
    print(json.dumps({"seconds": seconds, "mismatch": sum(r.summary()["counts"]["mismatch"] for r in res.records)}))


def _measure(mode: str, transcript: Path, model: Path, cpu: str, out: Path) -> dict:
    env = None
    if mode == "probe-off":
        env = dict(os.environ, SPEC_REPLAY_PROBE_CACHE="0")
    elif mode == "probe-first":
        env = dict(os.environ, SPEC_REPLAY_PROBE_CACHE=tempfile.mkdtemp(prefix="probe-cache-"))
    p = subprocess.run([sys.executable, __file__, "--child", mode, str(transcript), str(model), cpu, str(out)],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _max_diff(a: Path, b: Path) -> tuple[float, int]:
    """max |a - b| over every value of every entry of two repaired JSONL files, and the values over 5e-4."""
    worst, over = 0.0, 0
    for la, lb in zip(a.read_text().splitlines(), b.read_text().splitlines()):
        ea = record_entries(read_text(la, "a")[0])
        eb = record_entries(read_text(lb, "b")[0])
        for x, y in zip(ea, eb):
            for u, v in [(x.logprob, y.logprob)] + [(s[2], t[2]) for s, t in zip(x.top, y.top)]:
                d = abs(u - v)
                worst, over = max(worst, d), over + (d > 5e-4)
    return worst, over


def _serve(cfg: ServerConfig, binary: Path, temp: float) -> tuple[list[dict], float, float, float]:
    """The requests sent in turn to a fresh server: (its records, its start-up to /health ready, its own
    prompt + generation time over them, that time for records 2 and 3)."""
    records = []
    t0 = time.perf_counter()
    with LlamaServer(cfg, binary=binary) as srv:
        startup = time.perf_counter() - t0  # to /health ready: loading both models, what regenerating adds
        for item in _requests(temp):
            records.append(record_one(srv.url, item, srv.config.flags_block()))
    each = [sum((final_response(r) or {}).get("timings", {}).get(k, 0) for k in ("prompt_ms", "predicted_ms")) / 1000
            for r in records]
    return records, startup, sum(each), sum(each[1:])


def run_case(name: str, cfg: ServerConfig, model: Path, binary: Path, cpu: str, temp: float, tmp: Path) -> list:
    transcript = tmp / f"{name}.jsonl"
    records, startup, server_s, server_later = _serve(cfg, binary, temp)
    transcript.write_text("".join(dumps(r, indent=None) + "\n" for r in records))
    timings = [(final_response(r) or {}).get("timings", {}) for r in records]
    n_prompt = [t.get("prompt_n", 0) for t in timings]
    first_only = tmp / f"{name}.first.jsonl"  # the first record alone: what a run costs before its second
    first_only.write_text(transcript.read_text().splitlines()[0] + "\n")
    best: dict[str, dict] = {}
    for rep in range(REPS):
        if rep:  # the server again, between the replays, on a fresh process: the host's pace moves between runs
            _, up, total, later = _serve(cfg, binary, temp)
            startup, server_s, server_later = min(startup, up), min(server_s, total), min(server_later, later)
        for mode, src in (("server", transcript), ("one-token", transcript), ("first", first_only)):
            out = tmp / f"{name}.{mode}.out.jsonl"
            got = _measure("server" if mode == "first" else mode, src, model, cpu, out)
            if mode not in best or got["seconds"] < best[mode]["seconds"]:
                best[mode] = got
    for mode in ("probe-off", "probe-first"):
        best[mode] = _measure(mode, transcript, model, cpu, tmp / f"{name}.{mode}.out.jsonl")
    worst, over = _max_diff(tmp / f"{name}.server.out.jsonl", tmp / f"{name}.one-token.out.jsonl")
    probe_same = sum(_max_diff(tmp / f"{name}.server.out.jsonl", tmp / f"{name}.{m}.out.jsonl")[0] > 0
                     for m in ("probe-off", "probe-first"))
    rec, one = best["server"]["seconds"], best["one-token"]["seconds"]
    further = (rec - best["first"]["seconds"]) / server_later  # what each record after the first adds
    off, first = best["probe-off"]["seconds"], best["probe-first"]["seconds"]
    return [name, f"{min(n_prompt)}-{max(n_prompt)}", f"{server_s:.1f}", f"{rec:.1f}", f"{rec / server_s:.2f}",
            f"{further:.2f}", f"{startup:.1f}", f"{rec / (server_s + startup):.2f}",
            f"{one:.1f}", f"{one / rec:.2f}", f"{worst:.3f} ({over})", f"{off - rec:.1f} ({(off - rec) / off:.0%})",
            f"{first - rec:.1f} ({(first - rec) / first:.0%})", f"{first / server_s:.2f}",
            best["server"]["mismatch"] + probe_same]


def main() -> int:
    bins = ensure_built(BuildSpec("b11434"))
    can = variants_that_run(bins.bin_dir)
    cpu = sys.argv[1] if len(sys.argv) > 1 else (can[0] if can else "native")
    if cpu not in can:
        raise SystemExit(f"bench/schedule.py: {cpu} is not a variant this host runs ({', '.join(can)})")
    server = bins.with_cpu(cpu).server if len(sys.argv) > 1 else bins.server
    smol, gemma = models.smollm2(), models.gemma3()
    smol_draft, gemma_draft = models.smollm2_draft(bins.quantize), models.gemma3_draft(bins.quantize)
    default = {"n_parallel": -1, "n_ctx": 8192}  # -np auto: 4 slots, a unified KV cache of 8192 cells
    cases = [("SmolLM2 Q4_1, Q2_K draft, t=0", ServerConfig(smol, draft_model=smol_draft,
                                                           spec_types=("draft-simple",), **default), smol, 0.0),
             ("SmolLM2 Q4_1, self-draft, t=1", ServerConfig(smol, draft_model=smol, spec_types=("draft-simple",),
                                                           **default), smol, 1.0),
             ("Gemma 3 Q4_K_M, Q2_K draft, t=0", ServerConfig(gemma, draft_model=gemma_draft,
                                                             spec_types=("draft-simple",), **default), gemma, 0.0)]
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg, model, temp in cases:
            rows.append(run_case(name, cfg, model, server, cpu, temp, Path(tmp)))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; servers and replays on the "
          f"{cpu} variant of b11434; three chat records each, 64 tokens out; {time.perf_counter() - started:.0f} s")
    print(tabulate(rows, headers=["configuration", "prompt tokens", "server s", "recover s", "recover / server",
                                  "records 2-3: recover / server", "server start-up s", "recover / (server + start-up)",
                                  "one-token s", "one-token / recover", "one-token max |diff| (> 5e-4)",
                                  "probe s, caches off (share)", "probe s, first transcript (share)",
                                  "first transcript / server", "mismatches"]))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:7])
        sys.exit(0)
    sys.exit(main())
