"""The committed transcripts (fixtures/transcripts/, recorded from a speculating b11434 server on the
tiny fixtures by fixtures/record_transcripts.py): every endpoint, stream and not, pre- and
post-sampling. No server, build or download is needed here.

* recover repairs each to exactly the bytes of its `repaired/` twin (the output of the code before
  the architecture pass: behaviour is kept byte for byte), but for the last bits of values the CPU
  kernels of another machine class compute (cli_helpers.same_repair), and never touches the input;
* trace reproduces each token for token, with the server's draft totals;
* the errors a user can meet on them are one line (another model, a diverging transcript).

That the repaired values are the unspeculated server's is proven live in test_recover_live.py.
"""
from __future__ import annotations

import hashlib
import json

import pytest
from cli_helpers import clean_exit, one_error, run, same_repair

from replay.errors import Exit
from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES
from replay.transcripts.readers import read_file

TRANSCRIPTS = sorted(p.name for p in (FIXTURES / "transcripts").glob("*.json"))


def test_there_is_a_transcript_for_every_endpoint_stream_and_not():
    kinds = set()
    for name in TRANSCRIPTS:
        t = json.loads((FIXTURES / "transcripts" / name).read_text())
        kinds.add((t["endpoint"], t["stream"]))
    assert kinds == {(e, s) for e in ("/completion", "/v1/completions", "/v1/chat/completions") for s in (False, True)}


@pytest.mark.parametrize("name", TRANSCRIPTS)
def test_recover_repairs_each_to_its_committed_twin(tmp_path, name):
    src = FIXTURES / "transcripts" / name
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = tmp_path / name
    r = run("recover", src, "-m", tiny_target(), "-o", out, "--report", tmp_path / "report.json")
    assert r.exit_code == 0, r.output
    assert same_repair(out.read_text(), (FIXTURES / "transcripts" / "repaired" / name).read_text()) is None
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest
    report = json.loads((tmp_path / "report.json").read_text())["records"][0]
    assert report["tokens"][0]["status"] == "ok"  # sampled outside the loop: real, and it agrees
    assert {t["status"] for t in report["tokens"]} <= {"ok", "placeholder", "missing"}
    counts = report["summary"]["counts"]
    assert counts["placeholder"] + counts["missing"] >= len(report["tokens"]) - 2  # all but tokens outside the loop


def test_every_committed_transcript_is_in_the_current_format():
    """server.flags, spelled as llama-server spells them; the legacy server.speculative block only in
    fixtures/transcripts/legacy/, for the reader that still understands it."""
    for folder in ("", "repaired"):
        for p in sorted((FIXTURES / "transcripts" / folder).glob("*.json")):
            server = json.loads(p.read_text())["server"]
            assert "speculative" not in server and "--spec-draft-model" in server["flags"], p


def test_a_legacy_speculative_block_reads_as_the_flags_it_became_and_recovers_the_same(tmp_path):
    legacy = FIXTURES / "transcripts" / "legacy" / "tiny-draft-simple.json"
    current = FIXTURES / "transcripts" / "tiny-draft-simple.json"
    assert "speculative" in json.loads(legacy.read_text())["server"]
    assert read_file(legacy)[0].flags == read_file(current)[0].flags
    r = run("trace", legacy, "-m", tiny_target())  # each value says the block it came from
    assert r.exit_code == 0 and "--spec-type draft-simple (server.speculative)" in r.stdout
    out = tmp_path / "legacy.fixed.json"
    assert run("recover", legacy, "-m", tiny_target(), "-o", out).exit_code == 0
    got, twin = json.loads(out.read_text()), json.loads((FIXTURES / "transcripts" / "repaired" / current.name).read_text())
    assert got["response"] == twin["response"]


@pytest.mark.parametrize("command,extra", [("trace", ()), ("tune", ("--vary", "--spec-draft-n-max=2,4"))])
def test_a_copied_transcript_finds_its_draft_next_to_the_target_from_any_directory(tmp_path, monkeypatch, command,
                                                                                  extra):
    """The transcript names its draft as the server was given it (fixtures/tiny-draft.gguf, relative to where
    the server ran); copied elsewhere and run from there, the file of that name next to -m is the draft, and
    the settings line says where it was found. A draft found nowhere asks for -md."""
    copy = tmp_path / "t.json"
    copy.write_bytes((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_bytes())
    monkeypatch.chdir(tmp_path)
    r = run(command, copy, "-m", tiny_target(), *extra)
    assert r.exit_code == 0, r.output[-2000:]
    if command == "trace":
        assert "(server.flags: fixtures/tiny-draft.gguf, found next to -m)" in r.stdout
        assert "reproduced: all 20 tokens and the draft totals match the transcript" in r.stdout
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "target.gguf").write_bytes(tiny_target().read_bytes())
    r = run(command, copy, "-m", lone / "target.gguf", "--renamed-model", *extra)
    assert "give the draft model file with -md PATH" in one_error(r)


# streams of the OpenAI endpoints send the text of speculative tokens without their ids
TEXT_ONLY = ("tiny-v1-completions-stream.json", "tiny-v1-chat-stream.json", "tiny-v1-chat-stream-post.json")


@pytest.mark.parametrize("name", TRANSCRIPTS)
def test_trace_reproduces_each(name):
    r = run("trace", FIXTURES / "transcripts" / name, "-m", tiny_target(), "-md", tiny_draft(), "--json")
    assert r.exit_code == 0, r.output[-2000:]
    res = json.loads(r.stdout)
    assert res["reproduced"] is True and res["first_divergence"] is None
    assert res["compared"] == ("text" if name in TEXT_ONLY else "token ids")
    assert res["draft_n"] == res["server_draft_n"] > 0


