"""Bad input to recover/diff: one `Error:` line naming the file and record, non-zero exit, nothing written."""
from __future__ import annotations

import json

import pytest
from cli_helpers import one_error, run

from replay.commands.record import RequestItem, record_one
from replay.errors import Exit
from replay.llamacpp.models import tiny_target
from replay.llamacpp.process import ServerConfig
from replay.transcripts.format import dumps


@pytest.fixture(scope="module")
def smol_transcripts(module_server, smollm2, tmp_path_factory):
    """A real non-stream and stream transcript of SmolLM2."""
    plain_server = module_server(ServerConfig(smollm2))
    d = tmp_path_factory.mktemp("smol")
    out = {}
    for stream in (False, True):
        body = {"prompt": "The sea is", "n_predict": 12, "n_probs": 2, "temperature": 1, "seed": 2, "stream": stream}
        t = record_one(plain_server.url, RequestItem("/completion", body), {})
        p = d / f"{'stream' if stream else 'json'}.json"
        p.write_text(dumps(t))
        out[stream] = p
    return out


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_transcript_from_another_model(smol_transcripts, tmp_path):
    out = tmp_path / "fixed.json"
    r = run("recover", smol_transcripts[False], "-m", tiny_target(), "-o", out)
    assert r.exit_code == Exit.ERROR
    msg = one_error(r)
    assert f"{smol_transcripts[False]}, record 1" in msg and "-m is tiny-target.gguf" in msg  # by name first
    r = run("recover", smol_transcripts[False], "-m", tiny_target(), "-o", out, "--renamed-model")
    assert r.exit_code == Exit.ERROR
    msg = one_error(r)  # renamed, a file keeps its type
    assert f"{smol_transcripts[False]}, record 1: the server loaded a Q4_1 model (/props model_ftype)" in msg
    assert not out.exists()


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_prompt_longer_than_the_context(smol_transcripts, smollm2, tmp_path):
    out = tmp_path / "fixed.json"
    r = run("recover", smol_transcripts[False], "-m", smollm2, "-o", out, "-c", "3")
    assert r.exit_code == Exit.ERROR
    assert "record 1" in one_error(r) and "context holds" in one_error(r)
    assert not out.exists()


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_truncated_stream(smol_transcripts, smollm2, tmp_path):
    t = json.loads(smol_transcripts[True].read_text())
    t["events"] = t["events"][:-2]
    bad = tmp_path / "truncated.json"
    bad.write_text(json.dumps(t))
    out = tmp_path / "fixed.json"
    r = run("recover", bad, "-m", smollm2, "-o", out)
    assert r.exit_code == Exit.ERROR
    assert "record 1: the stream is truncated" in one_error(r)
    assert not out.exists()


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_output_exists_is_not_overwritten(smol_transcripts, smollm2, tmp_path):
    out = tmp_path / "fixed.json"
    out.write_text("precious")
    r = run("recover", smol_transcripts[False], "-m", smollm2, "-o", out)
    assert r.exit_code == Exit.ERROR and "exists; use --force" in one_error(r)
    assert out.read_text() == "precious"


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_in_place_replaces_the_input_atomically(smol_transcripts, smollm2, tmp_path):
    p = tmp_path / "t.json"
    p.write_text(smol_transcripts[True].read_text())
    r = run("recover", p, "-m", smollm2, "--in-place")
    assert r.exit_code == 0, r.output
    t = json.loads(p.read_text())
    assert t["format"] == "spec-replay-transcript" and t["stream"] is True


@pytest.mark.parametrize("content,expected", [
    ("{not json", "invalid JSON"),
    ("", "the file is empty"),
    ('{"hello": 1}', "unknown shape"),
    ('{"choices": [{"text": "x"}], "object": "text_completion"}', "a bare response: give the request"),
    ('{"request": {"prompt": "a"}, "response": {"object": "text_completion", "choices": []}}', "no choices"),
    ('{"request": {"prompt": "a"}, "response": {"content": "x", "completion_probabilities": [{"id": -4, "logprob": 0}]}}',
     "token id -4"),
    ('{"request": {"prompt": "a"}, "response": {"content": "x", "completion_probabilities": [{"id": 1, "logprob": NaN}]}}',
     "invalid JSON"),
    ('data: {"content": "a", "stop": false}\n\n', "a bare response: give the request"),
    ('{"format": "spec-replay-transcript", "version": 99}', "version 99 is not supported"),
])
def test_unreadable_transcripts(tmp_path, content, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    out = tmp_path / "out.json"
    r = run("recover", bad, "-m", tiny_target(), "-o", out)
    assert r.exit_code == Exit.ERROR
    msg = one_error(r)
    assert str(bad) in msg and expected in msg, msg
    assert not out.exists()


def test_missing_model_file(tmp_path):
    t = tmp_path / "t.json"
    t.write_text("{}")
    r = run("diff", t, "-m", tmp_path / "nope.gguf")
    assert r.exit_code == Exit.ERROR and one_error(r) == f"Error: a model file not found: {tmp_path / 'nope.gguf'}"


def test_not_a_gguf(tmp_path):
    t = tmp_path / "t.json"
    t.write_text("{}")
    m = tmp_path / "model.gguf"
    m.write_bytes(b"PK\x03\x04" + b"\0" * 2000)
    r = run("diff", t, "-m", m)
    assert r.exit_code == Exit.ERROR and one_error(r) == f"Error: {m} is not a GGUF file (magic b'PK\\x03\\x04')"


def test_truncated_gguf(tmp_path):
    t = tmp_path / "t.json"
    t.write_text("{}")
    m = tmp_path / "model.gguf"
    m.write_bytes(tiny_target().read_bytes()[:300])
    r = run("diff", t, "-m", m)
    assert r.exit_code == Exit.ERROR and one_error(r) == (f"Error: {m} is truncated or corrupt: the header runs past "
                                                          "the end of the file")


def test_a_model_that_fails_to_load_closes_quietly(tmp_path):
    """A failed Model() used to print `Exception ignored in _Owner.__del__` with a traceback (it had no
    _contexts yet): the one-line error is all the user sees."""
    import subprocess
    import sys
    code = ("import gc\nfrom replay.errors import SpecReplayError\nfrom replay.runtime.llama import Model\n"
            f"try:\n    Model({str(tmp_path / 'nope.gguf')!r})\nexcept SpecReplayError as e:\n    print(e)\ngc.collect()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "not found" in p.stdout, p.stdout + p.stderr
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr
