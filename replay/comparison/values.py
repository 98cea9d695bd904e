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
from dataclasses import dataclass, field, replace
from typing import Callable

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
# Where recover cannot compute a speculating server's values in the decodes that computed them, they
# are approximate from the first such token on, real entries there are judged within this bound, and
# the report says so (schedule.approximate_from, a note). Two cases: a target whose memory cannot drop a
# suffix (Gemma 3's sliding window, recurrent and hybrid models) verifies a partly accepted draft by
# restoring a checkpoint and decoding the accepted tokens again (server-context.cpp:4276-4305), in
# batches the transcript does not show, which past 256 positions change values (schedule/rows.py):
# measured up to 0.29 nats on a low-probability alternative of Gemma 3 270M with its draft
# (tests/test_gemma.py); and with flash attention off, a verify batch's attention runs through matmul
# kernels that take another path for several rows than for one, so no one-row decode gives its rows:
# measured 0.027 nats on a later real entry of SmolLM2 Q4_1 (tests/test_numerics_flags.py). Until
# recover replays the verify batches themselves (trace does), these are approximate.
APPROXIMATE_DRIFT = 0.3
# A server with several slots decodes a request in batches shared with other requests, which changes
# the CPU kernels and the KV layout: its real values then differ from a one-request evaluation.
# Measured on SmolLM2 Q4_1 (b11434, -np auto = 4 slots, 4 concurrent requests at a time, 36
# records of plain, draft-simple and ngram-mod servers), as the probability-weighted mean |diff|
# of an entry's token and alternatives (weighted_disagreement):
#     the first entry (computed in the prompt batch):  at most 0.149 nats; with the Q2_K
#                                                       requantisation as the model, 0.455 or more
#     the whole record:                                at most 0.158; with Q2_K, 0.122 or more
# Later entries of a plain server, decoded in batches shared with other slots, reached 0.457 on
# their own, so the first entry tells a wrong model file from batching; the record mean is a
# sanity bound. Beyond the bound the model file or the build is not the server's.
BATCH_BOUND = 0.25
# The largest single later entry of those measurements (a plain 4-slot server): what a record with
# evidence of shared batches says its values may be off by, even where its own real entries agree.
SHARED_ENTRY_DRIFT = 0.46
# Measured again with a 4-slot b11434 server and 8 concurrent OpenAI-SDK chat requests (bench/identity.py,
# docs/recover.md "A wrong model file"): the right model's first entries were 0 to 0.152 nats off
# (SmolLM2 Q4_1) and 0.012 to 0.141 (Gemma 3 Q4_K_M); requantised to Q4_0 they were 0.17 to 1.03 and
# 0.92 to 1.15 (records 0.38 or more), to Q2_K 0.36 or more. A Q8_0 requantisation stays within the
# noise (first entries 0.01 to 0.15): values cannot tell it, the transcript's model name does
# (reading/identity.py). A model every record's first entry is this far from is not the server's,
# whatever else may have moved the values.
FIRST_ENTRY_BOUND = 0.2
# The words of settings/config.py idle_cells_kept's evidence: other slots' cells in a unified cache (same
# judgement as shared batches, a weaker form of the same cause: other sequences' cells in the KV view).
KEPT_CELLS = "keeps idle slots' cells"


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


def weighted_disagreement(reports: list[TokenReport]) -> float | None:
    """The mean |server - true| logprob over every real value of a record (each entry's token and the
    alternatives both top lists hold), weighted by the server's probability: None without real values.

    >>> weighted_disagreement([TokenReport(0, 1, "a", -0.1, -0.12, "ok", [], real_pairs=((-0.1, -0.12), (-2.4, -2.0)))])
    0.0546...
    """
    num = den = 0.0
    for r in reports:
        for s, t in r.real_pairs:
            if math.isfinite(s) and math.isfinite(t):
                w = math.exp(s)
                num += w * abs(s - t)
                den += w
    return num / den if den > 0 else None


