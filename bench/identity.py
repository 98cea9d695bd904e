"""How far a wrong model file's values are from a server's, against how far shared batches move the
right model's (docs/recover.md, "A wrong model file"). For SmolLM2 Q4_1 and Gemma 3 Q4_K_M: an eval
harness (the async OpenAI SDK, 8 chat requests, tests/harness.py) against a default-flag b11434 server
(4 slots) drafting with the Q2_K requantisation, all at once and one after another; each JSONL
compared (`diff --json --renamed-model --shared-batches --server-cpu V`, V the server's kernels) with
the right model and with its requantisations to Q4_0, Q8_0 and Q2_K made by the built llama-quantize.
Prints, per case, every record's first-entry disagreement (probability-weighted |server - true| of its
first real entry) and record disagreement, min / median / max.

    python3 bench/identity.py        # builds llama-server and fetches the models on first use; ~4 min
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import run_harness  # noqa: E402

from replay.llamacpp import models  # noqa: E402
from replay.llamacpp.build import ensure_built  # noqa: E402
from replay.llamacpp.kernels import variants_that_run  # noqa: E402
from replay.llamacpp.process import LlamaServer, ServerConfig  # noqa: E402


def main() -> int:
    bins = ensure_built()
    variant = variants_that_run(bins.bin_dir)[0]
    cli = [sys.executable, "-m", "replay.cli"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, target, draft in (("SmolLM2 Q4_1", models.smollm2(), models.smollm2_draft()),
                                    ("Gemma 3 Q4_K_M", models.gemma3(), models.gemma3_draft())):
            files = {}
            for kind, concurrent in (("8 at once, 4 slots", True), ("one at a time", False)):
                cfg = ServerConfig(target, draft_model=draft, n_ctx=8192)
                if concurrent:
                    del cfg.flags["n_parallel"]  # the server's default: -np auto, 4 slots
                with LlamaServer(cfg, binary=bins.server) as srv:
                    files[kind] = run_harness(srv.url, Path(tmp) / f"{len(rows)}-{concurrent}.jsonl", concurrent=concurrent)
            for label, model in (("right", target), ("Q4_0", models.requantized(target, "Q4_0")),
                                 ("Q8_0", models.requantized(target, "Q8_0")), ("Q2_K", draft)):
                for kind, path in files.items():
                    p = subprocess.run([*cli, "diff", path, "-m", model, "--json", "--renamed-model", "--shared-batches",
                                        "--server-cpu", variant], capture_output=True, text=True)
                    recs = json.loads(p.stdout)["records"]
                    first = [r["numerics"]["weighted_diff_first_entry"] for r in recs]
                    whole = [r["numerics"]["weighted_mean_diff_real"] for r in recs]
                    rows.append((name, label, kind, first, whole, p.returncode))
    print(f"kernels: {variant} (the servers'); bound on a record 0.25 nats, on every first entry 0.2")
    print(f"{'model':15} {'file':6} {'requests':19} {'first entry min/med/max':26} {'record min/med/max':24} exit")
    for name, label, kind, first, whole, code in rows:
        fmt = lambda xs: f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"  # noqa: E731
        print(f"{name:15} {label:6} {kind:19} {fmt(first):26} {fmt(whole):24} {code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
