"""The verifiers of a draft (replay/loop/verifiers.py), specified over a stand-in target: rows whose chain
draws are given, so that each rule's choices can be read off. Real models' steps are specified by the
trace tests (tests/test_trace_live.py, tests/test_gemma.py): every token and draft total of a real server.

- sample-and-match keeps each row's draw, goes on while it equals the draft token, and takes the bonus
  only when the whole draft was kept; it stops at an end-of-generation draw before the draft's end;
- the rejection rule keeps a draft token the target likes at least as much as the draft without a draw,
  draws U for one it likes less (kept when U < p/q), and resamples from the residual on a rejection;
- a restored step's replay accepts every kept token again, each after a draw it discards, then samples one;
- every kept token joins the chain's history before the next row is sampled (the server's order).
"""
from __future__ import annotations

import numpy as np
import pytest

from replay.loop.verifiers import by_match, by_rejection, by_replay


CAND = np.dtype([("id", np.int32), ("p", np.float32), ("logit", np.float32)])
EOG = 99


class Rows:
    """A verify batch whose row k's chain draw is draws[k] over candidates cands[k] ({id: p}); it logs what
    the verifier did, in order."""

    def __init__(self, draws: list[int], cands: list[dict[int, float]] | None = None):
        self.draws, self.cands = draws, cands or [{d: 1.0} for d in draws]
        self.n_applies, self.log = 0, []

    def logits(self, row: int) -> np.ndarray:
        self.log.append(("row", row))
        return np.full(4, float(row), dtype=np.float32)

    def sample(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        row = int(logits[0])
        self.n_applies += 1
        self.log.append(("sample", row))
        c = np.array([(i, p, 0.0) for i, p in self.cands[row].items()], dtype=CAND)
        return self.draws[row], c

    def accept(self, tok: int) -> None:
        self.log.append(("accept", tok))

    def target_p(self, cands: np.ndarray) -> np.ndarray:
        return cands["p"]


def uniforms(*us: float):
    it = iter(np.float32(u) for u in us)
    return lambda: next(it)


def test_sample_and_match_keeps_the_draws_while_they_equal_the_draft_and_takes_the_bonus_after_a_whole_draft():
    v = by_match([5, 6, 7], Rows([5, 6, 7, 8]), is_eog=lambda t: t == EOG, eog_rule=True)
    assert (v.ids, v.resampled, v.bonus) == ([5, 6, 7, 8], None, 8)


def test_sample_and_match_emits_the_first_draw_that_differs_as_the_resampled_token_and_nothing_after_it():
    rows = Rows([5, 4, 7, 8])
    v = by_match([5, 6, 7], rows, is_eog=lambda t: t == EOG, eog_rule=True)
    assert (v.ids, v.resampled, v.bonus) == ([5, 4], 4, None)
    assert ("row", 2) not in rows.log  # the rows after it are not read


def test_sample_and_match_stops_at_an_end_of_generation_before_the_drafts_end():
    v = by_match([5, EOG, 7], Rows([5, EOG, 7, 8]), is_eog=lambda t: t == EOG, eog_rule=True)
    assert (v.ids, v.resampled, v.bonus) == ([5, EOG], None, None)
    before = by_match([5, EOG, 7], Rows([5, EOG, 7, 8]), is_eog=lambda t: t == EOG, eog_rule=False)
    assert before.ids == [5, EOG, 7, 8]  # before b11269 acceptance ran past a matched EOG


def test_no_draft_is_the_normal_paths_single_draw_without_a_bonus():
    v = by_match([], Rows([3]), is_eog=lambda t: False, eog_rule=True)
    assert (v.ids, v.bonus) == ([3], None)


def test_the_rejection_rule_keeps_a_token_the_target_likes_as_much_without_a_draw():
    rows = Rows([1, 2, 3], cands=[{5: 0.6, 1: 0.4}, {6: 0.5, 2: 0.5}, {3: 1.0}])
    q = [([5, 1], [0.5, 0.5]), ([6, 2], [0.5, 0.5])]
    v = by_rejection([5, 6], q, rows, uniforms())  # no uniform to draw: p >= q at both positions
    assert (v.ids, v.resampled, v.bonus) == ([5, 6, 3], None, 3)
    assert v.uniforms == [[None, None], [None, None]]


def test_the_rejection_rule_draws_for_a_token_the_target_likes_less_and_resamples_from_the_residual():
    # p(5) = 0.2 < q(5) = 0.8: kept iff U < 0.25; U = 0.9 rejects, the residual max(0, p - q) is {1: 0.6}
    rows = Rows([1, 2], cands=[{5: 0.2, 1: 0.8}, {2: 1.0}])
    v = by_rejection([5], [([5, 1], [0.8, 0.2])], rows, uniforms(0.9, 0.3))
    assert (v.ids, v.resampled, v.bonus) == ([1], 1, None)
    assert v.chosen == [(1, "rejection resampled")]
    kept = by_rejection([5], [([5, 1], [0.8, 0.2])], Rows([1, 2], cands=[{5: 0.2, 1: 0.8}, {2: 1.0}]),
                        uniforms(0.1))
    assert (kept.ids, kept.bonus) == ([5, 2], 2)


def test_a_restored_steps_replay_accepts_the_kept_tokens_each_after_a_draw_it_discards_then_samples_one():
    rows = Rows([9, 9, 4])
    v = by_replay([5, 6], rows)
    assert (v.ids, v.bonus) == ([5, 6, 4], 4)
    assert [e for e in rows.log if e[0] != "row"] == [("sample", 0), ("accept", 5), ("sample", 1), ("accept", 6),
                                                      ("sample", 2), ("accept", 4)]
    assert [c for _, c in v.chosen] == ["replayed", "replayed", "drawn"]


def test_each_kept_token_joins_the_history_before_the_next_row_is_sampled():
    rows = Rows([5, 6, 8])
    by_match([5, 6], rows, is_eog=lambda t: False, eog_rule=True)
    assert [e for e in rows.log if e[0] != "row"] == [("sample", 0), ("accept", 5), ("sample", 1), ("accept", 6),
                                                      ("sample", 2), ("accept", 8)]