def test_a_stream_is_compared_chunk_by_chunk(tmp_path):
    """Two chunks' texts swapped: the same text in the end, but not chunk for chunk."""
    t = json.loads((FIXTURES / "transcripts" / "tiny-v1-chat-stream.json").read_text())
    events = [json.loads(e) if e != "[DONE]" else e for e in t["events"]]
    texts = [k for k, e in enumerate(events) if isinstance(e, dict) and e.get("choices")
             and (e["choices"][0].get("delta") or {}).get("content")]
    a, b = texts[3], texts[4]
    da, db = events[a]["choices"][0]["delta"], events[b]["choices"][0]["delta"]
    assert da["content"] != db["content"]
    da["content"], db["content"] = db["content"], da["content"]
    t["events"] = [json.dumps(e) if isinstance(e, dict) else e for e in events]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    res = json.loads(run("trace", p, "-m", tiny_target(), "-md", tiny_draft(), "--json").stdout)
    assert res["reproduced"] is False and res["compared"] == "text" and res["first_divergence"] == 3


def test_the_python_api_returns_what_the_command_writes():
    import replay
    src = FIXTURES / "transcripts" / "tiny-draft-simple.json"
    res = replay.recover(src, model=tiny_target())
    assert res.ok and res.failure() is None
    assert same_repair(res.repaired, (FIXTURES / "transcripts" / "repaired" / "tiny-draft-simple.json").read_text()) is None
    assert res.summary()["counts"]["placeholder"] == len(res.records[0].tokens) - 1


def test_first_divergence_shows_both_sides(tmp_path):
    """A transcript whose first token is not what the seed gives: the divergence is flagged at 0,
    with the trace's candidates and the server's own top list, and the exit code is 1."""
    t = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    first = t["response"]["completion_probabilities"][0]
    other = next(x["id"] for x in first["top_logprobs"] if x["id"] != first["id"])
    t["response"]["tokens"][0] = other
    first["id"] = other
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    args = ["trace", p, "-m", tiny_target(), "-md", tiny_draft()]
    r = run(*args)
    assert r.exit_code == Exit.FAILED and clean_exit(r)
    assert "first divergence at token 0" in r.output
    assert "trace candidates" in r.output and "server candidates (logprob)" in r.output
    res = json.loads(run(*args, "--json").stdout)
    assert res["reproduced"] is False and res["first_divergence"] == 0
    assert len(res["server_candidates_at_divergence"]) == 3


def test_steps_range_limits_the_table():
    p = FIXTURES / "transcripts" / "tiny-draft-simple.json"
    r = run("trace", p, "-m", tiny_target(), "-md", tiny_draft(), "--steps", "1:3")
    assert r.exit_code == 0, r.output
    table = r.stdout.split("\n\n")[0].splitlines()[2:]
    assert [int(line.split()[0]) for line in table] == [1, 2]
    assert "reproduced: all 20 tokens" in r.output


def test_trace_takes_the_flags_from_the_transcript_unless_given():
    p = FIXTURES / "transcripts" / "tiny-draft-simple.json"
    r = run("trace", p, "-m", tiny_target(), "-md", tiny_draft(), "--spec-draft-n-max", "1", "--json")
    res = json.loads(r.stdout)
    assert max(len(s["draft"]) for s in res["steps"]) == 1  # the flag won over the server's default of 3
    assert res["reproduced"] is False  # so this is not what the server did


def test_trace_of_a_transcript_from_another_model(tmp_path):
    """A token id outside the model's vocabulary: a one-line error, not libllama's abort."""
    t = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    t["response"]["tokens"][1] = 9690  # a SmolLM2 id
    t["response"]["completion_probabilities"][1]["id"] = 9690
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    msg = one_error(run("trace", p, "-m", tiny_target(), "-md", tiny_draft()))
    assert "another model" in msg and f"{p}, record 1" in msg


@pytest.mark.parametrize("types,extra,expected", [
    (["draft-eagle3"], [], "draft-eagle3 cannot be replayed"),
    (["draft-simple"], [], "needs the draft model"),
])
def test_unreplayable_transcripts_say_what_is_missing(tmp_path, types, extra, expected):
    t = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    t["server"]["flags"]["--spec-type"] = types
    del t["server"]["flags"]["--spec-draft-model"]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    assert expected in one_error(run("trace", p, "-m", tiny_target(), *extra))


def test_a_request_without_a_fixed_seed_cannot_be_traced(tmp_path):
    t = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    t["request"]["seed"] = -1
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    assert one_error(run("trace", p, "-m", tiny_target(), "-md", tiny_draft())) == (
        f"Error: {p}, record 1: the request has no fixed seed (seed -1): the server drew a random one, so the run "
        'cannot be reproduced; record with an explicit "seed"')


def test_a_transcript_without_its_speculative_type_is_traced_without_drafting_and_says_so(tmp_path):
    t = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    t["server"]["flags"]["--spec-type"] = []
    del t["response"]["generation_settings"]["speculative.types"]  # /completion echoes them too
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    r = run("trace", p, "-m", tiny_target(), "--json")
    res = json.loads(r.stdout)
    assert r.exit_code == Exit.FAILED and res["first_divergence"] is None  # sample-and-match emits the plain tokens
    assert res["draft_n"] == 0 and res["server_draft_n"] == 36
    assert any("pass its --spec-type" in n for n in res["notes"])
