"""What finding a transcript's kernels costs, side by side with the recover it serves.

For SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M: records two speculating (self-draft) /completion
transcripts of 40 tokens from the b11434 llama-server (on the best CPU variant that runs here), then
times, each in a fresh process, with a kernel cache of the run's own:

    recover --server-cpu V        the kernels given: no probe (the recover itself)
    recover, caches off           every candidate probed (variants x repack), nothing kept or learnt
    recover, first transcript     every candidate probed, the model's kernel classes learnt and kept
    recover, second transcript    one probe per class

and prints each time and its ratio to the recover alone.

    python3 bench/probe.py        # builds llama-server and fetches the models on first use
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.build import ensure_built
from replay.llamacpp.kernels import variants_that_run
from replay.llamacpp.models import gemma3, smollm2
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.transcripts.format import dumps

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _timed(*args, env: dict) -> float:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "replay.cli", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **env})
    if p.returncode != 0:
        raise SystemExit(f"{args[:2]} failed: {p.stderr[-800:]}")
    return time.perf_counter() - t


def main() -> int:
    bins = ensure_built()
    best = variants_that_run(bins.bin_dir)[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, model in (("SmolLM2 Q4_1", smollm2()), ("Gemma 3 Q4_K_M", gemma3())):
            paths = []
            with LlamaServer(ServerConfig(model, draft_model=model, spec_types=("draft-simple",))) as srv:
                for seed in (1, 2):
                    body = {"prompt": PROMPT, "n_predict": 40, "n_probs": 3, "temperature": 1.0, "seed": seed}
                    paths.append(tmp / f"{model.stem}-{seed}.json")
                    paths[-1].write_text(dumps(record_one(srv.url, RequestItem("/completion", body),
                                                          srv.config.flags_block())))
            env = {"SPEC_REPLAY_CACHE": str(tmp / f"cache-{model.stem}"), "SPEC_REPLAY_HEALTH_CACHE":
                   os.environ.get("SPEC_REPLAY_HEALTH_CACHE", str(Path.home() / ".cache/spec-replay/health"))}

            def recover(src: Path, *extra, **more) -> float:
                return _timed("recover", src, "-m", model, "-o", tmp / "out.json", "--force", "--libllama",
                              bins.bin_dir, *extra, env={**env, **more})
            alone = recover(paths[1], "--server-cpu", best)
            nothing_kept = recover(paths[0], SPEC_REPLAY_PROBE_CACHE="0")
            first = recover(paths[0])
            second = recover(paths[1])
            rows.append((name, alone, nothing_kept, first, second))
    print(f"recover of a 40-token /completion transcript, {bins.key}, best variant here {best}, "
          f"{os.cpu_count()} cores")
    print(f"{'model':<16}{'--server-cpu':>14}{'caches off':>18}{'first transcript':>22}{'second transcript':>22}")
    for name, alone, off, first, second in rows:
        print(f"{name:<16}{alone:>12.1f} s{off:>10.1f} s ({off / alone:>3.1f}x){first:>12.1f} s ({first / alone:>4.1f}x)"
              f"{second:>12.1f} s ({second / alone:>4.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
