"""The speculative loop's parts besides the verifiers (tests/test_verifiers.py), each specified over
stand-ins whose calls are logged, so that each rule's choices can be read off. Real models' steps are
specified by the trace tests (tests/test_trace_live.py, tests/test_gemma.py, tests/test_architectures.py):
every token and draft total of a real server.

Drafting (replay/loop/drafting.py):
- a draft leaves room for the sampled token and one more in the context, and for n_predict;
- the first drafter in priority order with a draft wins, cut to n_max; a probabilistic one keeps its q.

The slot's memory through a step (replay/schedule/step_memory.py):
- a rollback needs the saved state on a memory that cannot drop a suffix, and past n_rs_seq on one
  with snapshots;
- drafting's KV leaves the draft context, after its saved state is loaded back; the target's state is
  saved only when the draft could not be dropped;
- a restore loads both saved states before dropping the step's positions; a trim drops both contexts'.

The emitted tokens (replay/loop/emission.py):
- generation stops after a token by the server's rules, in its order; a stop string is looked for only
  in whole UTF-8 characters;
- each token is recorded with its row's values, and the record says why generation stopped.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from replay.loop.drafting import EMPTY_Q, NO_DRAFT, draft_limit, first_draft
from replay.loop.emission import Emission, Limits, stop_reason
from replay.schedule.step_memory import StepMemory, needs_checkpoint

CAND = np.dtype([("id", np.int32), ("p", np.float32), ("logit", np.float32)])
ERA = SimpleNamespace(q_trim_bug=False)


# --- drafting --------------------------------------------------------------------------------

class Drafter:
    def __init__(self, name: str, tokens: list[int], q: list | None = None):
        self.name, self.tokens, self.last_q, self.asked = name, tokens, q, []

    def draft(self, kv, sampled: int, n_max: int) -> list[int]:
        self.asked.append(n_max)
        return list(self.tokens)


@pytest.mark.parametrize("n_ctx, pos0, n_remaining, n_max", [
    (4096, 100, -1, 3994),  # the context: the sampled token and one more
    (4096, 100, 5, 4),      # n_predict: the sampled token is one of the five left
    (4096, 100, 1, 0),      # the last token n_predict allows: no draft
    (102, 100, -1, 0),      # a full context: no draft
    (4096, 100, 0, 3994),   # n_remaining 0 does not cut (the server asks only n_remaining > 0)
])
def test_a_draft_leaves_room_for_the_sampled_token_and_one_more_and_for_n_predict(n_ctx, pos0, n_remaining, n_max):
    assert draft_limit(n_ctx, pos0, n_remaining) == n_max


def test_the_first_drafter_with_a_draft_wins_and_the_ones_after_it_are_not_asked():
    empty, first, last = Drafter("ngram-mod", []), Drafter("ngram-map-k", [7, 8, 9]), Drafter("draft-simple", [1])
    d = first_draft([empty, first, last], [1, 2], 3, 2, era=ERA, temp=0.0)
    assert (d.tokens, d.drafter, d.q) == ([7, 8], first, None)  # cut to n_max, verified by sample-and-match
    assert (empty.asked, first.asked, last.asked) == ([2], [2], [])


def test_a_probabilistic_drafter_keeps_its_q_cut_with_its_draft():
    q = [(np.array([7]), np.array([0.9])), (np.array([8]), np.array([0.8])), (np.array([9]), np.array([0.7]))]
    d = first_draft([Drafter("draft-simple", [7, 8, 9], q)], [], 3, 2, era=ERA, temp=1.0)
    assert d.tokens == [7, 8] and [float(p[0]) for _, p in d.q] == pytest.approx([0.9, 0.8])


def test_an_ngram_draft_cut_to_n_max_at_temperature_gets_empty_rows_of_q_on_the_builds_with_the_bug():
    bug = SimpleNamespace(q_trim_bug=True)
    cut = first_draft([Drafter("ngram-mod", [7, 8, 9])], [], 3, 2, era=bug, temp=1.0)
    assert cut.q == [EMPTY_Q, EMPTY_Q]  # b11368..b11382 verify it by rejection
    assert first_draft([Drafter("ngram-mod", [7, 8])], [], 3, 2, era=bug, temp=1.0).q is None  # not cut
    assert first_draft([Drafter("ngram-mod", [7, 8, 9])], [], 3, 2, era=bug, temp=0.0).q is None  # greedy


def test_no_drafter_with_a_draft_is_no_draft():
    assert first_draft([Drafter("ngram-mod", [])], [], 3, 4, era=ERA, temp=0.0) == NO_DRAFT


# --- the slot's memory through a step ---------------------------------------------------------

@pytest.mark.parametrize("n, drops_suffix, n_rs_seq, needed", [
    (1, False, 0, True),   # FULL: any rollback
    (0, False, 0, False),  # nothing taken back
    (4, True, 0, False),   # PART: the suffix is dropped
    (2, True, 2, False),   # RS: up to n_rs_seq from the snapshots
    (3, True, 2, True),    # RS: past them
])
def test_a_rollback_needs_the_saved_state_where_the_memory_cannot_drop_it(n, drops_suffix, n_rs_seq, needed):
    assert needs_checkpoint(n, drops_suffix=drops_suffix, n_rs_seq=n_rs_seq) is needed


class Ctx:
    """A context that logs its memory operations into a shared log."""

    def __init__(self, name: str, log: list, n_rs_seq: int = 0):
        self.name, self.log, self.n_rs_seq = name, log, n_rs_seq

    def save_partial(self) -> bytes:
        self.log.append((self.name, "save"))
        return self.name.encode()

    def load_partial(self, state: bytes) -> None:
        self.log.append((self.name, "load", state))

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.log.append((self.name, "rm", p0))


def slot(target_removes: bool, draft_removes: bool, *, draft: bool = True, n_rs_seq: int = 0):
    log: list = []
    memory = SimpleNamespace(ctx=Ctx("target", log, n_rs_seq), draft=Ctx("draft", log) if draft else None,
                             target_removes=target_removes, draft_removes=draft_removes)
    return StepMemory(memory), log


def test_drafting_kv_leaves_a_draft_context_that_drops_suffixes_and_no_state_is_saved():
    mem, log = slot(target_removes=True, draft_removes=True)
    state = mem.before_drafting()
    mem.after_drafting(10, 3, state)
    assert state is None and log == [("draft", "rm", 10)] and not mem.checkpointed


def test_a_draft_context_that_cannot_drop_a_suffix_goes_back_to_its_saved_state_before_its_drafting_kv_goes():
    mem, log = slot(target_removes=True, draft_removes=False)
    mem.after_drafting(10, 3, mem.before_drafting())
    assert log == [("draft", "save"), ("draft", "load", b"draft"), ("draft", "rm", 10)]


def test_a_target_that_cannot_drop_the_draft_saves_its_state_after_drafting_and_only_with_a_draft():
    mem, log = slot(target_removes=False, draft_removes=True)
    mem.after_drafting(10, 0, None)
    assert not mem.checkpointed
    mem.after_drafting(10, 2, None)
    assert mem.checkpointed and log[-1] == ("target", "save")


def test_a_target_with_snapshots_saves_its_state_only_for_a_draft_longer_than_them():
    mem, _ = slot(target_removes=True, draft_removes=True, n_rs_seq=2)
    mem.after_drafting(10, 2, None)
    assert not mem.checkpointed
    mem.after_drafting(10, 3, None)
    assert mem.checkpointed


def test_a_restore_loads_both_saved_states_before_the_steps_positions_go():
    mem, log = slot(target_removes=False, draft_removes=False)
    mem.after_drafting(10, 3, mem.before_drafting())
    del log[:]
    mem.restore(10)
    assert log == [("target", "load", b"target"), ("target", "rm", 10), ("draft", "load", b"draft"), ("draft", "rm", 10)]


def test_a_trim_drops_the_positions_past_the_kept_ones_on_both_contexts_and_on_the_target_alone_without_a_draft():
    mem, log = slot(target_removes=True, draft_removes=True)
    mem.trim(14)
    assert log == [("target", "rm", 14), ("draft", "rm", 14)]
    alone, log = slot(target_removes=True, draft_removes=True, draft=False)
    alone.after_drafting(10, 3, alone.before_drafting())
    alone.trim(14)
    assert log == [("target", "rm", 14)]


# --- the emitted tokens -----------------------------------------------------------------------

@pytest.mark.parametrize("text, is_eog, n_prompt, n_before, n_step, n_emitted, why", [
    (b"a STOP", True, 5, 0, 1, 1, "stop string"),  # a stop string first, even on an EOG
    (b"a", True, 10, 0, 1, 1, "context"),          # a full context before EOG
    (b"a", True, 5, 0, 1, 3, "n_predict"),         # n_predict before EOG
    (b"a", True, 5, 0, 1, 1, "eog"),
    (b"a", False, 6, 0, 4, 1, "context"),          # a step that fills the context: every token of it
    (b"a", False, 6, 0, 3, 1, None),
])
def test_generation_stops_after_a_token_by_the_servers_rules_in_its_order(text, is_eog, n_prompt, n_before,
                                                                          n_step, n_emitted, why):
    limits = Limits(n_ctx=10, n_predict=3, stop=("STOP",))
    assert stop_reason(text, is_eog, limits, n_prompt=n_prompt, n_before=n_before, n_step=n_step,
                       n_emitted=n_emitted) == why


def test_a_stop_string_is_looked_for_only_once_the_text_ends_in_a_whole_character():
    limits = Limits(n_ctx=100, stop=("é",))
    half = "é".encode()[:1]
    assert stop_reason(b"caf" + "é".encode() + half, False, limits, n_prompt=1, n_before=0, n_step=1, n_emitted=1) is None
    assert stop_reason(b"caf" + "é".encode(), False, limits, n_prompt=1, n_before=0, n_step=1, n_emitted=1) == "stop string"


class Target:
    def piece(self, tok: int, special: bool = False) -> bytes:
        return {1: b"he", 2: b"llo", 3: b"</s>"}[tok]

    def is_eog(self, tok: int) -> bool:
        return tok == 3


def row(best: int) -> tuple[np.ndarray, np.ndarray]:
    logits = np.zeros(4, dtype=np.float32)
    logits[best] = 2.0
    return logits, np.array([(best, 0.75, 2.0), ((best + 1) % 4, 0.25, 0.0)], dtype=CAND)


def test_each_emitted_token_carries_its_rows_values_and_the_record_says_why_generation_stopped():
    rec = Emission(Target(), Limits(n_ctx=100, stop=("hello",)), n_prompt=5, n_probs=2)
    assert rec.add(1, 0, *row(1), n_before=0, n_step=1)
    assert not rec.add(2, 1, *row(1), n_before=1, n_step=2, chosen=(3, "rejection resampled"))
    first, second = rec.emitted
    lse = np.log(np.exp(2.0) + 3.0)
    assert first.logprob == pytest.approx(2.0 - lse, abs=1e-6) and second.logprob == pytest.approx(-lse, abs=1e-6)
    assert (second.post_prob, second.draw, second.chosen) == (pytest.approx(0.25), 3, "rejection resampled")
    assert first.post_prob == pytest.approx(0.75) and [t for t, _ in first.post_top] == [1, 2]
    assert (rec.text, rec.stopped) == (b"hello", "stop string")


def test_without_evidence_the_record_keeps_no_candidates_or_logits():
    rec = Emission(Target(), Limits(n_ctx=100), n_prompt=5, n_probs=0, evidence=False)
    rec.add(1, 0, *row(1), n_before=0, n_step=1)
    assert rec.emitted[0].cands is None and rec.emitted[0].best_logits == {}
    assert rec.remaining() == -1 and Emission(Target(), Limits(100, n_predict=4), 5, 0).remaining() == 4
