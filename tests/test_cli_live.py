"""`spec-replay check` and `record` against real servers, and their failure modes.

check: exit 1 on the speculating server (placeholders), 0 on the plain one,
and it names the /props vs /slots contradiction. record: every bad input is a
one-line error with a non-zero exit, and nothing of the user's is lost.
"""
from __future__ import annotations

import http.server
import json
import threading

import pytest
from cli_helpers import one_error, run

from replay.errors import Exit
from replay.llamacpp.process import free_port

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "logprobs": True, "top_logprobs": 2,
        "temperature": 0, "seed": 3, "max_tokens": 8}


# -- check ------------------------------------------------------------------

@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_check_finds_placeholders_on_the_speculating_server(self_draft_server):
    r = run("check", self_draft_server.url, "--json")
    assert r.exit_code == Exit.FAILED, r.output
    report = json.loads(r.stdout)
    assert report["contradiction"] is True
    assert report["props_speculative"] == "none" and report["slots_speculative"] == [True]
    assert report["draft_n"] > 0
    assert not report["tokens"][0]["placeholder"]
    assert all(t["placeholder"] for t in report["tokens"][1:])


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_check_passes_the_plain_server(plain_server):
    r = run("check", plain_server.url)
    assert r.exit_code == 0, r.output
    assert "all 48 tokens carry real probabilities" in r.output
    assert "warning" not in r.output


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_check_table_names_the_contradiction(self_draft_server):
    r = run("check", self_draft_server.url)
    assert r.exit_code == Exit.FAILED
    assert "warning: /props says speculation is off but /slots says it is on" in r.stderr  # warnings: stderr
    assert "warning" not in r.stdout and "PLACEHOLDER" in r.stdout


def test_check_unreachable_is_cannot_tell():
    r = run("check", f"http://127.0.0.1:{free_port()}")
    assert r.exit_code == Exit.ERROR
    assert "cannot reach" in r.output


# -- record -----------------------------------------------------------------

@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_record_writes_a_transcript(self_draft_server, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(CHAT))
    out = tmp_path / "t.json"
    r = run("record", self_draft_server.url, "--request", req, "-o", out, "--spec-type", "draft-simple",
            "-md", "draft.gguf")
    assert r.exit_code == 0, r.output
    t = json.loads(out.read_text())
    assert t["format"] == "spec-replay-transcript" and t["version"] == 1
    assert t["server"]["flags"]["--spec-type"] == ["draft-simple"]
    assert t["server"]["slots"][0]["speculative"] is True
    assert t["response"]["choices"][0]["logprobs"]["content"]
    # the model's identity, for recover to compare with -m (reading/identity.py)
    from replay.runtime.llama import Model
    m = Model(self_draft_server.config.model)
    assert (t["server"]["models_meta"]["size"], t["server"]["models_meta"]["n_params"]) == (m.size_bytes(), m.n_params())
    assert m.desc().endswith(t["server"]["props"]["model_ftype"])


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_record_refuses_to_overwrite(self_draft_server, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(CHAT))
    out = tmp_path / "t.json"
    out.write_text("precious")
    r = run("record", self_draft_server.url, "--request", req, "-o", out)
    assert r.exit_code != 0
    assert "exists; use --force" in one_error(r)
    assert out.read_text() == "precious"


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_record_refuses_a_request_without_seed(self_draft_server, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps({k: v for k, v in CHAT.items() if k != "seed"}))
    out = tmp_path / "t.json"
    r = run("record", self_draft_server.url, "--request", req, "-o", out)
    assert r.exit_code != 0
    assert "no fixed seed" in one_error(r)
    assert not out.exists()


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_record_jsonl_reports_a_bad_line_and_keeps_going(self_draft_server, tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps(CHAT) + "\n{not json\n" + json.dumps({**CHAT, "seed": 4}) + "\n")
    out = tmp_path / "runs.jsonl"
    r = run("record", self_draft_server.url, "--requests", reqs, "-o", out)
    assert r.exit_code == Exit.ERROR
    assert "line 2: invalid JSON" in one_error(r)
    lines = out.read_text().splitlines()
    assert [json.loads(l)["request"]["seed"] for l in lines] == [3, 4]


def test_record_unreachable_url(tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(CHAT))
    r = run("record", f"http://127.0.0.1:{free_port()}", "--request", req, "-o", tmp_path / "t.json")
    assert r.exit_code != 0
    assert "cannot reach" in one_error(r)
    assert not (tmp_path / "t.json").exists()


@pytest.fixture
def not_llama_server(tmp_path):
    """A plain static HTTP server: answers, but is not llama.cpp."""
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_record_non_llama_server(not_llama_server, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(CHAT))
    r = run("record", not_llama_server, "--request", req, "-o", tmp_path / "t.json")
    assert r.exit_code != 0
    assert "is not a llama.cpp server" in one_error(r)


def test_check_non_llama_server(not_llama_server):
    r = run("check", not_llama_server)
    assert r.exit_code == Exit.ERROR
    assert "is not a llama.cpp server" in r.output
