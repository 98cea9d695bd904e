"""`spec-replay proxy` in front of a server that answers as a recorded one did (replay/proxy/):

- a request that asks for probabilities gets the server's response with every placeholder replaced by the
  value recover computes, equal to the committed repaired transcript, in the same schema and field order,
  with a header counting the values filled; streamed or not;
- the fields the proxy added upstream (return_tokens, verbose) are not in what the client gets;
- a request that asks for none, and every other endpoint, passes through byte for byte;
- malformed JSON is a 400 in llama-server's error shape; an upstream error passes through as it came.

The upstream here is the recorded server: it answers each endpoint with what the real b11434 server
answered when the committed transcript was recorded (fixtures/transcripts/). Live servers are
tests/test_proxy_live.py's.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from replay.paths import FIXTURES
from replay.proxy.app import FILLED_HEADER, Proxy, Settings
from replay.proxy.exchange import client_object
from replay.proxy.filler import Filler

pytestmark = pytest.mark.processes

TRANSCRIPTS = FIXTURES / "transcripts"


def recorded_server(t: dict) -> web.Application:
    """An upstream that answers as the server the transcript was recorded from."""
    app = web.Application()
    server = t["server"]

    async def props(_):
        return web.json_response(server["props"])

    async def slots(_):
        return web.json_response(server.get("slots") or [])

    async def models(_):
        return web.json_response({"data": [{"id": "m", "meta": server.get("models_meta") or {}}]})

    async def tokenize(_):
        return web.json_response({"tokens": t["prompt_tokens"]})

    async def template(_):
        return web.json_response({"prompt": "<the chat template's text>"})

    async def generate(request):
        await request.read()
        if t["stream"]:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for e in t["events"]:
                await out.write(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode())
            await out.write_eof()
            return out
        return web.json_response(t["response"])

    async def health(_):
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    app.router.add_get("/props", props)
    app.router.add_get("/slots", slots)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/apply-template", template)
    app.router.add_post(t["endpoint"], generate)
    return app


async def _through_proxy(t: dict, body: dict, *, path: str | None = None, raw: bytes | None = None):
    upstream = TestServer(recorded_server(t))
    await upstream.start_server()
    proxy = Proxy(Settings(str(upstream.make_url("")), flags=t["server"].get("flags") or {}),
                  Filler(FIXTURES / "tiny-target.gguf"))
    front = TestServer(proxy.app())
    await front.start_server()
    try:
        async with ClientSession() as s:
            async with s.post(front.make_url(path or t["endpoint"]), data=raw if raw is not None else json.dumps(body),
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, dict(r.headers), await r.read()
    finally:
        await front.close()
        await upstream.close()


def client_body(t: dict) -> dict:
    """The request as the client sent it: the transcript's, without what `record` added."""
    return {k: v for k, v in t["request"].items() if k not in t["added_fields"] or k == "cache_prompt"}


def sse_payloads(raw: bytes) -> list[str]:
    return [line[len("data: "):] for line in raw.decode().split("\n\n") if line.startswith("data: ")]


@pytest.mark.parametrize("name", ["tiny-v1-chat.json", "tiny-v1-completions.json", "tiny-draft-simple.json"])
def test_a_response_with_placeholders_comes_back_with_the_values_recover_computes(name):
    t = json.loads((TRANSCRIPTS / name).read_text())
    repaired = json.loads((TRANSCRIPTS / "repaired" / name).read_text())
    status, headers, raw = asyncio.run(_through_proxy(t, client_body(t)))
    assert status == 200, raw
    got = json.loads(raw)
    added = ("return_tokens",) + (("verbose",) if t["endpoint"] != "/completion" else ())
    assert got == client_object(repaired["response"], added)
    assert list(got) == list(repaired["response"])  # the server's field order
    assert "__verbose" not in got and got.get("tokens", []) == []
    assert int(headers[FILLED_HEADER]) > 0


@pytest.mark.parametrize("name", ["tiny-completion-stream.json", "tiny-v1-chat-stream.json"])
def test_a_stream_comes_back_as_a_stream_with_the_values_filled(name):
    t = json.loads((TRANSCRIPTS / name).read_text())
    repaired = json.loads((TRANSCRIPTS / "repaired" / name).read_text())
    status, headers, raw = asyncio.run(_through_proxy(t, client_body(t)))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    got = sse_payloads(raw)
    want = [e if isinstance(e, str) else json.dumps(e) for e in repaired["events"]]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w == "[DONE]":
            assert g == w
        else:
            added = ("return_tokens", "verbose")
            assert json.loads(g) == client_object(json.loads(w), added)
    assert int(headers[FILLED_HEADER]) > 0


def test_a_request_that_asks_for_no_probabilities_passes_through_byte_for_byte():
    t = json.loads((TRANSCRIPTS / "tiny-v1-chat.json").read_text())
    body = {k: v for k, v in client_body(t).items() if k not in ("logprobs", "top_logprobs")}
    status, headers, raw = asyncio.run(_through_proxy(t, body))
    assert status == 200 and FILLED_HEADER not in headers
    assert json.loads(raw) == t["response"]  # as the upstream sent it: nothing added, nothing taken


def test_malformed_json_is_a_400_in_llama_servers_error_shape():
    t = json.loads((TRANSCRIPTS / "tiny-v1-chat.json").read_text())
    status, _, raw = asyncio.run(_through_proxy(t, {}, raw=b'{"messages": ['))
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and "invalid JSON" in err["message"]


def test_an_unknown_endpoint_gets_the_upstreams_own_answer():
    t = json.loads((TRANSCRIPTS / "tiny-v1-chat.json").read_text())
    status, _, _ = asyncio.run(_through_proxy(t, {}, path="/no-such-endpoint"))
    assert status == 404  # what the upstream said


def test_an_upstream_error_passes_through_as_it_came_and_an_unreachable_upstream_is_a_502():
    t = json.loads((TRANSCRIPTS / "tiny-v1-chat.json").read_text())
    refusal = b'{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}}'

    async def run():
        app = recorded_server(t)

        async def refuse(request):
            await request.read()
            return web.Response(status=400, body=refusal, content_type="application/json")
        app.router.add_post("/v1/completions", refuse)
        upstream = TestServer(app)
        await upstream.start_server()
        proxy = Proxy(Settings(str(upstream.make_url("")), flags={}), Filler(FIXTURES / "tiny-target.gguf"))
        front = TestServer(proxy.app())
        await front.start_server()
        out = []
        try:
            async with ClientSession() as s:
                body = json.dumps({"prompt": "a", "logprobs": 2, "seed": 1})
                async with s.post(front.make_url("/v1/completions"), data=body) as r:
                    out.append((r.status, await r.read()))
                await upstream.close()  # the server goes away; the proxy keeps serving
                for path in ("/v1/completions", "/health"):
                    async with s.request("POST" if path != "/health" else "GET", front.make_url(path),
                                         data=body if path != "/health" else None) as r:
                        out.append((r.status, json.loads(await r.read())["error"]["type"]))
        finally:
            await front.close()
        return out
    (status, raw), down, health = asyncio.run(run())
    assert (status, raw) == (400, refusal)
    assert down == (502, "unavailable_error") and health == (502, "unavailable_error")