def numerics_cause(shared: str | None, kernels: str | None) -> str | None:
    """Why the server's real values may differ from a one-request CPU evaluation of the same tokens,
    or None when nothing says they may: batches shared with other requests, where the record shows
    a server that may have run them (`shared`: transcripts/readers.py shared_evidence, or the user's --shared-batches;
    an unknown slot count is not such evidence), and/or other kernels (runtime/backend.py).

    >>> numerics_cause(None, None) is None
    True
    >>> numerics_cause("a 4-slot server (/props total_slots)", None)
    'batches shared with other requests on a 4-slot server (/props total_slots)'
    >>> numerics_cause("a 4-slot unified KV cache that keeps idle slots' cells (--cache-ram 0)", None)
    "other slots' cells in its KV view, on a 4-slot unified KV cache that keeps idle slots' cells (--cache-ram 0)"
    """
    causes = []
    if shared and KEPT_CELLS in shared:  # settings/config.py idle_cells_kept
        causes.append(f"other slots' cells in its KV view, on {shared}")
    elif shared:
        causes.append(f"batches shared with other requests on {shared}" if shared.startswith("a ")
                      else f"batches shared with other requests ({shared})")
    if kernels:
        causes.append(kernels)
    return "; ".join(causes) or None


def numerics_kind(shared: str | None, kernels: str | None) -> str | None:
    """The report's one-word-ish name of numerics_cause, from the same evidence (numerics.cause in the JSON).

    >>> numerics_kind("a 4-slot server", None), numerics_kind(None, "a GPU"), numerics_kind("x", "a GPU")
    ('batch composition', 'kernels', 'batch composition and kernels')
    >>> numerics_kind(None, None) is None
    True
    >>> numerics_kind("a 4-slot unified KV cache that keeps idle slots' cells (--cache-ram 0)", None)
    'KV layout'
    """
    kinds = (["KV layout" if KEPT_CELLS in shared else "batch composition"] if shared else []) + (
        ["kernels"] if kernels else [])
    return " and ".join(kinds) or None


@dataclass(frozen=True)
class Disagreement:
    """How far a record's real values are from the replay's, weighted by probability
    (weighted_disagreement): its first real entry (computed in the prompt batch: the one a wrong model
    file cannot hide in) and all of them. None: no real value."""

    first: float | None
    record: float | None

    @property
    def worst(self) -> float | None:
        """The larger of the two (None without real values).

        >>> Disagreement(0.02, 0.1).worst, Disagreement(None, None).worst
        (0.1, None)
        """
        known = [x for x in (self.first, self.record) if x is not None]
        return max(known) if known else None


def disagreement(reports: list[TokenReport]) -> Disagreement:
    """The Disagreement of one record's token reports."""
    real = [r for r in reports if r.real_pairs]
    return Disagreement(weighted_disagreement(real[:1]), weighted_disagreement(real))


def judge_numerics(reports: list[TokenReport], cause: str | None, bound: float = BATCH_BOUND) -> tuple[
        list[TokenReport], Disagreement, bool]:
    """Where the server's numerics may differ from the replay's (`cause`, numerics_cause), real values
    that disagree are numerics when the weighted disagreement of the first real entry, and of the record,
    are within `bound` (BATCH_BOUND): they become ok, kept as sent, with the cause in their note.
    Returns (reports, their Disagreement, judged numerics). The transcript's evidence as a whole is
    judged after every record (comparison/evidence.py)."""
    d = disagreement(reports)
    w = d.worst
    if cause is None or w is None or w > bound or not any(r.status == "mismatch" for r in reports):
        return reports, d, False
    out = [replace(r, status="ok", note=f"|diff| {abs(r.server_logprob - r.true_logprob):.2e}: {cause} (kept as sent)")
           if r.status == "mismatch" and r.server_logprob is not None and r.true_logprob is not None else r
           for r in reports]
    return out, d, True


def wrong_everywhere(firsts: list[float]) -> str | None:
    """The transcript-wide verdict on the model where options or evidence let numerics explain
    disagreement: one line when every record's first real entry (its weighted disagreement) is beyond
    FIRST_ENTRY_BOUND, else None. Judged on all of them, not one number.

    >>> wrong_everywhere([0.02, 0.31]) is None
    True
    >>> print(wrong_everywhere([0.38, 0.92]))
    every record's first entry is 0.380 nats or more from this model's (2 records), beyond the 0.2 that shared batches and other kernels move one (0.152 at most measured): the model file is not the server's
    """
    if not firsts or min(firsts) <= FIRST_ENTRY_BOUND:
        return None
    n = len(firsts)
    return (f"every record's first entry is {min(firsts):.3f} nats or more from this model's ({n} record"
            f"{'s' if n != 1 else ''}), beyond the {FIRST_ENTRY_BOUND} that shared batches and other kernels move "
            "one (0.152 at most measured): the model file is not the server's")
