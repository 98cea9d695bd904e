#!/usr/bin/env python3
"""Every output recover, diff, trace and tune give on the committed transcripts, written under one
directory, so that a change meant to keep behaviour can be shown to keep it byte for byte:

    python3 scripts/outputs.py /tmp/before          # on the old commit (a worktree of it)
    python3 scripts/outputs.py /tmp/after           # on the new one
    diff -r /tmp/before /tmp/after && echo identical

For each transcript of fixtures/transcripts/ (and one JSONL of them all, for the multi-record paths:
the journal, --workers), each command runs in a fresh process (a process holds one libllama), as a
user runs it: its stdout, stderr, exit code and every file it writes are kept. Inputs are named
relative to the tree and paths that name the output directory are written as OUT, so two trees'
outputs compare.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
# relative to the tree, which every run starts in: two trees (a worktree of the old commit) compare
TARGET, DRAFT = Path("fixtures/tiny-target.gguf"), Path("fixtures/tiny-draft.gguf")


def commands(out: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of every run; files a run writes go under out/NAME/."""
    runs: list[tuple[str, list[str]]] = []
    names = sorted(p.name for p in (FIX / "transcripts").glob("*.json"))
    # at one path for every tree and output directory: its name is in the reports' tables
    jsonl = Path(tempfile.gettempdir()) / "spec-replay-outputs" / "all.jsonl"
    jsonl.parent.mkdir(exist_ok=True)
    jsonl.write_text("".join(json.dumps(json.loads((FIX / "transcripts" / n).read_text())) + "\n" for n in names))
    for n in names + ["all.jsonl"]:
        t = f"fixtures/transcripts/{n}" if n != "all.jsonl" else str(jsonl)
        stem = n.rsplit(".", 1)[0]
        d = f"{stem}"
        ext = "jsonl" if n.endswith(".jsonl") else "json"
        runs += [
            (f"{d}/recover", ["recover", t, "-m", str(TARGET), "-o", f"{{dir}}/repaired.{ext}", "--report",
                              "{dir}/report.json", "--html", "{dir}/page.html"]),
            (f"{d}/recover-json", ["recover", t, "-m", str(TARGET), "-o", f"{{dir}}/repaired.{ext}", "--json"]),
            (f"{d}/diff", ["diff", t, "-m", str(TARGET)]),
            (f"{d}/diff-json", ["diff", t, "-m", str(TARGET), "--json", "--html", "{dir}/page.html"]),
            (f"{d}/trace", ["trace", t, "-m", str(TARGET), "-md", str(DRAFT)]),
            (f"{d}/trace-json", ["trace", t, "-m", str(TARGET), "-md", str(DRAFT), "--json", "--html",
                                 "{dir}/page.html"]),
            (f"{d}/tune", ["tune", t, "-m", str(TARGET), "-md", str(DRAFT), "--vary", "--spec-draft-n-max=2,4"]),
            (f"{d}/tune-json", ["tune", t, "-m", str(TARGET), "-md", str(DRAFT), "--vary",
                                "--spec-draft-n-max=2,4", "--json", "--html", "{dir}/page.html"]),
        ]
    runs += [
        ("all/recover-workers", ["recover", str(jsonl), "-m", str(TARGET), "-o", "{dir}/repaired.jsonl",
                                 "--workers", "2", "--report", "{dir}/report.json"]),
        ("all/trace-workers", ["trace", str(jsonl), "-m", str(TARGET), "-md", str(DRAFT), "--workers", "2",
                               "--json"]),
        ("all/tune-workers", ["tune", str(jsonl), "-m", str(TARGET), "-md", str(DRAFT), "--vary",
                              "--spec-draft-n-max=2,4", "--workers", "2", "--json"]),
        ("errors/wrong-model", ["recover", "fixtures/transcripts/tiny-draft-simple.json", "-m", str(DRAFT),
                                "-o", "{dir}/x.json"]),
        ("errors/wrong-model-trace", ["trace", "fixtures/transcripts/tiny-draft-simple.json", "-m", str(DRAFT),
                                      "-md", str(DRAFT)]),
        ("errors/html-is-input", ["trace", "fixtures/transcripts/tiny-draft-simple.json", "-m", str(TARGET),
                                  "--html", "fixtures/transcripts/tiny-draft-simple.json"]),
        ("errors/report-is-input", ["diff", "fixtures/transcripts/tiny-draft-simple.json", "-m", str(TARGET),
                                    "--report", "fixtures/transcripts/tiny-draft-simple.json"]),
        ("errors/missing", ["diff", str(out / "nothing.json"), "-m", str(TARGET)]),
        ("errors/server-cpu", ["diff", "fixtures/transcripts/tiny-draft-simple.json", "-m", str(TARGET),
                               "--server-cpu", "haswell"]),
    ]
    return runs


def run_one(out: Path, name: str, argv: list[str]) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    argv = [a.replace("{dir}", str(d)) for a in argv]
    p = subprocess.run([sys.executable, "-m", "replay.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "COLUMNS": "200"})
    scrub = lambda s: s.replace(str(out), "OUT")  # noqa: E731
    (d / "stdout").write_text(scrub(p.stdout))
    (d / "stderr").write_text(scrub(p.stderr))
    (d / "exit").write_text(f"{p.returncode}\n")
    for f in d.iterdir():
        if f.name not in ("stdout", "stderr", "exit") and f.is_file():
            f.write_text(scrub(f.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs = commands(a.out.resolve())
    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda r: run_one(a.out.resolve(), *r), runs))
    print(f"{len(runs)} runs under {a.out}")


if __name__ == "__main__":
    main()
