"""Hostile and broken transcripts: a clean one-line error or a correct result, never a traceback.

Regression cases from a review of the readers and the token plan; all run on
the committed tiny fixture transcript, no server needed.
"""
from __future__ import annotations

import copy
import json

import pytest
from cli_helpers import clean_exit, run

from replay.errors import Exit
from replay.evaluation.walk import PieceIndex
from replay.llamacpp.models import tiny_target
from replay.paths import FIXTURES

BASE = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())


def recover_cli(tmp_path, obj_or_text, *extra):
    src = tmp_path / "t.json"
    src.write_text(obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text))
    out = tmp_path / "out.json"
    r = run("recover", src, "-m", tiny_target(), "-o", out, *extra)
    assert clean_exit(r), r.exception
    return r, out


def mutated(path, value):
    t = copy.deepcopy(BASE)
    *keys, last = path
    obj = t
    for k in keys:
        obj = obj[k]
    obj[last] = value
    return t


@pytest.mark.parametrize("path,value,expected", [
    (("response", "completion_probabilities", 1, "logprob"), 10**400, "is not a finite number"),
    (("response", "completion_probabilities", 1, "logprob"), "x", "is not a finite number"),
    (("response", "completion_probabilities", 1, "top_logprobs"), "x", "must be a list"),
    (("response", "completion_probabilities", 0, "top_logprobs", 0, "bytes"), [300], "byte values"),
    (("response", "completion_probabilities", 0, "top_logprobs", 0, "logprob"), "x", "not a finite number"),
    (("response", "tokens"), ["a"], "list of token ids"),
    (("response", "tokens"), [5, True], "list of token ids"),
    (("response", "tokens_evaluated"), "x", "non-negative integer"),
    (("response", "timings"), "x", "must be an object"),
    (("server",), "x", "\"server\" must be an object"),
    (("server", "props"), [], "must be the server's /props object"),
    (("request", "n_probs"), "x", '"n_probs" must be a number'),
    (("request", "seed"), 10**400, "is not a 32-bit seed"),
])
def test_wrong_types_are_one_line_errors(tmp_path, path, value, expected):
    r, out = recover_cli(tmp_path, mutated(path, value))
    assert r.exit_code == Exit.ERROR, r.output
    errors = [l for l in r.output.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1 and expected in errors[0] and "record 1" in errors[0], r.output
    assert not out.exists()


def test_infinite_logprob_is_rejected_not_written_as_Infinity(tmp_path):
    text = json.dumps(BASE).replace('"logprob": 0.0', '"logprob": -1e400', 1)
    r, out = recover_cli(tmp_path, text)
    assert r.exit_code == Exit.ERROR and "finite" in r.output and not out.exists()


def test_a_disagreeing_real_value_writes_nothing(tmp_path):
    t = mutated(("response", "completion_probabilities", 0, "logprob"), -0.5)  # the real first value, tampered
    r, out = recover_cli(tmp_path, t)
    assert r.exit_code == Exit.FAILED
    assert "disagree with the server's real values" in r.output and "nothing written" in r.output
    assert not out.exists()


def test_in_place_failure_keeps_the_original(tmp_path):
    t = mutated(("response", "completion_probabilities", 0, "logprob"), -0.5)
    src = tmp_path / "t.json"
    src.write_text(json.dumps(t))
    before = src.read_bytes()
    r = run(*["recover", str(src), "-m", str(tiny_target()), "--in-place"])
    assert r.exit_code == Exit.FAILED and src.read_bytes() == before


def test_in_place_through_a_symlink_repairs_the_target(tmp_path):
    real = tmp_path / "real.json"
    real.write_text(json.dumps(BASE))
    link = tmp_path / "link.json"
    link.symlink_to(real)
    r = run(*["recover", str(link), "-m", str(tiny_target()), "--in-place"])
    assert r.exit_code == 0, r.output
    assert link.is_symlink()
    fixed = json.loads(real.read_text())
    assert fixed["response"]["completion_probabilities"][1]["top_logprobs"]


def test_report_cannot_be_the_output(tmp_path):
    src = tmp_path / "t.json"
    src.write_text(json.dumps(BASE))
    r = run(*["recover", str(src), "-m", str(tiny_target()), "--in-place",
                                  "--report", str(src), "--force"])
    assert r.exit_code != 0 and json.loads(src.read_text()) == BASE


def test_pretty_json_syntax_error_names_its_line(tmp_path):
    text = json.dumps(BASE, indent=2).replace('"endpoint"', '"endpoint" "', 1)
    r, _ = recover_cli(tmp_path, text)
    assert r.exit_code == Exit.ERROR and "invalid JSON" in r.output and "line 1:" not in r.output


def test_deeply_nested_json(tmp_path):
    r, _ = recover_cli(tmp_path, "[" * 100000 + "]" * 100000)
    assert r.exit_code == Exit.ERROR and r.output.startswith("Error:")


def test_output_in_a_missing_parent_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    src = tmp_path / "t.json"
    src.write_text(json.dumps(BASE))
    r = run(*["recover", str(src), "-m", str(tiny_target()), "-o", str(tmp_path / "file" / "o.json")])
    assert r.exit_code == Exit.ERROR and "cannot write" in r.output and clean_exit(r)


def test_a_response_with_neither_probabilities_nor_ids(tmp_path):
    pair = {"request": {"prompt": "bcdbc", "seed": 1},
            "response": {"object": "text_completion", "choices": [{"text": "fbbbf", "finish_reason": "length"}]}}
    r, out = recover_cli(tmp_path, pair)
    assert r.exit_code == Exit.ERROR and "neither probabilities nor token ids" in r.output and not out.exists()


class FakePieces(PieceIndex):
    def __init__(self, pieces):
        self.pieces = pieces
        self.by_first = {}
        for t, b in enumerate(pieces):
            self.by_first.setdefault(b[0], []).append(t)


def test_alignment_never_strands_the_rest_of_a_gap():
    idx = FakePieces([b"ab", b"a", b"bc"])
    ok = idx.splittable(b"abc")
    assert ok[0] and not ok[2]  # after "ab", "c" cannot be completed
    assert [t for t in idx.candidates(b"abc") if ok[len(idx.pieces[t])]] == [1]


@pytest.mark.parametrize("command", ["recover", "diff", "trace"])
@pytest.mark.parametrize("content,expected", [("{bad", "invalid JSON"), (None, "cannot read"),
                                              ("[1]", "must be a JSON object")])
def test_a_bad_request_file_is_one_line(tmp_path, command, content, expected):
    req = tmp_path / "request.json"
    if content is not None:
        req.write_text(content)
    args = [command, str(FIXTURES / "transcripts" / "tiny-draft-simple.json"), "-m", str(tiny_target()),
            "--request", str(req)] + (["-o", str(tmp_path / "out.json")] if command == "recover" else [])
    r = run(*args)
    assert r.exit_code != 0 and r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert clean_exit(r), r.exception
    assert expected in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("cache_n", [-3, True, "5", 10**12])
def test_a_nonsense_cache_count_never_keeps_stale_cells(tmp_path, cache_n):
    t = mutated(("response", "timings"), {**BASE["response"].get("timings", {}), "cache_n": cache_n})
    r, out = recover_cli(tmp_path, t)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    if r.exit_code == 0:  # ignored (not a count) or too large to rebuild: a fresh evaluation
        assert json.loads(out.read_text())["response"]["completion_probabilities"][1]["logprob"] < 0
    else:
        assert r.output.strip().splitlines()[-1].startswith("Error: ")
