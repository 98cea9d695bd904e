"""The comparison: what the server sent for one token against the true values. Pure.

    compare(truth, entry, ...) -> TokenReport

Each token is classified:

    ok           the server's value is real and agrees with the true one (within the tolerance)
    placeholder  logprob 0 / prob 1 with no alternatives where alternatives were asked for
    missing      no entry at all (streamed speculative tokens, tokens ending in incomplete UTF-8)
    mismatch     a real-looking value that disagrees beyond the tolerance
    unaligned    generated text no sequence of the model's pieces spells

Values are compared in natural-log space in both modes: post-sampling `prob`s are logged.
A real value agrees when it is within `tolerance` of the truth with the same top-N ids. There is no
looser rule for a speculating server's real entries after the first: the replay computes each of them
in the kind of decode the server computed it in (schedule/rows.py), so they are its values too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from replay.comparison.bounds import APPROXIMATE_DRIFT
from replay.evaluation.walk import Truth
from replay.transcripts.entries import is_placeholder, parse_entry

STATUSES = ("ok", "placeholder", "missing", "mismatch", "unaligned")
RECOVERED = ("ok", "placeholder", "missing")


@dataclass(frozen=True)
class TokenReport:
    index: int
    id: int | None
    piece: str
    server_logprob: float | None  # natural log; null where the server sent nothing
    true_logprob: float | None
    status: str
    true_top: list[dict]
    note: str = ""
    # (server, true) logprob of the token and of each alternative both lists hold: a real entry's values
    real_pairs: tuple[tuple[float, float], ...] = field(default=(), compare=False, repr=False)

    def to_json(self) -> dict:
        return {"index": self.index, "id": self.id, "piece": self.piece, "server_logprob": self.server_logprob,
                "true_logprob": self.true_logprob, "status": self.status, "true_top": self.true_top,
                **({"note": self.note} if self.note else {})}


DEFAULT_TOLERANCE = 5e-4


def tops_agree(server: list[tuple[int | None, float]], true: list[tuple[int, float]], tol: float) -> bool:
    """Are the server's top-N alternatives the replay's: the same ids in the same order, each logprob
    within `tol` (an entry the same kernels computed on the same KV)?

    >>> tops_agree([(1, -0.1), (2, -2.5)], [(1, -0.1), (2, -2.5)], 5e-4)
    True
    >>> tops_agree([(1, -0.1), (3, -2.5)], [(1, -0.1), (2, -2.5)], 5e-4)   # another id: not the same entry
    False
    >>> tops_agree([(1, -0.1)], [(2, -0.1)], 5e-4)   # one alternative is compared too
    False
    """
    return len(server) == len(true) and all(
        si == ti and (abs(slp - tlp) <= tol if math.isfinite(slp) and math.isfinite(tlp) else slp == tlp)
        for (si, slp), (ti, tlp) in zip(server, true))


def tops_near(server: list[tuple[int | None, float]], true: list[tuple[int, float]], drift: float) -> bool:
    """The looser rule for an entry whose values are approximate (APPROXIMATE_DRIFT: a checkpointing target
    past 256 positions, or -fa off): every id both lists hold has logprobs within `drift` (so
    near-tied entries may be listed in another order), and the lists hold the same ids but for at most
    one at the boundary, the last of each list of two or more, the two boundary values within `drift`.

    >>> tops_near([(1, -0.1), (3, -2.6)], [(1, -0.1), (2, -2.5)], 0.3)   # a near-tie at the cut
    True
    >>> tops_near([(1, -0.94), (2, -2.34), (3, -2.36)], [(1, -1.0), (3, -2.21), (2, -2.28)], 0.3)  # swapped
    True
    >>> tops_near([(1, -0.1), (3, -3.6)], [(1, -0.1), (2, -2.5)], 0.3)   # not near: another entry
    False
    >>> tops_near([(3, -0.7)], [(2, -0.7)], 0.3)
    False
    >>> tops_near([(1, -0.1), (2, -2.9)], [(1, -0.1), (2, -2.5)], 0.3)   # the same ids, too far apart
    False
    """
    if len(server) != len(true) or not server:
        return False

    def near(a: float, b: float) -> bool:
        return abs(a - b) <= drift if math.isfinite(a) and math.isfinite(b) else a == b
    theirs, ours = dict(server), dict(true)
    if not all(near(v, ours[i]) for i, v in theirs.items() if i in ours):
        return False
    only_theirs = [i for i, _ in server if i not in ours]
    only_ours = [i for i, _ in true if i not in theirs]
    if not only_theirs and not only_ours:
        return True
    return (len(server) >= 2 and only_theirs == [server[-1][0]] and only_ours == [true[-1][0]]
            and near(server[-1][1], true[-1][1]))


def server_values(e: dict) -> tuple[float, list[tuple[int | None, float]]]:
    """(logprob, top-N (id, logprob)) of an entry the server sent, in either mode (parse_entry)."""
    sent = parse_entry(e)
    return sent.logprob, [(i, lp) for i, _, lp in sent.top]


def true_values(t: Truth, post: bool) -> tuple[float, list[tuple[int, float]]]:
    """(logprob, top-N (id, logprob)) of the truth in the mode the server reported."""
    if post:
        return (math.log(t.post_prob) if t.post_prob else float("-inf"),
                [(i, math.log(p)) for i, p in (t.post_top or [])])
    return t.logprob, t.top


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare(t: Truth, entry: dict | None, *, post: bool, n_probs: int, tolerance: float, speculative: bool,
            piece: Callable[[int], str], missing_reason: str, approximate_from: int | None = None) -> TokenReport:
    """Classify one token (the statuses above). `entry` is the server's entry for it (None: it
    sent none; `missing_reason` says why); `speculative`: the server ran its speculative loop."""
    true_lp, true_top = true_values(t, post)
    top_json = [{"id": i, "piece": piece(i), "logprob": lp} for i, lp in true_top]
    text = piece(t.id)
    if entry is None:
        return TokenReport(t.index, t.id, text, None, _finite(true_lp), "missing", top_json, note=missing_reason)
    server_lp, server_top = server_values(entry)
    if is_placeholder(server_lp, server_top, n_probs):
        return TokenReport(t.index, t.id, text, 0.0, _finite(true_lp), "placeholder", top_json)
    listed = len(server_top) == min(len(true_top), n_probs)
    same_ids = listed and tops_agree(server_top, true_top[:len(server_top)], tolerance)
    if math.isfinite(server_lp) and math.isfinite(true_lp):
        diff = abs(server_lp - true_lp)
    else:
        diff = 0.0 if server_lp == true_lp else math.inf
    pairs = ((server_lp, true_lp),) + tuple((slp, dict(true_top)[sid]) for sid, slp in server_top
                                           if sid in dict(true_top))
    status = "ok" if diff <= tolerance and same_ids else "mismatch"
    ids_differ = [s for s, _ in server_top] != [i for i, _ in true_top[:len(server_top)]] or not listed
    note = "" if status == "ok" else (f"|diff| {diff:.2e}" + ("; top ids differ" if ids_differ else
                                                              "; top logprobs differ"))
    if status == "mismatch" and approximate_from is not None and t.index >= approximate_from and listed and \
            diff <= APPROXIMATE_DRIFT and tops_near(server_top, true_top[:len(server_top)], APPROXIMATE_DRIFT):
        status = "ok"
        note = (f"|diff| {diff:.2e}: approximate, the server computed this record's KV in batches this replay "
                "does not reproduce (kept as sent)")
    return TokenReport(t.index, t.id, text, server_lp, _finite(true_lp), status, top_json, note=note,
                       real_pairs=pairs)
