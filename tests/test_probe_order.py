"""What a model's first kernel probe computes, and in which order (run/kernels/processes.py
_probe_classes), on a stand-in prober whose signatures and first entries are given: no process, no
model (quick tier).

Specification:
- the classes are learnt from the vector variants' kernel signatures; the variants without vector
  kernels (x64, sse42: ten times a vector variant's signature) are not computed up front;
- where the best class reproduces the first entry and no other vector class computes batches as it
  does, the slow variants' prompt signatures (the prompt batch alone) are learnt then, and only their
  standing apart lets the others go unprobed;
- where the best class is off, the other vector classes are probed, and a class that reproduces the
  entry with every other far from it leaves the slow variants unlearnt and unprobed.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from replay.run.kernels.cache import ProbeCache
from replay.run.kernels.choice import EXACT
from replay.run.kernels.processes import _probe_classes
from replay.run.kernels.types import Candidate, Probe
from replay.runtime.signature import Signature

ZEN4, ICELAKE, HASWELL, SSE42, X64 = (Candidate(v) for v in ("zen4", "icelake", "haswell", "sse42", "x64"))
CANDIDATES = [ZEN4, ICELAKE, HASWELL, SSE42, X64]


class StandIn:
    """A prober whose kernel signatures and first-entry distances are given; it counts what it computed."""

    def __init__(self, signatures: dict[Candidate, Signature], diffs: dict[Candidate, float]):
        self.sigs, self.diffs = signatures, diffs
        self.signed: list[Candidate] = []
        self.prompts: list[Candidate] = []  # asked for the prompt batch's signature alone
        self.witnessed: list[Candidate] = []

    def class_key(self, c: Candidate) -> str:
        return c.label.replace(" ", "_")

    def signatures(self, groups, upto="whole"):
        members = [c for g in groups for c in g]
        if upto == "prompt":
            self.prompts += members
            return {c: Signature(None, None, self.sigs[c].prompt) for c in members}
        self.signed += members
        return {c: self.sigs[c] for c in members}

    def witness(self, cands, same, progress, decodes=0):
        self.witnessed += cands
        return [Probe(c.variant, self.diffs[c], record=0, repack=c.repack, same=same.get(c, ())) for c in cands], []


def _signatures() -> dict[Candidate, Signature]:
    return {ZEN4: Signature("w-avx512", "b-avx512", "p-avx512"), ICELAKE: Signature("w-avx512", "b-avx512", "p-avx512"),
            HASWELL: Signature("w-avx2", "b-avx2", "p-avx2"), SSE42: Signature("w-sse42", "b-sse42", "p-sse42"),
            X64: Signature("w-x64", "b-x64", "p-x64")}


def test_the_best_class_exact_learns_the_slow_variants_prompt_batches_only_then_and_probes_nothing_else(tmp_path: Path):
    prober = StandIn(_signatures(), {ZEN4: 0.0, ICELAKE: 0.0, HASWELL: 0.12, SSE42: 0.2, X64: 0.2})
    probes = _probe_classes(prober, CANDIDATES, ProbeCache(tmp_path), None, EXACT)
    assert prober.signed == [ZEN4, ICELAKE, HASWELL]  # whole signatures: the vector ones
    assert prober.prompts == [SSE42, X64]  # then the slow ones' prompt batches alone
    assert prober.witnessed == [ZEN4]
    assert probes[0].same == ("icelake",) and probes[1].skipped and set(probes[1].same) >= {"sse42", "x64"}


def test_a_slow_variant_computing_batches_as_the_best_is_probed_not_skipped(tmp_path: Path):
    sigs = _signatures()
    sigs[SSE42] = Signature("w-sse42", "b-avx512", "p-avx512")  # prompt batches alike: its first entry could be the same
    prober = StandIn(sigs, {ZEN4: 0.0, ICELAKE: 0.0, HASWELL: 0.12, SSE42: 0.0, X64: 0.2})
    probes = _probe_classes(prober, CANDIDATES, ProbeCache(tmp_path), None, EXACT)
    assert SSE42 in prober.witnessed and not any(p.skipped for p in probes)
    assert [p.label for p in probes if p.diff == 0.0] == ["zen4", "sse42"]  # both exact: told apart after


def test_the_best_class_off_leaves_the_slow_variants_unlearnt_where_another_class_settles_it(tmp_path: Path):
    prober = StandIn(_signatures(), {ZEN4: 0.19, ICELAKE: 0.19, HASWELL: 0.0, SSE42: 0.2, X64: 0.2})
    probes = _probe_classes(prober, CANDIDATES, ProbeCache(tmp_path), None, EXACT)
    assert prober.signed == [ZEN4, ICELAKE, HASWELL] and not prober.prompts  # sse42 and x64: never computed
    assert prober.witnessed == [ZEN4, HASWELL]
    assert probes[-1].skipped and "haswell reproduced record 1's first entry exactly" in probes[-1].skipped


def test_no_vector_class_exact_learns_and_probes_the_slow_ones(tmp_path: Path):
    prober = StandIn(_signatures(), {ZEN4: 0.19, ICELAKE: 0.19, HASWELL: 0.12, SSE42: 0.0, X64: 0.0})
    _probe_classes(prober, CANDIDATES, ProbeCache(tmp_path), None, EXACT)
    assert prober.signed == [ZEN4, ICELAKE, HASWELL, SSE42, X64]
    assert prober.witnessed[:2] == [ZEN4, HASWELL] and {SSE42, X64} <= set(prober.witnessed)
