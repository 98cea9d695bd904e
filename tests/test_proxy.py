"""`spec-replay proxy` in front of a server that answers as a recorded one did (replay/proxy/):

- a request that asks for probabilities gets the server's response with every placeholder replaced by the
  value recover computes, equal to the committed repaired transcript, in the same schema and field order,
  with a header counting the values filled; streamed or not;
- the fields the proxy added upstream (return_tokens, verbose) are not in what the client gets;
- a request that asks for none, and every other endpoint, passes through byte for byte;
- malformed JSON is a 400 in llama-server's error shape; an upstream error passes through as it came;
- load and failures: requests beyond the workers and the backlog are a 503; a client that goes away stops
  its replay (its worker terminated and replaced); a worker that dies fails its own response and the
  next is filled; an upstream that restarts is served again; with --serial the upstream never has two
  generation requests at once.

The upstream here is the recorded server: it answers each endpoint with what the real b11434 server
answered when the committed transcript was recorded (fixtures/transcripts/). Live servers are
tests/test_proxy_live.py's.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from aiohttp import ClientSession, ClientTimeout, web
from aiohttp.test_utils import TestServer, unused_port
from pebble.pool.process import WorkerManager

from proxy_helpers import SlowFiller, workers_of

from replay.paths import FIXTURES
from replay.proxy.app import FILLED_HEADER, Proxy, Settings
from replay.proxy.exchange import client_object
from replay.proxy.filler import Filler

pytestmark = pytest.mark.processes

TRANSCRIPTS = FIXTURES / "transcripts"


def recorded_server(t: dict, delay: float = 0.0, seen: dict | None = None,
                    answered: asyncio.Event | None = None) -> web.Application:
    """An upstream that answers as the server the transcript was recorded from, each generation request
    after `delay` seconds; `seen["most"]`: the most generation requests it had at once; `answered` is set
    when it has answered one."""
    app = web.Application()
    server = t["server"]
    seen = seen if seen is not None else {}
    seen.update(now=0, most=0)

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
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await asyncio.sleep(delay)
        finally:
            seen["now"] -= 1
        if answered is not None:
            asyncio.get_running_loop().call_later(0.01, answered.set)
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


# --- load, cancellation, failures ------------------------------------------------------------------

class Front:
    """A proxy over a recorded upstream, both on loopback, with the proxy's log lines kept."""

    def __init__(self, t: dict, upstream_app: web.Application | None = None, filler: Filler | None = None,
                 **settings):
        self.t, self.lines = t, []
        self.filler = filler or Filler(FIXTURES / "tiny-target.gguf")
        self.upstream_app = upstream_app or recorded_server(t)
        self.settings = settings

    async def __aenter__(self) -> "Front":
        self.upstream = TestServer(self.upstream_app)
        await self.upstream.start_server()
        self.proxy = Proxy(Settings(str(self.upstream.make_url("")), flags=self.t["server"].get("flags") or {},
                                    log=self.lines.append, **self.settings), self.filler)
        self.front = TestServer(self.proxy.app(), handler_cancellation=True)
        await self.front.start_server()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.front.close()
        await self.upstream.close()

    async def post(self, body: dict, *, timeout: float | None = None) -> tuple[int, dict, bytes]:
        async with ClientSession(timeout=ClientTimeout(total=timeout)) as s:
            async with s.post(self.front.make_url(self.t["endpoint"]), json=body) as r:
                return r.status, dict(r.headers), await r.read()


def chat() -> dict:
    return json.loads((TRANSCRIPTS / "tiny-v1-chat.json").read_text())


def test_requests_beyond_the_workers_and_the_backlog_are_answered_503_and_the_rest_filled():
    t = chat()

    async def run():
        async with Front(t, workers=1, backlog=1) as f:
            return await asyncio.gather(*(f.post(client_body(t)) for _ in range(4)))
    got = asyncio.run(run())
    assert sorted(s for s, _, _ in got) == [200, 200, 503, 503]
    busy = [json.loads(raw)["error"] for s, _, raw in got if s == 503]
    assert all(e["type"] == "unavailable_error" and "backlog is full" in e["message"] for e in busy)
    assert all(int(h[FILLED_HEADER]) > 0 for s, h, _ in got if s == 200)


def test_a_client_that_goes_away_cancels_its_replay_and_the_next_request_is_filled():
    """(That the worker running a long replay is terminated: tests/test_proxy_configs.py, on a real one.)"""
    t = chat()

    async def run():
        async with Front(t) as f:
            first = asyncio.ensure_future(f.post(client_body(t)))
            while not any(r.running() for r in f.proxy.replays):  # a worker runs its replay
                await asyncio.sleep(0.005)
            first.cancel()  # the client goes away
            for _ in range(200):
                if any("went away" in line for line in f.lines):
                    break
                await asyncio.sleep(0.05)
            return list(f.lines), await f.post(client_body(t))
    lines, (status, headers, _) = asyncio.run(run())
    assert any("the client went away; its replay was cancelled" in line for line in lines)
    assert status == 200 and int(headers[FILLED_HEADER]) > 0


