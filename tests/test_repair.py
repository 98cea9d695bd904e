"""The repair pass (report/repair.py): true values written where the server should have put them,
in its own field format, in a copy: the record as read is never changed.

Pieces: 1 = "a", 2 = "b", 3 = "c".
"""
from __future__ import annotations

import copy
import json

from replay.comparison.values import TokenReport
from replay.evaluation.walk import Truth
from replay.numerics.floats import widened as f32
from replay.report.repair import Outcome, repair_record, serialise
from replay.transcripts.plan import EntryPlace, Known
from replay.transcripts.readers import read_text

PIECES = {1: b"a", 2: b"b", 3: b"c"}
piece = PIECES.__getitem__


def outcome(tid: int, place: EntryPlace, status: str, logprob: float, owns: bool = True) -> Outcome:
    t = Truth(index=0, id=tid, item=Known(tid, place), logprob=logprob, top=[(tid, logprob), (3, -2.5)])
    return Outcome(t, place, owns and place.entry is not None, TokenReport(0, tid, "", None, logprob, status, []))


def test_placeholders_are_filled_and_missing_tokens_inserted_in_order_in_a_copy():
    placeholder = {"id": 2, "token": "b", "bytes": [98], "logprob": 0.0, "top_logprobs": []}
    real = {"id": 1, "token": "a", "bytes": [97], "logprob": -0.25, "top_logprobs": [{"id": 1, "logprob": -0.25}]}
    pair = {"request": {"prompt": "x"}, "response": {"content": "abac", "tokens": [1, 2, 1, 3],
                                                      "completion_probabilities": [real, placeholder]}}
    rec = read_text(json.dumps(pair), "t.json")[0]
    before = copy.deepcopy(rec.container)
    out = repair_record(rec, [
        outcome(1, EntryPlace(None, 0, 0), "ok", -0.25),
        outcome(2, EntryPlace(None, 1, 1), "placeholder", -1.1),
        outcome(1, EntryPlace(None, None, 2), "missing", -0.7),
        outcome(3, EntryPlace(None, None, 2), "missing", -0.3),
    ], post=False, piece=piece)
    assert rec.container == before  # the input is untouched
    entries = out["response"]["completion_probabilities"]
    assert [e["id"] for e in entries] == [1, 2, 1, 3]
    assert entries[0] == real  # real values stay exactly as sent
    assert entries[1]["logprob"] == f32(-1.1) == -1.100000023841858
    assert entries[1]["top_logprobs"] == [{"id": 2, "token": "b", "bytes": [98], "logprob": f32(-1.1)},
                                          {"id": 3, "token": "c", "bytes": [99], "logprob": -2.5}]
    assert entries[2]["token"] == "a" and entries[3]["logprob"] == f32(-0.3)
    assert list(out) == list(pair) and out["request"] is rec.request  # untouched parts are shared, not copied


def test_a_stream_chunk_without_probabilities_gets_a_list_where_the_server_would_put_it():
    events = [{"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None}], "object": "chat.completion.chunk"},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "object": "chat.completion.chunk"},
              "[DONE]"]
    rec = read_text(json.dumps({"request": {"messages": [], "stream": True}, "response": events}), "t.json")[0]
    out = repair_record(rec, [outcome(1, EntryPlace(0, None, 0), "missing", -0.5)], post=False, piece=piece)
    assert events[0]["choices"][0]["logprobs"] is None and rec.events[0]["choices"][0]["logprobs"] is None
    assert out["response"][0]["choices"][0]["logprobs"]["content"][0]["id"] == 1
    assert out["response"][2] == "[DONE]"


def test_entries_the_server_trims_by_design_stay_trimmed():
    pair = {"request": {"prompt": "x"}, "response": {"content": "a", "tokens": [1, 2],
                                                      "completion_probabilities": [
                                                          {"id": 1, "logprob": -0.1, "top_logprobs": []}]}}
    rec = read_text(json.dumps(pair), "t.json")[0]
    trimmed = EntryPlace(write=False, reason="the stop word's entries are trimmed by the server")
    out = repair_record(rec, [outcome(2, trimmed, "missing", -0.4)], post=False, piece=piece)
    assert out == pair


def test_post_sampling_entries_carry_prob_and_top_probs():
    pair = {"request": {"prompt": "x", "post_sampling_probs": True},
            "response": {"content": "a", "completion_probabilities": [
                {"id": 1, "token": "a", "bytes": [97], "prob": 1.0, "top_probs": []}]}}
    rec = read_text(json.dumps(pair), "t.json")[0]
    t = Truth(index=0, id=1, item=Known(1, EntryPlace(None, 0, 0)), logprob=-0.9, top=[], post_prob=0.4,
              post_top=[(1, 0.4), (2, 0.35)])
    o = Outcome(t, EntryPlace(None, 0, 0), True, TokenReport(0, 1, "a", 0.0, -0.9, "placeholder", []))
    e = repair_record(rec, [o], post=True, piece=piece)["response"]["completion_probabilities"][0]
    assert e["prob"] == f32(0.4) and [x["id"] for x in e["top_probs"]] == [1, 2] and "logprob" not in e


def test_serialise_keeps_the_files_shape():
    pair = {"request": {"prompt": "x"}, "response": {"content": "", "completion_probabilities": []}}
    pretty = json.dumps(pair, indent=2)
    rec = read_text(pretty, "t.json")[0]
    assert serialise([rec], [pair], pretty) == json.dumps(pair, indent=2, ensure_ascii=False) + "\n"
    two = json.dumps(pair) + "\n" + json.dumps(pair) + "\n"
    recs = read_text(two, "t.jsonl")
    assert serialise(recs, [pair, pair], two).count("\n") == 2


def test_an_entrys_text_is_what_the_server_writes_for_its_piece():
    """The server cuts a piece to its whole characters (validate_utf8) and writes any invalid byte left as
    U+FFFD (nlohmann's dump): b"a\\xff" is "a\\ufffd" and a cut-off "é" is "" (test_stop_strings.py checks
    the rule against the server's own code)."""
    pieces = {1: b"a\xff", 2: "é".encode()[:1], 3: b"c"}
    pair = {"request": {"prompt": "x"}, "response": {"content": "?", "tokens": [1, 2],
                                                      "completion_probabilities": [
                                                          {"id": 1, "token": "a\ufffd", "bytes": [97, 255],
                                                           "logprob": 0.0, "top_logprobs": []}]}}
    rec = read_text(json.dumps(pair), "t.json")[0]
    out = repair_record(rec, [outcome(1, EntryPlace(None, 0, 0), "placeholder", -0.5),
                              outcome(2, EntryPlace(None, None, 1), "missing", -0.2)],
                        post=False, piece=pieces.__getitem__)
    entries = out["response"]["completion_probabilities"]
    assert [e["token"] for e in entries] == ["a\ufffd", ""]
    assert [e["bytes"] for e in entries] == [[97, 255], [0xC3]]
    assert entries[0]["top_logprobs"][0]["token"] == "a\ufffd" and entries[0]["top_logprobs"][1]["token"] == "c"
