"""`tune`'s speed prediction against real b11434 servers (docs/tune.md, "Predicted and measured").

Eight SmolLM2-135M-Instruct Q4_1 chat requests at temperature 0 (max_tokens 64, no logprobs) are recorded
from a one-slot b11434 server drafting with SmolLM2 Q2_K (draft-simple, --spec-draft-n-max 3). `tune
--measure` then predicts every setting's tokens per second from that transcript. Each setting is then
started for real on this host (after one warm-up request) and sent the same eight requests one after
another, `ROUNDS` times; its measured speed is the server's own: sum(predicted_n - 1) / sum(predicted_ms)
over the eight, the median over the rounds. Printed side by side: predicted (this host's cost table, and
that table scaled to the transcript's timings, as tune ranks) against measured.

    python3 bench/tune_speed.py            # builds llama-server and fetches the models on first use
    python3 bench/tune_speed.py --gemma    # the same with Gemma 3 270M Q4_K_M and its Q2_K draft
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from replay.llamacpp.build import ensure_built
from replay.llamacpp.http import post_json
from replay.llamacpp.models import gemma3, gemma3_draft, smollm2, smollm2_draft
from replay.llamacpp.process import LlamaServer, ServerConfig

TOPICS = ("the sea", "a lighthouse", "bread", "winter", "a violin", "the moon", "rivers", "a clock")
ROUNDS = 3
VARY = ["--spec-draft-n-max=1,2,6,10", "--spec-type=draft-simple,none"]


def body(k: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Write four sentences about {TOPICS[k]}."}],
            "max_tokens": 64, "temperature": 0, "seed": 11 + k}


def setting_flags(overrides: dict) -> dict:
    """tune's overrides (settings attrs) as ServerConfig keywords."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}


def measured_tps(url: str) -> float:
    post_json(url, "/v1/chat/completions", {**body(0), "max_tokens": 8})  # warm-up
    n = ms = 0.0
    for k in range(len(TOPICS)):
        t = post_json(url, "/v1/chat/completions", {**body(k), "cache_prompt": False})["timings"]
        n += t["predicted_n"] - 1
        ms += t["predicted_ms"]
    return 1000.0 * n / ms


def main() -> int:
    gemma = "--gemma" in sys.argv
    target, draft = (gemma3(), gemma3_draft()) if gemma else (smollm2(), smollm2_draft())
    bins = ensure_built()
    base = ServerConfig(target, draft_model=draft, spec_types=("draft-simple",))
    cli = [sys.executable, "-m", "replay.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        reqs, out = Path(tmp) / "requests.jsonl", Path(tmp) / "traffic.jsonl"
        reqs.write_text("".join(json.dumps(body(k)) + "\n" for k in range(len(TOPICS))))
        with LlamaServer(base, binary=bins.server) as srv:
            subprocess.run([*cli, "record", srv.url, "--requests", reqs, "-o", out, "-md", draft,
                            "--spec-type", "draft-simple", "-t", "2", "-np", "1"], check=True)
        args = [*cli, "tune", out, "-m", target, "-md", draft, "--measure", "--json"]
        for v in VARY:
            args += ["--vary", v]
        report = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
        scale = report["speed_model"]["scale"]
        print(f"speed model: {report['speed_model']['source']}")
        rows = []
        seen = set()
        for s in report["settings"]:
            flags = setting_flags(s["overrides"])
            if flags.get("spec_types") == ("none",):
                flags = {"spec_types": ("none",)}  # no speculation: the draft length does not matter
            key = json.dumps(flags, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            cfg = base.with_flags(**flags)
            with LlamaServer(cfg, binary=bins.server) as srv:
                got = statistics.median(measured_tps(srv.url) for _ in range(ROUNDS))
            pred = s["predicted"]["tokens_per_second"]
            rows.append((s["setting"], s["target_decodes_per_token"], pred / scale, pred, got))
    print(f"{'setting':48} {'dec/tok':>7} {'host':>7} {'scaled':>7} {'server':>7} {'host/srv':>8} {'scaled/srv':>10}")
    for name, dpt, host, scaled, got in rows:
        print(f"{name:48} {dpt:7.3f} {host:7.1f} {scaled:7.1f} {got:7.1f} {host / got:8.3f} {scaled / got:10.3f}")
    worst = max(abs(scaled / got - 1) for *_, scaled, got in rows)
    print(f"largest error of the scaled prediction: {100 * worst:.1f}% over {len(rows)} settings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