def test_a_request_after_a_cancelled_replay_is_answered_however_late_pebble_stops_its_worker(monkeypatch):
    """pebble stops a cancelled replay's worker from its manager thread some time after the cancel (on a
    loaded machine, long after). A replay sent to the pool in between is taken by that worker once it ends
    the cancelled one, and is lost with it when the stop comes: pebble never answers it
    (noxdafox/pebble#153). Here each replay takes 2 s and pebble's stop comes 3 s after the cancel, inside
    the next replay; that request is still answered and filled, since the proxy sends it to the pool only
    once the cancelled one's worker has exited. (Without the proxy's StopGate, replay/proxy/workers.py, it is never answered.)"""
    stop = WorkerManager.maybe_stop_worker

    def late(self, worker_id):
        time.sleep(3.0)
        return stop(self, worker_id)
    monkeypatch.setattr(WorkerManager, "maybe_stop_worker", late)
    t = chat()

    async def run():
        async with Front(t, filler=SlowFiller(FIXTURES / "tiny-target.gguf", seconds=2.0)) as f:
            first = asyncio.ensure_future(f.post(client_body(t)))
            while not any(r.running() for r in f.proxy.replays):
                assert not first.done()
                await asyncio.sleep(0.001)
            first.cancel()
            started = time.monotonic()
            try:
                status, headers, _ = await asyncio.wait_for(f.post(client_body(t)), 60)
            except asyncio.TimeoutError:
                pytest.fail("the request after the cancel was not answered within 60 s")
            return status, headers, time.monotonic() - started
    status, headers, took = asyncio.run(run())
    assert status == 200 and int(headers[FILLED_HEADER]) > 0
    assert took >= 3.0 + 2.0  # sent to the pool after the cancelled one's worker stopped


def test_a_worker_that_dies_fails_its_own_response_in_one_line_and_the_proxy_keeps_serving():
    t = chat()

    async def run():
        answered = asyncio.Event()
        async with Front(t, upstream_app=recorded_server(t, answered=answered)) as f:
            first = asyncio.ensure_future(f.post(client_body(t)))
            await answered.wait()
            while not first.done():  # the out-of-memory killer, say, at whatever point the replay is
                for w in workers_of(os.getpid()):
                    os.kill(w, signal.SIGKILL)
                await asyncio.sleep(0.02)
            died, again = await first, await f.post(client_body(t))
            for w in workers_of(os.getpid()):
                os.kill(w, signal.SIGKILL)  # this time between two replays
            await asyncio.sleep(0.5)
            return died, again, await f.post(client_body(t))
    (status, _, raw), (again, headers, _), (idle, after_idle, _) = asyncio.run(run())
    err = json.loads(raw)["error"]
    assert status == 500 and "\n" not in err["message"]
    assert "the replay worker died" in err["message"] or "the replay workers keep dying" in err["message"]
    assert again == 200 and int(headers[FILLED_HEADER]) > 0
    assert idle == 200 and int(after_idle[FILLED_HEADER]) > 0


def test_an_upstream_that_restarts_is_served_again():
    t = chat()

    async def run():
        port = unused_port()
        upstream = TestServer(recorded_server(t), port=port)
        await upstream.start_server()
        proxy = Proxy(Settings(f"http://127.0.0.1:{port}", flags={}), Filler(FIXTURES / "tiny-target.gguf"))
        front = TestServer(proxy.app())
        await front.start_server()
        out = []
        try:
            async with ClientSession() as s:
                for step in ("up", "down", "up again"):
                    if step == "down":
                        await upstream.close()
                    elif step == "up again":
                        upstream = TestServer(recorded_server(t), port=port)
                        await upstream.start_server()
                    async with s.post(front.make_url(t["endpoint"]), json=client_body(t)) as r:
                        out.append((r.status, r.headers.get(FILLED_HEADER)))
        finally:
            await front.close()
            await upstream.close()
        return out
    (up, _), (down, _), (again, filled) = asyncio.run(run())
    assert (up, down, again) == (200, 502, 200) and int(filled) > 0


def test_with_serial_the_upstream_never_has_two_generation_requests_at_once():
    t = chat()

    async def run(serial: bool) -> int:
        seen: dict = {}
        async with Front(t, upstream_app=recorded_server(t, 0.3, seen), serial=serial, workers=1) as f:
            plain = {k: v for k, v in client_body(t).items() if k not in ("logprobs", "top_logprobs")}
            got = await asyncio.gather(f.post(client_body(t)), *(f.post(plain) for _ in range(3)))
        assert [s for s, _, _ in got] == [200] * 4
        return seen["most"]
    assert asyncio.run(run(serial=False)) == 4
    assert asyncio.run(run(serial=True)) == 1
