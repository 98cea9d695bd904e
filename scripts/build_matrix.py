#!/usr/bin/env python3
"""Prove spec-replay on real llama.cpp builds, one per loop shape, and write the table into the README.

For every build (default: the matrix below) it builds llama-server with our CMakeLists.txt (ccache),
then, with SmolLM2-135M Q4_1 as the target and its Q2_K requantisation as a disagreeing draft:

  trace     10 seeds per configuration against a speculating server of that build, token-exact
            (tokens and the draft_n / draft_n_accepted totals), in the shape chosen from build_info
  recover   the same transcripts; every filled value against the build's own unspeculated server
            (same model file and flags), max |recovered - unspeculated| over the common tokens
  patch     `spec-replay patch` generated for the build's tree, applied, built, and --verify's checks
            (2 seeds per endpoint/stream/mode)

    python3 scripts/build_matrix.py                      # the matrix, README updated
    python3 scripts/build_matrix.py b9897 b9246          # other builds (b<N> or 0c1e570)
    python3 scripts/build_matrix.py --no-patch --json m.json

The README's table sits between the `build-matrix` markers; results also go to bench/matrix.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replay.llamacpp import models  # noqa: E402
from replay.llamacpp.build import BuildSpec, ensure_built  # noqa: E402
from replay.llamacpp.process import LlamaServer, ServerConfig  # noqa: E402
from replay.llamacpp.record import RequestItem, record_one  # noqa: E402
from replay.loop.eras import shape_for  # noqa: E402
from replay.recovery.recover import recover_records  # noqa: E402
from replay.runtime.llama import Model, set_verbose  # noqa: E402
from replay.trace.run import Drafts, trace_record  # noqa: E402
from replay.transcripts.entries import record_entries  # noqa: E402
from replay.transcripts.readers import read_text  # noqa: E402

MATRIX = ("b10705", "b11368", "b11401", "b11434", "0c1e570")
SEEDS = range(1, 11)
STORY = "Once upon a time, in a small village by the sea,"
REPEAT = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, wrote the weather in "
          "his book, and watched the ships pass slowly along the dark coast until morning came. ")
README_BEGIN, README_END = "<!-- build-matrix -->", "<!-- /build-matrix -->"


@dataclass(frozen=True)
class Config:
    name: str
    types: tuple[str, ...]
    draft: bool
    sampling: str | None
    temp: float
    prompt: str
    n_predict: int
    needs_rejection: bool = False


CONFIGS = (
    Config("draft-simple greedy t0", ("draft-simple",), True, None, 0.0, STORY, 32),
    Config("draft-simple greedy t1", ("draft-simple",), True, None, 1.0, STORY, 32),
    Config("draft-simple probabilistic t1", ("draft-simple",), True, "probabilistic", 1.0, STORY, 32,
           needs_rejection=True),
    Config("ngram-mod t0", ("ngram-mod",), False, None, 0.0, REPEAT * 4, 48),
    # n-gram drafts cut to n_max near the end of n_predict: b11368..b11382 verify them by rejection
    Config("ngram-simple t1", ("ngram-simple",), False, None, 1.0, REPEAT * 4, 40),
)


@dataclass
class Result:
    build: str
    era: str = ""
    build_info: str = ""
    configs: dict[str, dict] = field(default_factory=dict)
    patch: str = "not run"
    minutes: float = 0.0
    error: str | None = None

    @property
    def traced(self) -> tuple[int, int]:
        return (sum(c["reproduced"] for c in self.configs.values()), sum(c["records"] for c in self.configs.values()))

    @property
    def worst(self) -> float | None:
        ws = [c["max_diff"] for c in self.configs.values() if c["max_diff"] is not None]
        return max(ws) if ws else None


def _record(srv: LlamaServer, body: dict) -> dict:
    return record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())


def _compare(fixed: dict, plain: dict) -> tuple[float, int]:
    """max |recovered - unspeculated| (token and top-N) over the tokens both runs emitted alike."""
    a = record_entries(read_text(json.dumps(fixed), "fixed")[0])
    b = record_entries(read_text(json.dumps(plain), "plain")[0])
    worst, n = 0.0, 0
    for x, y in zip(a, b):
        if x.id != y.id:
            break
        n += 1
        for u, v in [(x.logprob, y.logprob)] + [(p[2], q[2]) for p, q in zip(x.top, y.top)]:
            if u is not None and v is not None and (math.isfinite(u) or math.isfinite(v)):
                worst = max(worst, abs(u - v))
    return worst, n


def run_config(cfg: Config, bins, target: Path, draft: Path) -> dict:
    flags = dict(spec_types=cfg.types, draft_model=draft if cfg.draft else None, draft_sampling=cfg.sampling)
    spec_cfg = ServerConfig(target, **flags)
    plain_cfg = ServerConfig(target)
    bodies = [{"prompt": cfg.prompt, "n_predict": cfg.n_predict, "n_probs": 3, "temperature": cfg.temp, "seed": s,
               "cache_prompt": False} for s in SEEDS]
    with LlamaServer(spec_cfg, binary=bins.server) as srv:
        spec = [_record(srv, b) for b in bodies]
    with LlamaServer(plain_cfg, binary=bins.server) as ref:
        plain = [_record(ref, b) for b in bodies]
    text = "".join(json.dumps(t) + "\n" for t in spec)
    records = read_text(text, f"{cfg.name}.jsonl")
    out = {"records": len(records), "reproduced": 0, "drafted": 0, "accepted": 0, "divergences": [],
           "max_diff": None, "compared": 0, "mismatch": 0}
    model = Model(target)
    try:
        state: dict = {}
        drafts = Drafts()
        for rec in records:
            res = trace_record(rec, model, server_state=state, drafts=drafts)
            out["reproduced"] += bool(res.reproduced)
            out["drafted"] += res.draft_n
            out["accepted"] += res.draft_n_accepted
            out["shape"] = res.shape.describe() if res.shape else None
            if not res.reproduced:
                out["divergences"].append({"record": rec.index, "token": res.first_divergence,
                                           "draft_n": [res.draft_n, res.server_draft_n],
                                           "explanation": res.explanation.text if res.explanation else None})
        done = recover_records(records, model)
        worst = 0.0
        for d, p in zip(done, plain):
            c = d.report.summary()["counts"]
            out["mismatch"] += c["mismatch"] + c["unaligned"]
            w, n = _compare(d.container, p)
            worst, out["compared"] = max(worst, w), out["compared"] + n
        out["max_diff"] = worst
    finally:
        model.close()
    return out


def run_build(name: str, *, patch: bool, log) -> Result:
    t0 = time.monotonic()
    r = Result(name)
    try:
        bins = ensure_built(BuildSpec(name), log=None)
        r.build_info = bins.build_info
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
            from replay.llamacpp.patch_proof import verify_server_patch
            log(f"{name}: patch --verify")
            _, rows = verify_server_patch(None, name, seeds=range(1, 3))
            bad = [x for x in rows if not x.passed]
            r.patch = "verified" if not bad else f"{len(bad)}/{len(rows)} checks failed: {bad[0].problems[:1]}"
    except Exception as e:  # one build failing must not lose the others' results
        r.error = f"{type(e).__name__}: {e}"
    r.minutes = (time.monotonic() - t0) / 60
    return r


def table(results: list[Result]) -> str:
    head = ("| build | era | trace token-exact | drafted / accepted | recover max \\|diff\\| vs unspeculated "
            "(tokens) | patch --verify |\n|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        if r.error:
            lines.append(f"| {r.build} | {r.era or '?'} | error: {r.error} | | | |")
            continue
        ok, n = r.traced
        drafted = sum(c["drafted"] for c in r.configs.values())
        accepted = sum(c["accepted"] for c in r.configs.values())
        compared = sum(c["compared"] for c in r.configs.values())
        mism = sum(c["mismatch"] for c in r.configs.values())
        worst = f"{r.worst:.1e}" if r.worst is not None else "-"
        lines.append(f"| {r.build} ({r.build_info}) | {r.era} | {ok}/{n} records ({len(r.configs)} configurations) | "
                     f"{drafted} / {accepted} | {worst} ({compared}){f', {mism} mismatches' if mism else ''} | "
                     f"{r.patch} |")
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = REPO / "README.md"
    s = readme.read_text()
    if README_BEGIN not in s or README_END not in s:
        raise SystemExit(f"README.md has no {README_BEGIN} ... {README_END} section")
    a, b = s.index(README_BEGIN) + len(README_BEGIN), s.index(README_END)
    readme.write_text(s[:a] + "\n" + text + "\n" + s[b:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", default=list(MATRIX))
    ap.add_argument("--no-patch", action="store_true", help="skip patch generation and --verify")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "matrix.json")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    set_verbose(False)
    log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    results = []
    for b in args.builds:
        results.append(run_build(b, patch=not args.no_patch, log=log))
        r = results[-1]
        log(f"{b}: era {r.era}, traced {r.traced[0]}/{r.traced[1]}, worst {r.worst}, patch {r.patch}, "
            f"{r.minutes:.1f} min" + (f", ERROR {r.error}" if r.error else ""))
    args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2, default=str) + "\n")
    t = table(results)
    print(t)
    if not args.no_readme:
        write_readme(t)
    return 0 if all(r.error is None and r.traced[0] == r.traced[1] and r.patch in ("verified", "not run")
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
