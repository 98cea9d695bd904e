"""What finding a transcript's kernels costs, side by side with the recover it serves.

For SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M: records two speculating (self-draft) /completion
transcripts of 40 tokens from the b11434 llama-server (on the best CPU variant that runs here), then
times, each in a fresh process, with a kernel cache of the run's own:

    recover --server-cpu V        the kernels given: no probe (the recover itself)
    recover, caches off           every candidate probed (variants x repack), nothing kept or learnt
    recover, first transcript     the model's kernel classes learnt (every candidate's signature), then
                                  the best class probed first, the others only where it leaves the entry open
    recover, second transcript    the classes known: the same probes

and prints each time and its ratio to the recover alone. Then the same for a long record (a
/completion of 48 tokens after a prompt of about 1,000 tokens, temperature 0) whose model's classes are
known, with the probe's share of the recover and the server's own prompt + generation time for it.

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
LONG = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
        "in his book. ") * 46 + "The next morning"


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
                body = {"prompt": LONG, "n_predict": 48, "n_probs": 3, "temperature": 0.0}
                long_t = record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())
                paths.append(tmp / f"{model.stem}-long.json")
                paths[-1].write_text(dumps(long_t))
                timings = long_t["response"]["timings"]
                server_s = (timings["prompt_ms"] + timings["predicted_ms"]) / 1000
                n_prompt = timings["prompt_n"]
            env = {"SPEC_REPLAY_CACHE": str(tmp / f"cache-{model.stem}"), "SPEC_REPLAY_HEALTH_CACHE":
                   os.environ.get("SPEC_REPLAY_HEALTH_CACHE", str(Path.home() / ".cache/spec-replay/health"))}

            def recover(src: Path, *extra, **more) -> float:
                return _timed("recover", src, "-m", model, "-o", tmp / "out.json", "--force", "--libllama",
                              bins.bin_dir, *extra, env={**env, **more})
            alone = recover(paths[1], "--server-cpu", best)
            nothing_kept = recover(paths[0], SPEC_REPLAY_PROBE_CACHE="0")
            first = recover(paths[0])
            second = recover(paths[1])
            long_alone = recover(paths[2], "--server-cpu", best)
            long_probed = recover(paths[2])
            rows.append((name, alone, nothing_kept, first, second, n_prompt, server_s, long_alone, long_probed))
    print(f"recover of a 40-token /completion transcript, {bins.key}, best variant here {best}, "
          f"{os.cpu_count()} cores")
    print(f"{'model':<16}{'--server-cpu':>14}{'caches off':>18}{'first transcript':>22}{'second transcript':>22}")
    for name, alone, off, first, second, *_ in rows:
        print(f"{name:<16}{alone:>12.1f} s{off:>10.1f} s ({off / alone:>3.1f}x){first:>12.1f} s ({first / alone:>4.1f}x)"
              f"{second:>12.1f} s ({second / alone:>4.1f}x)")
    print("\nrecover of a long /completion record (48 tokens, temperature 0), the model's classes known")
    print(f"{'model':<16}{'prompt':>8}{'server':>10}{'--server-cpu':>14}{'kernels probed':>16}{'probe share':>13}"
          f"{'probed / server':>17}")
    for name, *_, n_prompt, server_s, la, lp in rows:
        print(f"{name:<16}{n_prompt:>8}{server_s:>8.1f} s{la:>12.1f} s{lp:>14.1f} s{(lp - la) / lp:>12.0%}"
              f"{lp / server_s:>16.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
