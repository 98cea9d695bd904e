"""From a Record to the generated-token plan: known ids, gaps to align, and where each entry lives.

What the server really sends (SERVER_LOOP.md 3.8, 5.1, 6.1-6.2):
  * entries carry `id`; their outer `token`/`bytes` are the *text_to_send*
    (after stop-string hold-back, so "" or several tokens' text), not the piece;
  * a token whose text ends in incomplete UTF-8 gets no entry and no stream
    chunk: its bytes reach the client inside the next entry's `bytes`;
  * in streams, speculative tokens have no entry at all: only their text;
  * non-stream `stop_type: word` trims the stop word's entries at the end.

So the plan is built from the entries (ids), with a Gap wherever the text sent
so far is longer than the pieces accounted for, and, in streams, one Gap per
chunk whose text came without an entry. Every Known/Gap carries a `Ref`: the
entry to rewrite, or the list (and position) to insert new entries into.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import TranscriptError
from .evaluate import Gap, Known, PlanItem
from .readers import CHAT, NATIVE, Record, entries_of


@dataclass(eq=False)
class Ref:
    """Where a token's probability entry is (or belongs) in the record's objects."""

    entry: dict | None  # the server's entry; None = the server sent none
    home: list | None  # the list holding (or to hold) it
    before: dict | None = None  # insert new entries before this existing entry (None = append)
    chunk: dict | None = None  # stream chunk that owns `home` (created there if needed)
    last_written: dict | None = None  # the entry repair wrote last for this ref (multi-token gaps)
    report_only: bool = False  # the server drops this token's entry by design: report it, write nothing
    reason: str = ""  # why there is no entry, for the report


def _entry_bytes(e: dict) -> bytes:
    b = e.get("bytes")
    if isinstance(b, list) and all(isinstance(x, int) and 0 <= x < 256 for x in b):
        return bytes(b)
    t = e.get("token")
    return t.encode("utf-8") if isinstance(t, str) else b""


def _entries(rec: Record, obj: dict) -> list | None:
    return entries_of(rec.endpoint, obj)


def _gap_before(sent: bytearray, covered: bytearray, n_next: int) -> bytes | None:
    """Bytes sent so far that neither the covered pieces nor the next `n_next` bytes account for."""
    excess = len(sent) - (len(covered) + n_next)
    if excess <= 0:
        return None
    gap = bytes(sent[len(covered):len(covered) + excess])
    covered.extend(gap)
    return gap


def _with_gaps(entries: list, piece: Callable[[int], bytes], home: list, chunk: dict | None,
               sent: bytearray, covered: bytearray) -> list[PlanItem]:
    """Known items for `entries`, with a Gap before any entry whose sent text outruns the pieces."""
    plan: list[PlanItem] = []
    for e in entries:
        tid = e.get("id")
        if tid is None:
            # e.g. an SDK dump that dropped the ids: align the entry's own bytes
            data = _entry_bytes(e)
            if not data:
                raise TranscriptError("an entry has neither a token id nor text (its text was held back), so "
                                      "its token cannot be identified; keep the ids (\"id\") when dumping")
            sent.extend(data)
            plan.append(Gap(data, "the entry carries no token id", Ref(e, home, chunk=chunk)))
            covered.extend(data)
            continue
        sent.extend(_entry_bytes(e))
        p = piece(tid)
        gap = _gap_before(sent, covered, len(p))
        if gap:
            plan.append(Gap(gap, "incomplete UTF-8: the server sent no entry for these bytes",
                            Ref(None, home, before=e, chunk=chunk)))
        plan.append(Known(tid, Ref(e, home, chunk=chunk)))
        covered.extend(p)
    return plan


def build_plan(rec: Record, piece: Callable[[int], bytes]) -> list[PlanItem]:
    """The generated tokens of `rec` in order (see module docstring)."""
    if not rec.stream:
        return _plan_body(rec, piece)
    return _plan_stream(rec, piece)


def _plan_body(rec: Record, piece) -> list[PlanItem]:
    r = rec.response
    assert r is not None
    entries = _entries(rec, r)
    ids = r.get("tokens") if rec.endpoint == NATIVE else None
    if entries is None:
        if not (isinstance(ids, list) and ids):
            raise TranscriptError("the response carries neither probabilities nor token ids, so its tokens cannot "
                                  "be told apart: record with logprobs (n_probs / top_logprobs) or return_tokens")
        # no probabilities requested: create the list where the server would put it
        entries = []
        if rec.endpoint == NATIVE:
            r["completion_probabilities"] = entries
        else:
            r["choices"][0]["logprobs"] = {"content": entries}
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return _plan_from_ids(ids, entries, stop_word=r.get("stop_type") == "word")
    return _with_gaps(entries, piece, entries, None, bytearray(), bytearray())


def _plan_from_ids(ids: list[int], entries: list, stop_word: bool) -> list[PlanItem]:
    """/completion with return_tokens: ids are authoritative; entries are a subsequence of them.

    Tokens after the last entry are reported but get no entry written: the
    server trims a stop word's entries on purpose (server-context.cpp:2266-2273),
    and a final token ending in incomplete UTF-8 was never sent.
    """
    plan: list[PlanItem] = []
    k = 0
    refs: list[Ref] = []
    for tid in ids:
        if k < len(entries) and entries[k].get("id") == tid:
            refs.append(Ref(entries[k], entries))
            k += 1
        else:
            refs.append(Ref(None, entries, before=entries[k] if k < len(entries) else None,
                            reason="incomplete UTF-8: the server sent no entry for this token"))
    if k < len(entries):
        raise TranscriptError(f"the probability entries do not follow the returned token ids "
                              f"(entry {k}, id {entries[k].get('id')}, is not among them)")
    last = max((i for i, r in enumerate(refs) if r.entry is not None), default=-1)
    for i, (tid, ref) in enumerate(zip(ids, refs)):
        if i > last and entries:
            ref = Ref(None, None, report_only=True,
                      reason=("the stop word's entries are trimmed by the server" if stop_word
                              else "ends in incomplete UTF-8: the server never sent it"))
        plan.append(Known(tid, ref))
    return plan


def _chunk_text(rec: Record, c: dict) -> bytes:
    if rec.endpoint == NATIVE:
        t = c.get("content")
    else:
        ch = c.get("choices") or []
        if not ch or not isinstance(ch[0], dict):
            return b""
        if rec.endpoint == CHAT:
            delta = ch[0].get("delta") or {}
            t = delta.get("content") if isinstance(delta, dict) else None
        else:
            t = ch[0].get("text")
    return t.encode("utf-8") if isinstance(t, str) else b""


def home_for_chunk(rec: Record, c: dict) -> list:
    if rec.endpoint == NATIVE:
        lst = c.get("completion_probabilities")
        if not isinstance(lst, list):
            lst = []
            c["completion_probabilities"] = lst
        return lst
    ch = c["choices"][0]
    lp = ch.get("logprobs")
    if not isinstance(lp, dict):
        lp = {"content": []}
        ch["logprobs"] = lp
    if not isinstance(lp.get("content"), list):
        lp["content"] = []
    return lp["content"]


def _is_final_native(c: dict) -> bool:
    return c.get("stop") is True


def _plan_stream(rec: Record, piece) -> list[PlanItem]:
    plan: list[PlanItem] = []
    sent, covered = bytearray(), bytearray()
    for c in rec.chunks():
        if rec.endpoint == NATIVE and _is_final_native(c):
            continue  # the final chunk repeats the result without probabilities
        entries = _entries(rec, c)
        text = _chunk_text(rec, c)
        if entries:
            home = home_for_chunk(rec, c)
            plan += _with_gaps(entries, piece, home, c, sent, covered)
            continue
        if rec.endpoint == NATIVE and isinstance(c.get("tokens"), list) and c["tokens"]:
            # /completion with return_tokens: the chunk names its token(s)
            home = home_for_chunk(rec, c)
            ids = [int(t) for t in c["tokens"]]
            sent.extend(text)
            # a token ending in incomplete UTF-8 got no chunk: its bytes open this chunk's text
            gap = _gap_before(sent, covered, sum(len(piece(t)) for t in ids))
            if gap:
                plan.append(Gap(gap, "incomplete UTF-8: the server streamed no chunk for these bytes",
                                Ref(None, home, chunk=c)))
            for tid in ids:
                plan.append(Known(tid, Ref(None, home, chunk=c)))
                covered.extend(piece(tid))
            continue
        if not text:
            continue  # role chunk, empty delta, usage/timings chunk
        sent.extend(text)
        gap = _gap_before(sent, covered, 0)
        if gap:
            plan.append(Gap(gap, "streamed without probabilities (speculative token)", Ref(None, None, chunk=c)))
    return plan
