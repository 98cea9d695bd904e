"""A model's first transcript, this tree against another revision, side by side in one run.

    python3 bench/first_probe.py 3af986c            # servers on haswell (another machine's kernels)
    python3 bench/first_probe.py 3af986c zen4       # servers on this host's best

For SmolLM2 Q4_1 (Q2_K draft) and Gemma 3 Q4_K_M (Q2_K draft), a default-flag b11434 llama-server
started on one CPU variant (a directory holding only that libggml-cpu) is sent bench/schedule.py's three
chat requests (about 1,100 prompt tokens, 64 out, t = 0), recorded with `record`; the file is then
recovered as a user's first transcript of the model pays it (an empty probe cache of its own, no
--server-cpu: the kernels found from the transcript, their classes learnt), by `REV` (a git worktree of
it, made in a temporary directory, its C extension built) and by this tree, alternately, twice each,
the fastest kept. The two repaired files must be identical. The server's time is its own prompt + generation time.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import schedule  # noqa: E402

from replay.llamacpp import models  # noqa: E402
from replay.llamacpp.build import BuildSpec, ensure_built  # noqa: E402
from replay.llamacpp.process import ServerConfig  # noqa: E402
from replay.transcripts.format import dumps  # noqa: E402

REPS = 2


def _first(root: Path, transcript: Path, model: Path, out: Path) -> float:
    """Seconds `replay.recover()` of `root`'s package took, as bench/schedule.py's child measures it."""
    env = dict(os.environ, SPEC_REPLAY_PROBE_CACHE=tempfile.mkdtemp(prefix="probe-cache-"))
    p = subprocess.run([sys.executable, str(root / "bench" / "schedule.py"), "--child", "probe-first", str(transcript),
                        str(model), "none", str(out)], capture_output=True, text=True, env=env,
                       cwd=root)  # the probes' forkserver imports from its working directory: `root`'s package
    if p.returncode != 0:
        raise SystemExit(f"{root}: recover failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["seconds"]


def _native(tree: Path, tmp: Path) -> None:
    """`tree` with its C extension built (replay/numerics/_native.c, a build artefact git does not hold):
    without it the revision would compute on the numpy path and be measured slower than it is."""
    src = tree / "replay" / "numerics" / "_native.c"
    if not src.exists():
        return
    built = sorted((REPO / "replay" / "numerics").glob("_native.*.so"))
    if built and src.read_bytes() == (REPO / "replay" / "numerics" / "_native.c").read_bytes():
        shutil.copy(built[0], src.parent / built[0].name)  # the same source: this tree's build
        return
    target = tmp / "native"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(tree)],
                   check=True)
    for so in (target / "replay" / "numerics").glob("_native.*.so"):
        shutil.copy(so, src.parent / so.name)


def main(rev: str, variant: str) -> int:
    bins = ensure_built(BuildSpec("b11434"))
    server = bins.with_cpu(variant).server
    smol, gemma = models.smollm2(), models.gemma3()
    flags = {"n_parallel": -1, "n_ctx": 8192}
    cases = [("SmolLM2 Q4_1, Q2_K draft", ServerConfig(smol, draft_model=models.smollm2_draft(bins.quantize),
                                                       spec_types=("draft-simple",), **flags), smol),
             ("Gemma 3 Q4_K_M, Q2_K draft", ServerConfig(gemma, draft_model=models.gemma3_draft(bins.quantize),
                                                         spec_types=("draft-simple",), **flags), gemma)]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(old), rev], check=True)
        shutil.copy(REPO / "bench" / "schedule.py", old / "bench" / "schedule.py")  # one measurement, both trees
        _native(old, Path(tmp))
        try:
            for name, cfg, model in cases:
                records, _, server_s, _ = schedule._serve(cfg, server, 0.0)
                t = Path(tmp) / "t.jsonl"
                t.write_text("".join(dumps(r, indent=None) + "\n" for r in records))
                got: dict[str, list[float]] = {rev: [], "this tree": []}
                for _ in range(REPS):
                    for who, root in ((rev, old), ("this tree", REPO)):
                        got[who].append(_first(root, t, model, Path(tmp) / f"{root.name}.out"))
                same = (Path(tmp) / f"{old.name}.out").read_bytes() == (Path(tmp) / f"{REPO.name}.out").read_bytes()
                a, b = min(got[rev]), min(got["this tree"])
                print(f"{name}, server on {variant}: server {server_s:.1f} s; first transcript {rev} {a:.1f} s "
                      f"({a / server_s:.2f}x), this tree {b:.1f} s ({b / server_s:.2f}x); repaired files identical: {same}",
                      flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python3 bench/first_probe.py REV [VARIANT]")
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "haswell"))
