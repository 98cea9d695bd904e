#!/usr/bin/env python3
"""Prove spec-replay on real llama.cpp builds, one per loop shape, and write the table into docs/builds-and-eras.md.

For every build (default: the matrix below) it builds llama-server with our CMakeLists.txt (ccache),
then, with SmolLM2-135M Q4_1 as the target and its Q2_K requantisation as a disagreeing draft:

  trace     10 seeds per configuration against a speculating server of that build, token-exact
            (tokens and the draft_n / draft_n_accepted totals), in the shape chosen from build_info
  recover   the same transcripts; every filled value against the build's own unspeculated server
            (same model file and flags), max |recovered - unspeculated| over the common tokens
  libllama  each build is replayed on its own libllama where llama-cpp-python's binding can call it
            (b10679 and later), each in its own process; older builds on the binding's own
  patch     `spec-replay patch` generated for the build's tree, applied, built, and --verify's checks
            (1 seed per endpoint/stream/mode)

    python3 scripts/build_matrix.py                      # the matrix, docs/builds-and-eras.md updated
    python3 scripts/build_matrix.py b9897 b9246          # other builds (b<N> or 0c1e570)
    python3 scripts/build_matrix.py --no-patch --json m.json

The page's table sits between the `build-matrix` markers; results also go to bench/matrix.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replay.builds.loop_shapes import shape_for  # noqa: E402
from replay.llamacpp import models  # noqa: E402
from replay.llamacpp.build import BuildSpec, ensure_built  # noqa: E402
from replay.llamacpp.libllama import libllama_of  # noqa: E402
from replay.proof.matrix import CONFIGS, run_config  # noqa: E402
from replay.runtime.binding import loaded_path, use_libllama  # noqa: E402
from replay.runtime.llama import set_verbose  # noqa: E402

# one build per loop shape spec-replay replays (builds/loop_shapes.py), required ones first
MATRIX = ("b10705", "b11368", "b11401", "b11434", "0c1e570", "b9897", "b9246")
README_BEGIN, README_END = "<!-- build-matrix -->", "<!-- /build-matrix -->"


@dataclass
class Result:
    build: str
    era: str = ""
    build_info: str = ""
    configs: dict[str, dict] = field(default_factory=dict)
    patch: str = "not run"
    minutes: float = 0.0
    error: str | None = None
    libllama: str = "bundled"  # the replay's libllama: the build's own, or llama-cpp-python's (runtime/binding.py)

    @property
    def traced(self) -> tuple[int, int]:
        return (sum(c["reproduced"] for c in self.configs.values()), sum(c["records"] for c in self.configs.values()))

    @property
    def worst(self) -> float | None:
        ws = [c["max_diff"] for c in self.configs.values() if c["max_diff"] is not None]
        return max(ws) if ws else None


def run_build(name: str, *, patch: bool, log) -> Result:
    t0 = time.monotonic()
    r = Result(name)
    try:
        bins = ensure_built(BuildSpec(name), log=None)
        r.build_info = bins.build_info
        choice = libllama_of(bins)
        use_libllama(choice)  # this process replays one build (main() runs each in its own)
        r.libllama = "own" if loaded_path() is not None else f"bundled ({choice.warning or choice.why})"
        shape = shape_for(build_info=bins.build_info)
        r.era = shape.era.key
        target = models.smollm2()
        draft = models.smollm2_draft(bins.quantize)
        for cfg in CONFIGS:
            if cfg.needs_rejection and not shape.era.rejection:
                continue
            log(f"{name}: {cfg.name}")
            r.configs[cfg.name] = run_config(cfg, bins, target, draft)
        if patch:
            from replay.proof.patch_proof import verify_server_patch
            log(f"{name}: patch --verify")
            _, rows = verify_server_patch(None, name, seeds=range(1, 2))
            bad = [x for x in rows if not x.passed]
            r.patch = "verified" if not bad else f"{len(bad)}/{len(rows)} checks failed: {bad[0].problems[:1]}"
    except Exception as e:  # one build failing must not lose the others' results
        r.error = f"{type(e).__name__}: {e}"
    r.minutes = (time.monotonic() - t0) / 60
    return r


def table(results: list[Result]) -> str:
    head = ("| build | era | replay's libllama | trace token-exact | drafted / accepted | recover max \\|diff\\| vs "
            "unspeculated (tokens) | patch --verify |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        if r.error:
            lines.append(f"| {r.build} | {r.era or '?'} | | error: {r.error} | | | |")
            continue
        ok, n = r.traced
        drafted = sum(c["drafted"] for c in r.configs.values())
        accepted = sum(c["accepted"] for c in r.configs.values())
        compared = sum(c["compared"] for c in r.configs.values())
        mism = sum(c["mismatch"] for c in r.configs.values())
        worst = f"{r.worst:.1e}" if r.worst is not None else "-"
        lib = "the build's own" if r.libllama == "own" else "llama-cpp-python's (b11311): ABI differs"
        lines.append(f"| {r.build} ({r.build_info}) | {r.era} | {lib} | {ok}/{n} records ({len(r.configs)} configurations) | "
                     f"{drafted} / {accepted} | {worst} ({compared}){f', {mism} mismatches' if mism else ''} | "
                     f"{r.patch} |")
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = REPO / "docs" / "builds-and-eras.md"
    s = readme.read_text()
    if README_BEGIN not in s or README_END not in s:
        raise SystemExit(f"{readme} has no {README_BEGIN} ... {README_END} section")
    a, b = s.index(README_BEGIN) + len(README_BEGIN), s.index(README_END)
    readme.write_text(s[:a] + "\n" + text + "\n" + s[b:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", default=list(MATRIX))
    ap.add_argument("--no-patch", action="store_true", help="skip patch generation and --verify")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "matrix.json")
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one build in this process, print its Result as JSON
    args = ap.parse_args()
    if args.one:
        r = run_build(args.one, patch=not args.no_patch, log=lambda m: print(m, file=sys.stderr, flush=True))
        print(json.dumps(dict(r.__dict__), default=str))
        return 0
    set_verbose(False)
    log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    # results accumulate in the JSON by build (a later run of some builds replaces theirs)
    known = {r["build"]: r for r in json.loads(args.json.read_text())} if args.json.is_file() else {}
    ok = True
    for b in args.builds:
        # one process per build: a process loads one libllama, and each build is replayed on its own
        log(f"{b}: start")
        cmd = [sys.executable, __file__, "--one", b] + (["--no-patch"] if args.no_patch else [])
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        try:
            r = Result(**json.loads(out.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError, TypeError):
            r = Result(b, error=f"the build's process exited {out.returncode} without a result")
        ok &= r.error is None and r.traced[0] == r.traced[1] and r.patch in ("verified", "not run")
        log(f"{b}: era {r.era}, traced {r.traced[0]}/{r.traced[1]}, worst {r.worst}, patch {r.patch}, "
            f"{r.minutes:.1f} min" + (f", ERROR {r.error}" if r.error else ""))
        known[b] = dict(r.__dict__)
        args.json.write_text(json.dumps(list(known.values()), indent=2, default=str) + "\n")
    results = [Result(**d) for d in known.values()]
    order = {b: i for i, b in enumerate(MATRIX)}
    results.sort(key=lambda r: order.get(r.build, len(order)))
    t = table(results)
    print(t)
    if not args.no_readme:
        write_readme(t)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
