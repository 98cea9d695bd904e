"""The decisions a recovered record goes through, each specified over plain values (no model, no build):

The judgement of a record's values (replay/comparison/judgement.py judge_record):
- with nothing to explain a disagreement, a real entry that disagrees stays a mismatch;
- with a cause (shared batches, other kernels), entries that disagree within the bound are numerics, kept
  as sent, and the report says whether the user's options or the transcript's evidence said so;
- beyond the bound they stay mismatches, whatever the cause.

What the next record keeps of this one's KV (replay/commands/recovering/assembly.py kept_after):
- the whole reply where the server did not speculate, the prompt alone where it did and the rows'
  decodes are not known, nothing where the record's KV is not in the slot.

The build a kernel choice speaks for (replay/run/build_choice.py build_decision), and the user's
--server-cpu answer (replay/run/kernels/policy.py given_variant).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from replay.commands.recovering.assembly import kept_after
from replay.comparison.judgement import judge_record
from replay.comparison.values import TokenReport
from replay.errors import KernelsError
from replay.run.build_choice import BuildCandidate, BuildDecision, build_decision
from replay.run.kernels.policy import Candidates, Kernels, given_variant
from replay.runtime.binding import LibChoice
from replay.runtime.engine import KernelChoice
from replay.runtime.health import OK, Health


def report(k: int, server: float, true: float) -> TokenReport:
    status = "ok" if abs(server - true) <= 5e-4 else "mismatch"
    return TokenReport(k, k, "a", server, true, status, [], real_pairs=((server, true),))


JUDGE = dict(approximate_from=None, approximate_why="", loop=None, backend="CPU", batch_bound=0.25)


def test_with_nothing_to_explain_it_a_disagreeing_entry_stays_a_mismatch():
    j = judge_record([report(0, -0.5, -0.5), report(1, -1.0, -1.1)], shared=None, kernels=None, by_option=False, **JUDGE)
    assert [r.status for r in j.reports] == ["ok", "mismatch"]
    assert (j.cause, j.batched, j.judged_by) == (None, False, None)


def test_with_shared_batches_entries_within_the_bound_are_kept_as_sent_and_the_evidence_named():
    j = judge_record([report(0, -0.5, -0.52), report(1, -1.0, -1.1)], shared="a 4-slot server (/props total_slots)",
                     kernels=None, by_option=False, **JUDGE)
    assert [r.status for r in j.reports] == ["ok", "ok"] and "(kept as sent)" in j.reports[1].note
    assert (j.cause_kind, j.batched, j.shared, j.judged_by) == ("batch composition", True, True, "evidence")
    assert j.apart.first == pytest.approx(0.02)


def test_other_kernels_given_by_the_user_are_judged_by_option():
    j = judge_record([report(0, -0.5, -0.52)], shared=None, kernels="the server computed on CUDA0, this replay on CPU",
                     by_option=True, **JUDGE)
    assert (j.reports[0].status, j.cause_kind, j.judged_by) == ("ok", "kernels", "option")


def test_beyond_the_bound_no_cause_makes_a_disagreement_numerics():
    j = judge_record([report(0, -0.5, -0.9)], shared="a 4-slot server", kernels=None, by_option=False, **JUDGE)
    assert (j.reports[0].status, j.batched) == ("mismatch", False)


def run(kv_after: int, schedule: dict, unaligned=None):
    return SimpleNamespace(kv_after=kv_after, schedule=schedule, unaligned=unaligned)


def read(drafted: bool):
    timings = {"predicted_n": 4, **({"draft_n": 4} if drafted else {})}  # draft_n only where the slot drafted
    return SimpleNamespace(prompt=list(range(10)), final={"timings": timings})


SLOT = SimpleNamespace(rules=SimpleNamespace(enabled=False))


@pytest.mark.parametrize("drafted, schedule, slot, kept", [
    (False, {}, SLOT, 14),                        # no speculation: every row a one-token decode, as here
    (True, {"rows": {"unknown": 2}}, SLOT, 10),   # rows of unknown kind: the prompt alone
    (True, {"rows": {"unknown": 0}}, SLOT, 14),   # every row's kind read from the transcript
    (True, {"rows": {"unknown": 0}, "loop": {}}, SLOT, 10),  # the reply's KV came from the loop
    (True, {"rows": {"unknown": 0}}, SimpleNamespace(rules=SimpleNamespace(enabled=True)), 10),  # checkpoints
])
def test_the_next_record_keeps_the_reply_only_where_its_rows_were_computed_as_the_server_did(drafted, schedule,
                                                                                             slot, kept):
    assert kept_after(read(drafted), run(14, schedule), slot) == kept


def test_nothing_is_kept_where_the_records_kv_is_not_in_the_slot_and_the_prompt_alone_past_an_unaligned_text():
    assert kept_after(read(False), run(0, {}), SLOT) == 0
    assert kept_after(read(False), run(14, {}, unaligned=ValueError("x")), SLOT) == 10


CAND = BuildCandidate(11434, LibChoice(None, ""), Path("/nowhere"))


@pytest.mark.parametrize("choice, decided, why", [
    (KernelChoice("haswell", "matched", 0.0, 0), True, "b11434, from evidence: record 1's first entry exact under haswell"),
    (KernelChoice("haswell", "loop"), True, "b11434, from evidence: its loop replay emits the transcript's tokens "
                                            "and draft totals under haswell"),
    (KernelChoice("zen4", "default", why="no real entry"), False, "b11434, the default: nothing in the transcript "
                                                                  "tells the build (no real entry)"),
    (KernelChoice("zen4", "given"), False, "b11434, the default: no real entry tells the build"),
])
def test_a_build_is_decided_by_kernels_that_reproduce_the_evidence_and_left_undecided_by_a_default(choice, decided, why):
    d = build_decision(CAND, Kernels(choice, True), witnessed=False)
    assert isinstance(d, BuildDecision) and (d.decided, d.why) == (decided, why)


def test_a_build_whose_kernels_come_nearest_only_is_out():
    assert build_decision(CAND, Kernels(KernelChoice("zen4", "nearest", 0.031, 0), True), witnessed=True) == \
        "nearest zen4 0.031 nats off"


def cands(**over) -> Candidates:
    base = dict(lib_dir=Path("/lib"), present=["x64", "haswell", "zen4"], can=["x64", "haswell"],
                verdicts={"x64": Health("x64", OK, OK), "haswell": Health("haswell", OK, "SIGILL")},
                modes=[True, False], modes_from="probed", pairs=[], crashes=())
    return Candidates(**{**base, **over})


def test_a_server_cpu_answer_is_taken_with_llamacpps_default_repack():
    c = given_variant("x64", cands())
    assert (c.variant, c.how, c.repack) == ("x64", "given", True)


@pytest.mark.parametrize("variant, words", [
    ("icelake", "has no libggml-cpu-icelake.so"),
    ("zen4", "this CPU cannot run it"),
    ("haswell", "the transcript needs a host that runs its kernels"),  # its repack crashes here
])
def test_a_server_cpu_answer_this_host_cannot_compute_is_one_line(variant, words):
    with pytest.raises(KernelsError, match=words):
        given_variant(variant, cands())
