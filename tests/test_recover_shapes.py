"""recover reads every file layout users keep, and writes the repaired file in that same layout.

All responses come from the real speculating b11434 server (SmolLM2 drafting
for itself), captured the way other tools capture them: request/response
pairs, chunk lists, raw SSE text, bare bodies with the request beside them,
OpenAI-SDK `model_dump_json()` dumps, and JSONL files of many records. None of
them carries prompt token ids, so every case also exercises rebuilding the
prompt (chat template / tokenizer) and its check against the server's count.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.run.recover import recover
from replay.llamacpp.http import post_json, post_sse
from replay.transcripts.entries import sent_entries
from replay.transcripts.readers import read_text

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

CHAT = {"messages": [{"role": "user", "content": "Name three fish."}], "logprobs": True, "top_logprobs": 3,
        "temperature": 1, "seed": 11, "max_tokens": 24, "cache_prompt": False}
CMPL = {"prompt": "Fish live in", "logprobs": 3, "temperature": 1, "seed": 11, "max_tokens": 24, "cache_prompt": False}
NATIVE = {"prompt": "Fish live in", "n_probs": 3, "temperature": 1, "seed": 11, "n_predict": 24, "cache_prompt": False}


def _sse(url, path, body):
    return list(post_sse(url, path, {**body, "stream": True}))


def _assert_recovered(res, n_records=1):
    assert len(res.records) == n_records
    for rep in res.records:
        c = rep.summary()["counts"]
        assert c["mismatch"] == 0 and c["unaligned"] == 0, rep.to_json()
        assert c["placeholder"] + c["missing"] > 0
        assert rep.recovered


def test_pair_with_json_body(self_draft_server, smollm2, tmp_path):
    resp = post_json(self_draft_server.url, "/v1/chat/completions", CHAT)
    p = tmp_path / "pair.json"
    p.write_text(json.dumps({"request": CHAT, "response": resp}, indent=2))
    res = recover(p, smollm2)
    _assert_recovered(res)
    fixed = json.loads(res.repaired)
    assert set(fixed) == {"request", "response"}
    probs = sent_entries("/v1/chat/completions", fixed["response"])
    assert probs and all(len(x.top) == 3 for x in probs)
    assert fixed["response"]["choices"][0]["message"] == resp["choices"][0]["message"]


def test_pair_with_chunk_list(self_draft_server, smollm2, tmp_path):
    events = [json.loads(e) if e != "[DONE]" else e for e in _sse(self_draft_server.url, "/v1/chat/completions", CHAT)]
    p = tmp_path / "pair.json"
    p.write_text(json.dumps({"request": {**CHAT, "stream": True}, "response": events}))
    res = recover(p, smollm2)
    _assert_recovered(res)
    fixed = json.loads(res.repaired)["response"]
    assert isinstance(fixed, list) and fixed[-1] == "[DONE]"
    texts = [c["choices"][0]["delta"].get("content") for c in fixed if isinstance(c, dict) and c.get("choices")]
    assert texts == [c["choices"][0]["delta"].get("content") for c in events if isinstance(c, dict) and c.get("choices")]
    recovered = sent_entries("/v1/chat/completions", events=[c for c in fixed if isinstance(c, dict)])
    assert len(recovered) >= res.records[0].summary()["tokens"] - 1


def test_pair_with_raw_sse_text(self_draft_server, smollm2, tmp_path):
    payloads = _sse(self_draft_server.url, "/v1/completions", CMPL)
    p = tmp_path / "pair.json"
    p.write_text(json.dumps({"request": {**CMPL, "stream": True},
                             "response": "".join(f"data: {x}\n\n" for x in payloads)}))
    res = recover(p, smollm2)
    _assert_recovered(res)
    assert json.loads(res.repaired)["response"].startswith("data: ")


def test_bare_body_with_request_file(self_draft_server, smollm2, tmp_path):
    resp = post_json(self_draft_server.url, "/completion", NATIVE)
    body, req, out = tmp_path / "resp.json", tmp_path / "req.json", tmp_path / "fixed.json"
    body.write_text(json.dumps(resp))
    req.write_text(json.dumps(NATIVE))
    r = CliRunner().invoke(main, ["recover", str(body), "--request", str(req), "-m", str(smollm2), "-o", str(out)])
    assert r.exit_code == 0, r.output
    fixed = json.loads(out.read_text())
    assert [e["id"] for e in fixed["completion_probabilities"]] == [e["id"] for e in resp["completion_probabilities"]]
    assert all(e["top_logprobs"] for e in fixed["completion_probabilities"])


def test_bare_sse_text_file_stays_sse(self_draft_server, smollm2, tmp_path):
    payloads = _sse(self_draft_server.url, "/v1/chat/completions", CHAT)
    sse = tmp_path / "stream.txt"
    sse.write_text("".join(f"data: {x}\n\n" for x in payloads))
    req, out = tmp_path / "req.json", tmp_path / "fixed.txt"
    req.write_text(json.dumps({**CHAT, "stream": True}))
    r = CliRunner().invoke(main, ["recover", str(sse), "--request", str(req), "-m", str(smollm2), "-o", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert text.startswith("data: ") and text.rstrip().endswith("data: [DONE]")
    recs = read_text(text, "fixed", request={**CHAT, "stream": True})
    assert sent_entries("/v1/chat/completions", events=recs[0].chunks())


def test_openai_sdk_dump(self_draft_server, smollm2, tmp_path):
    from openai.types.chat import ChatCompletion
    resp = post_json(self_draft_server.url, "/v1/chat/completions", CHAT)
    dump = ChatCompletion.model_validate(resp).model_dump_json(indent=2)
    p, req = tmp_path / "sdk.json", tmp_path / "req.json"
    p.write_text(dump)
    req.write_text(json.dumps(CHAT))
    res = recover(p, smollm2, request=CHAT)
    _assert_recovered(res)
    fixed = json.loads(res.repaired)
    assert set(fixed) == set(json.loads(dump))  # every SDK field kept, null ones included


def test_jsonl_of_many_records(self_draft_server, smollm2, tmp_path):
    lines = []
    for seed in (1, 2, 3):
        body = {**NATIVE, "seed": seed}
        lines.append(json.dumps({"request": body, "response": post_json(self_draft_server.url, "/completion", body)}))
    p, out, rep = tmp_path / "runs.jsonl", tmp_path / "fixed.jsonl", tmp_path / "report.json"
    p.write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(main, ["recover", str(p), "-m", str(smollm2), "-o", str(out), "--report", str(rep)])
    assert r.exit_code == 0, r.output
    fixed = [json.loads(l) for l in out.read_text().splitlines()]
    assert [f["request"]["seed"] for f in fixed] == [1, 2, 3]
    report = json.loads(rep.read_text())
    assert len(report["records"]) == 3
    tok = report["records"][0]["tokens"][1]
    assert set(tok) >= {"index", "id", "piece", "server_logprob", "true_logprob", "status", "true_top"}
    assert report["summary"]["counts"]["mismatch"] == 0
