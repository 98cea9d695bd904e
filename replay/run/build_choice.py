"""Which build computed a transcript that names none: the candidates built here, judged by evidence.

    candidates_here() -> [BuildCandidate]          what `spec-replay build` made: release-style, unpatched
    choose_build(inputs, ...) -> BuildDecision      the first candidate whose kernels reproduce the evidence
    build_decision(candidate, kernels) -> ...      what a build's kernel choice says of the build (pure)

A transcript says which llama.cpp build served it through /props `build_info` (recorded by `record`) or
the OpenAI endpoints' `system_fingerprint`; a native /completion response logged by a harness carries
neither, and a server built from a source tree without git history says `b0-unknown`
(common/build-info.cpp.in: LLAMA_BUILD_NUMBER 0). Such a transcript is not replayed on whatever library
happens to be at hand: the candidates are the builds here that can compute as a release server does
(every CPU variant, `libggml-cpu-<variant>.so`), the pinned b11434 first (what users run), then the
others newest first. Each is judged as kernels are judged (run/kernels/policy.py): the first whose
kernels reproduce the evidence computed it (a real first entry exactly, or where no record carries
one, the server's loop replayed emits the transcript's tokens and draft totals: policy.py _by_loop), and
its loop shape is the one replayed (builds/loop_shapes.py). Where nothing decides, b11434 is used and the
run says the build is undecided (build_decision). Where nothing is built, one line says how to get a build.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from replay.commands.recover import RecoverOptions
from replay.errors import KernelsError
from replay.llamacpp.build import DEFAULT_PROFILE, BuildSpec, find_built
from replay.paths import cache_root
from replay.run.inputs import Inputs
from replay.run.kernels.choice import witnesses
from replay.run.kernels.policy import Kernels, choose_kernels
from replay.llamacpp.libllama import libllama_of
from replay.runtime.binding import LibChoice

Say = Callable[..., None]  # (line, warning=False)

# What `spec-replay build` costs from cold, so that a user told to run it knows what they are in for
# (measured: `time spec-replay build` on a 2-core AMD EPYC, ccache empty, 2026-12-06: 9 m 4 s).
BUILD_TIME = "about 9 minutes on 2 cores"


@dataclass(frozen=True)
class BuildCandidate:
    """A build here that can compute as a release server does: its number, libllama and directory."""

    number: int
    lib: LibChoice
    lib_dir: Path

    @property
    def name(self) -> str:
        return f"b{self.number}"


@dataclass(frozen=True)
class BuildDecision:
    """The build chosen for a transcript that names none: the candidate, its kernels, and why (the
    report's words: "b11434, from evidence: record 1's first entry exact under haswell"); `decided`
    False where no evidence could tell (no real entry: the default build, approximate)."""

    candidate: BuildCandidate
    kernels: Kernels
    why: str
    decided: bool


def _order(number: int) -> tuple[int, int]:
    """b11434 first, then newest first.

    >>> sorted([11000, 11434, 11500], key=_order)
    [11434, 11500, 11000]
    """
    return (0 if f"b{number}" == DEFAULT_PROFILE else 1, -number)


def candidates_here(root: Path | None = None) -> list[BuildCandidate]:
    """The release-style builds `spec-replay build` made here (cache_root()/trees/b<N>-variants, unpatched:
    a patched build computes the same values, so it adds no candidate), callable through the binding,
    in the order they are judged (_order)."""
    trees = (root or cache_root()) / "trees"
    found: list[BuildCandidate] = []
    for manifest in sorted(trees.glob("b*-variants/build/spec-replay-build.json")):
        try:
            info = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        profile = info.get("profile")
        if info.get("patch") or info.get("cpu") != "variants" or not isinstance(profile, str):
            continue
        bins = find_built(BuildSpec(profile))
        number = info.get("build_number")
        if bins is None or not isinstance(number, int):
            continue
        lib = libllama_of(bins)  # None where it is not callable through the binding
        if lib.path is None:
            continue
        found.append(BuildCandidate(number, LibChoice(lib.path, f"b{number}, built here", lib.header),
                                    Path(lib.path).parent))
    return sorted(found, key=lambda c: _order(c.number))


def nothing_built_line() -> str:
    """What a run of a transcript that names no build says when no build is here."""
    return ("the transcript names no build and none is built here: `spec-replay build` (b11434 with every CPU "
            f"variant, {BUILD_TIME}) lets the evidence choose the server's build and kernels; until then "
            "values come from llama-cpp-python's own library and are exact only where its first entry says so")


def build_decision(cand: BuildCandidate, kernels: Kernels, *, witnessed: bool) -> BuildDecision | str:
    """What a build's kernel choice (run/kernels/policy.py) says of the build, with its reason, or why the
    build is out (a str): kernels that reproduce the evidence (a first entry exact, the loop's tokens and
    draft totals) decide it; the nearest, at stated precision, rules it out; the default, or kernels
    given with no real entry to judge them (`witnessed` False), leave it undecided (values approximate)."""
    choice = kernels.choice
    if choice is None or choice.how in ("default", "unknown"):
        why = (f"{cand.name}, the default: nothing in the transcript tells the build "
               f"({choice.why if choice is not None and choice.why else 'no real entry to compare'})")
        return BuildDecision(cand, kernels, why, decided=False)
    if choice.how == "tried":
        return BuildDecision(cand, kernels, f"{cand.name}, tried first: record {choice.record + 1}'s first "
                                            "entry decides as it is recovered", decided=True)
    if choice.how == "loop":
        return BuildDecision(cand, kernels, f"{cand.name}, from evidence: its loop replay emits the transcript's "
                                            f"tokens and draft totals under {choice.variant}", decided=True)
    if choice.how == "nearest":
        return f"nearest {choice.variant} {choice.diff:.3g} nats off"
    if choice.how == "given":  # the kernels are the user's; the build is evidence's only where an entry judges it
        if not witnessed:
            return BuildDecision(cand, kernels, f"{cand.name}, the default: no real entry tells the build", False)
        return BuildDecision(cand, kernels, f"{cand.name}, the first entry judges it as it is recovered on "
                                            f"{choice.variant} (--server-cpu)", decided=True)
    rec = f"record {choice.record + 1}'s first entry" if choice.record is not None else "the first entry"
    return BuildDecision(cand, kernels, f"{cand.name}, from evidence: {rec} exact under {choice.variant}"
                                        f"{'' if choice.repack is not False else ' --no-repack'}", decided=True)


def choose_build(inputs: Inputs, candidates: list[BuildCandidate], *, flags: dict, options: RecoverOptions,
                 server_cpu: str | None, say: Say, guess: bool = False) -> BuildDecision:
    """The first of `candidates` whose kernels reproduce the transcript's evidence (a real first entry,
    within run/kernels/choice.py EXACT), as run/kernels/policy.py judges each build's CPU variants.
    `guess` lets the first candidate's best class be tried on the run itself (policy.py), confirmed or
    sent back by its first entry. A candidate none of whose kernels reproduce the entry is out; with
    every one out, a KernelsError whose first cause is the one the evidence supports: the transcript
    names no build, so the build is what to give."""
    refused: list[tuple[BuildCandidate, str]] = []
    for k, cand in enumerate(candidates):
        say(f"build: trying {cand.name} (the transcript names none)")
        try:
            kernels = choose_kernels(inputs, lib_dir=cand.lib_dir, flags=flags, options=replace(options, build=cand.number),
                                     server_cpu=server_cpu, say=say, guess=guess and k == 0)
        except KernelsError as e:
            refused.append((cand, str(e)))
            continue
        decision = build_decision(cand, kernels, witnessed=bool(witnesses(inputs.records)))
        if isinstance(decision, str):
            refused.append((cand, decision))
            continue
        return decision
    heads = "; ".join(f"{c.name}: {why.split(' (')[0] if len(why) > 160 else why}" for c, why in refused)
    raise KernelsError(f"the transcript names no build, and no build here reproduces its first entry ({heads}): "
                       "give --build N, the server's build (its llama-server --version), after "
                       "`spec-replay build --build bN`").with_detail(
        "builds tried: " + "; ".join(f"{c.name}: {why}" for c, why in refused))
