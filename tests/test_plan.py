"""The generated-token plan of a record (transcripts/plan.py): which tokens it carries, which bytes
must be aligned to the vocabulary, and where each token's entry is or belongs. Built from what the
server really sends; never changes the record.

Pieces here: 1 = "a", 2 = "\\xc3" and 3 = "\\xa9" (the two halves of "é"), 4 = "b", 5 = "cd".
"""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from replay.errors import TranscriptError
from replay.transcripts.plan import EntryPlace, Known, build_plan, entry_at
from replay.transcripts.readers import read_text

PIECES = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"b", 5: b"cd"}
piece = PIECES.__getitem__


def entry(tid: int | None, text: bytes, logprob: float = -1.0) -> dict:
    e = {"token": text.decode("utf-8", "ignore"), "bytes": list(text), "logprob": logprob, "top_logprobs": []}
    if tid is not None:
        e["id"] = tid
    return e


def record(request: dict, response, endpoint: str = "/completion"):
    pair = {"endpoint": endpoint, "request": request, "response": response}
    return read_text(json.dumps(pair), "t.json")[0]


def shape(plan):
    return [(type(i).__name__, i.id if isinstance(i, Known) else i.data, i.place) for i in plan]


def test_a_token_ending_in_incomplete_utf8_is_a_gap_before_the_entry_that_carries_its_bytes():
    rec = record({"prompt": "x"}, {"content": "aé", "completion_probabilities": [
        entry(1, b"a"), entry(3, b"\xc3\xa9")]})
    assert shape(build_plan(rec, piece)) == [
        ("Known", 1, EntryPlace(None, 0, 0)),
        ("Gap", b"\xc3", EntryPlace(None, None, 1)),  # no entry: a new one goes before entry 1
        ("Known", 3, EntryPlace(None, 1, 1)),
    ]


def test_returned_ids_are_authoritative_and_a_trimmed_stop_word_is_reported_not_written():
    rec = record({"prompt": "x"}, {"content": "ab", "tokens": [1, 4, 5], "stop_type": "word",
                                   "completion_probabilities": [entry(1, b"a"), entry(4, b"b")]})
    plan = build_plan(rec, piece)
    assert [i.id for i in plan] == [1, 4, 5]
    assert plan[2].place.write is False and "stop word" in plan[2].place.reason


def test_speculative_stream_chunks_without_entries_are_gaps_of_their_own_text():
    events = [{"content": "a", "stop": False, "completion_probabilities": [entry(1, b"a")]},
              {"content": "b", "stop": False},
              {"content": "cd", "stop": False},
              {"content": "", "stop": True, "tokens_predicted": 3}]
    rec = record({"prompt": "x", "stream": True}, events)
    assert shape(build_plan(rec, piece)) == [
        ("Known", 1, EntryPlace(0, 0, 0)),
        ("Gap", b"b", EntryPlace(1, None, 0)),
        ("Gap", b"cd", EntryPlace(2, None, 0)),
    ]


def test_a_v1_completions_streams_speculative_chunks_are_known_by_the_ids_their_verbose_copy_names():
    """With verbose (record and the proxy ask for it), each /v1/completions chunk carries `__verbose`, whose
    `tokens` names the chunk's token (server-task.cpp:1046-1052, 1099): the loop can match them. A chat
    stream's chunks carry no such copy: their text stays a gap."""
    def chunk(text: str, tid: int, entries=None) -> dict:
        return {"choices": [{"text": text, "index": 0, "logprobs": {"content": entries} if entries else None,
                             "finish_reason": None}], "__verbose": {"content": text, "tokens": [tid]}}
    events = [chunk("a", 1, [entry(1, b"a")]), chunk("b", 4), chunk("cd", 5),
              {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
               "__verbose": {"content": "", "tokens": []}}, "[DONE]"]
    rec = record({"prompt": "x", "stream": True, "verbose": True}, events, endpoint="/v1/completions")
    assert shape(build_plan(rec, piece)) == [
        ("Known", 1, EntryPlace(0, 0, 0)),
        ("Known", 4, EntryPlace(1, None, 0)),
        ("Known", 5, EntryPlace(2, None, 0)),
    ]


def test_an_entry_without_an_id_is_aligned_from_its_own_bytes_and_owns_that_entry():
    rec = record({"prompt": "x"}, {"content": "acd", "completion_probabilities": [
        entry(1, b"a"), entry(None, b"cd")]})
    plan = build_plan(rec, piece)
    assert shape(plan)[1] == ("Gap", b"cd", EntryPlace(None, 1, 1))
    assert entry_at(rec, plan[1].place)["bytes"] == list(b"cd")


def test_an_entry_with_neither_id_nor_text_is_refused():
    rec = record({"prompt": "x"}, {"content": "a", "completion_probabilities": [entry(None, b"")]})
    with pytest.raises(TranscriptError, match="neither a token id nor text"):
        build_plan(rec, piece)


def test_the_plan_is_immutable_and_leaves_the_record_as_read():
    response = {"content": "aé", "tokens": [1, 2, 3], "completion_probabilities": [entry(1, b"a")]}
    rec = record({"prompt": "x"}, response)
    before = copy.deepcopy(rec.container)
    plan = build_plan(rec, piece)
    assert rec.container == before
    assert isinstance(plan, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan[0].place.entry = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.request = {}
