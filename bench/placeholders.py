"""The README's measured example: SmolLM2-135M Q4_1 drafting for itself (draft-simple) on the real
b11434 llama-server, one 40-token chat reply at temperature 1 (seed 42), recorded with `record` and
compared with `diff`: the server's mean logprob against the true one.

    python3 bench/placeholders.py        # builds llama-server and fetches SmolLM2 on first use
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from replay.llamacpp.build import ensure_built
from replay.llamacpp.models import smollm2
from replay.llamacpp.process import LlamaServer, ServerConfig

REQUEST = {"messages": [{"role": "user", "content": "Tell me a short story about a robot."}], "max_tokens": 40,
           "temperature": 1.0, "seed": 42, "logprobs": True, "top_logprobs": 3}


def main() -> int:
    model, bins = smollm2(), ensure_built()
    cli = [sys.executable, "-m", "replay.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "smollm2-self-draft.json"
        req.write_text(json.dumps(REQUEST))
        with LlamaServer(ServerConfig(model, draft_model=model, spec_types=("draft-simple",)), binary=bins.server) as srv:
            subprocess.run([*cli, "record", srv.url, "--request", req, "-o", out, "-md", model,
                            "--spec-type", "draft-simple"], check=True)
        s = json.loads(subprocess.run([*cli, "diff", out, "-m", model, "--json"], check=True, capture_output=True,
                                      text=True).stdout)["records"][0]["summary"]
    print(f"{s['tokens']} tokens, {s['counts']['placeholder']} placeholders: server mean logprob "
          f"{s['server_mean_logprob']:.4f}, true {s['true_mean_logprob']:.4f} (true perplexity {s['true_perplexity']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
