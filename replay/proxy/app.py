"""The proxy's HTTP side (aiohttp): every request forwarded to the llama-server at `upstream`; the responses
of /completion, /v1/completions and /v1/chat/completions that carry probabilities come back with every
placeholder and missing value replaced by the value the server computed (filler.py), in the same schema
and field order, and a header saying how many it filled.

    a request that asks for probabilities   forwarded with return_tokens (and verbose) added
                                            (exchange.py), its prompt ids asked of the server as `record`
                                            asks them, its response (a stream is read whole first)
                                            recovered in a worker process, one at a time per worker
    any other request                       passed through, byte for byte, status and body

Failures: a value that cannot be recovered exactly is `--on-failure error` (HTTP 500, llama-server's error
object with the one-line reason) or `pass` (the server's response unchanged, the reason in a header). The
upstream's own errors pass through; an upstream that cannot be reached is 502; a full backlog is 503.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Callable

from aiohttp import ClientError, ClientSession, ClientTimeout, web
from pebble import ProcessExpired, ProcessPool

from replay.commands.record import ids_of, snapshot_of, tokenize_body, transcript_of
from replay.proxy.exchange import COMPLETION, V1_CHAT, asks_probabilities, client_event, client_object, endpoint_of, \
    upstream_request
from replay.proxy.filler import Filled, Filler
from replay.proxy.workers import StopGate, worker_pids
from replay.transcripts.format import now_iso

FILLED_HEADER = "X-Spec-Replay-Filled"  # how many values the proxy filled in this response
UNFILLED_HEADER = "X-Spec-Replay-Unfilled"  # why it filled none (--on-failure pass)
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host", "upgrade",
       "proxy-connection", "te", "trailer"}


def error_body(code: int, message: str, kind: str) -> bytes:
    """llama-server's error object (tools/server/server-common.cpp format_error_response)."""
    return json.dumps({"error": {"code": code, "message": message, "type": kind}}).encode()


def error(code: int, message: str, kind: str) -> web.Response:
    return web.Response(status=code, body=error_body(code, message, kind), content_type="application/json")


@dataclass(frozen=True)
class Settings:
    """How the proxy was started: the upstream's URL, the server's flags as llama-server spells them, the
    worker processes, the backlog of requests waiting for one, and what a refused fill does."""

    upstream: str
    flags: dict
    workers: int = 1
    backlog: int = 64
    on_failure: str = "error"  # "error" | "pass"
    serial: bool = False  # forward generation requests one at a time (the server never batches two together)
    log: Callable[[str], None] | None = None  # one line per filled request (-v)


_FILLER: Filler | None = None


def _init_worker(filler: Filler) -> None:  # pragma: no cover - in the worker process
    global _FILLER
    _FILLER = filler


def _fill(transcript: dict, seq: int) -> Filled:  # pragma: no cover - in the worker process
    assert _FILLER is not None
    return _FILLER.fill(transcript, seq)


@dataclass
class Generation:
    """A generation request the proxy has at the upstream: `seq`, its place among those sent (1, 2, ...);
    `others`, the other generation requests it had there meanwhile (those running when it was sent, and
    those sent before it ended): the transcript's `ran_with`."""
    seq: int
    others: int


class Proxy:
    """The aiohttp application's state: the upstream session, its snapshot (/props, /slots, /v1/models, read
    at start), the worker pool and the backlog."""

    def __init__(self, settings: Settings, filler: Filler):
        self.settings, self.filler = settings, filler
        self.upstream = settings.upstream.rstrip("/")
        self.session: ClientSession | None = None
        self.snapshot: dict = {}
        self.pool: ProcessPool | None = None
        self.waiting = 0
        self.slots = asyncio.Semaphore(settings.workers)
        self.running: dict[int, Generation] = {}  # the generation requests at the upstream
        self.sent = 0  # generation requests sent to the upstream so far
        self.one_at_a_time = asyncio.Lock() if settings.serial else None
        self.replays: set = set()  # the replays scheduled on the workers (pebble futures), until they end
        self.stale = False  # the upstream went away: read its snapshot again before the next fill
        self.gate = StopGate()  # closed from a cancel until pebble has stopped the cancelled one's worker

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def _start(self, app: web.Application) -> None:
        self.session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10))
        self.snapshot = await self.server_snapshot()
        self.pool = self.new_pool()

    def new_pool(self) -> ProcessPool:
        """pebble's pool, not concurrent.futures': a cancelled replay's worker is terminated and replaced,
        and a worker that dies fails its own request, not the pool."""
        return ProcessPool(self.settings.workers, initializer=_init_worker, initargs=(self.filler,),
                           context=get_context("forkserver"))

    async def _stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        if self.pool is not None:
            self.pool.close()  # the replays already running finish (aiohttp waits for their handlers first)
            self.pool.join(timeout=30)
            self.pool.stop()

    async def server_snapshot(self) -> dict:
        """/props (its build_info, the slots, the speculative settings), /slots and /v1/models' meta, as
        `record` keeps them (commands/record.py server_snapshot)."""
        props = await self._get("/props")
        if not isinstance(props, dict) or "build_info" not in props:
            raise RuntimeError(f"{self.upstream} is not a llama.cpp server (/props has no build_info)")
        slots = await self._get("/slots", required=False)
        return snapshot_of(self.upstream, props, slots, await self._get("/v1/models", required=False))

    async def _get(self, path: str, required: bool = True) -> Any:
        assert self.session is not None
        async with self.session.get(self.upstream + path) as r:
            if r.status != 200:
                if required:
                    raise RuntimeError(f"{self.upstream}{path} answered HTTP {r.status}")
                return None
            return await r.json(content_type=None)

    async def _post_json(self, path: str, body: dict) -> Any:
        assert self.session is not None
        async with self.session.post(self.upstream + path, json=body) as r:
            if r.status != 200:
                raise _Upstream(r.status, await r.read(), r.headers.get("Content-Type", "application/json"))
            return await r.json(content_type=None)

    @contextlib.asynccontextmanager
    async def generating(self):
        """One generation request at the upstream, for as long as it runs there: its Generation (its
        place among those sent, and the others the proxy had at the upstream meanwhile). With --serial,
        it waits until no other one runs."""
        async with self.one_at_a_time or contextlib.nullcontext():
            self.sent += 1
            this = Generation(seq=self.sent, others=len(self.running))
            for other in self.running.values():
                other.others += 1
            key = id(this)
            self.running[key] = this
            try:
                yield this
            finally:
                del self.running[key]

    def unreachable(self, e: Exception) -> web.Response:
        """502 for an upstream that cannot be reached; its snapshot is read again before the next fill (a
        restarted server may run another build or other slots)."""
        self.stale = True
        return error(502, f"the llama-server at {self.upstream} cannot be reached: {e}", "unavailable_error")

    # --- requests -------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        endpoint = endpoint_of(request.path) if request.method == "POST" else None
        if endpoint is not None:
            try:
                body = json.loads(raw)
            except ValueError as e:
                return error(400, f"invalid JSON in the request body: {e}", "invalid_request_error")
            if isinstance(body, dict) and asks_probabilities(endpoint, body):
                try:
                    return await self.filled(request, endpoint, body)
                except _Upstream as u:
                    return web.Response(status=u.status, body=u.body, headers={"Content-Type": u.content_type})
                except (ClientError, OSError) as e:
                    return self.unreachable(e)
            async with self.generating():  # it shares the server's batches with the ones that are filled
                return await self.passthrough(request, raw)
        return await self.passthrough(request, raw)

    async def passthrough(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """The request as the client sent it, and the upstream's answer as it came, streamed through."""
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        try:
            async with self.session.request(request.method, self.upstream + request.path_qs, data=raw or None,
                                            headers=headers) as r:
                out = web.StreamResponse(status=r.status, reason=r.reason,
                                         headers={k: v for k, v in r.headers.items() if k.lower() not in HOP})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (ClientError, OSError) as e:
            return self.unreachable(e)

    async def filled(self, request: web.Request, endpoint: str, body: dict) -> web.StreamResponse:
        """A request that asks for probabilities: forwarded, recovered, answered (module docstring)."""
        if self.waiting >= self.settings.backlog + self.settings.workers:
            return error(503, f"the proxy's replay backlog is full ({self.settings.backlog} requests waiting): "
                              "try again, or start it with more --workers or a larger --backlog", "unavailable_error")
        self.waiting += 1  # from now until its answer, whether at the upstream or waiting for a worker
        try:
            return await self._filled(request, endpoint, body)
        finally:
            self.waiting -= 1

    async def _filled(self, request: web.Request, endpoint: str, body: dict) -> web.StreamResponse:
        if self.stale:  # a restarted server may run another build or other slots
            self.snapshot, self.stale = await self.server_snapshot(), False
        sent, added = upstream_request(endpoint, body)
        prompt_ids = await self.prompt_ids(endpoint, sent)
        stream = bool(body.get("stream"))
        async with self.generating() as gen:
            # /slots just before it, as `record` takes it: a slot busy with a request that did not come
            # through the proxy is evidence too
            slots = await self._get("/slots", required=False) if self.snapshot.get("slots") is not None else None
            sent_at = now_iso()
            response, events = (None, await self._events(request.path, sent)) if stream else \
                (await self._post_json(request.path, sent), None)
        t = transcript_of(endpoint, sent, added, prompt_ids, {**self.snapshot, "slots": slots,
                                                                "flags": self.settings.flags},
                          response=response, events=events, recorded_at=sent_at, ran_with=gen.others)
        async with self.slots:
            started = time.perf_counter()
            got = await self.replay(endpoint, t, gen.seq)
            took = time.perf_counter() - started
        if self.settings.log is not None:
            self.settings.log(f"proxy: {endpoint}: " + (f"{got.filled} value(s) filled" if got.refused is None
                                                        else f"not filled: {got.refused}") + f" ({took:.2f} s)")
        if got.refused is not None and self.settings.on_failure == "error":
            return error(500, f"spec-replay cannot give this response's values exactly: {got.refused}", "server_error")
        headers = {FILLED_HEADER: str(got.filled)} if got.refused is None else {UNFILLED_HEADER: got.refused[:900]}
        if stream:
            return await self._sse(request, got.events if got.refused is None else events, added, headers)
        obj = client_object(got.response if got.refused is None else response, added)
        return web.Response(body=json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(),
                            content_type="application/json", headers=headers)

    async def replay(self, endpoint: str, transcript: dict, seq: int) -> Filled:
        """The transcript's values, from a worker process. A client that goes away cancels its replay: the
        worker running it is terminated and a fresh one takes its place. A worker that dies (a crash in
        libllama, the out-of-memory killer) fails this response with the reason; the proxy keeps serving."""
        for _ in range(2):
            assert self.pool is not None
            if not self.pool.active:  # a worker died between replays, which pebble takes for a broken pool
                self.pool.stop()
                self.pool = self.new_pool()
            await self.gate.passed()
            future = self.pool.schedule(_fill, (transcript, seq))
            self.replays.add(future)
            try:
                return await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                if future.cancel():  # a replay that had not finished: pebble stops its worker, a moment later
                    self.gate.close_until_one_exits(worker_pids())  # (workers.py: noxdafox/pebble#153)
                if self.settings.log is not None:
                    self.settings.log(f"proxy: {endpoint}: the client went away; its replay was cancelled")
                raise
            except ProcessExpired as e:
                return Filled(refused=f"the replay worker died (exit code {e.exitcode}) while recovering this "
                                      "response")
            except BrokenProcessPool:  # its worker had died before it started: once more, on a new pool
                pass
            finally:
                self.replays.discard(future)
        return Filled(refused="the replay workers keep dying before they start a replay")

    async def prompt_ids(self, endpoint: str, body: dict) -> list[int]:
        """The prompt ids the server evaluates, asked of the server as `record` asks them
        (commands/record.py prompt_token_ids)."""
        if endpoint == V1_CHAT:
            text = (await self._post_json("/apply-template", body)).get("prompt")
        else:
            p = body.get("prompt")
            if isinstance(p, list):
                return list(p)
            text = p
        return ids_of(await self._post_json("/tokenize", tokenize_body(text))) or []

    async def _events(self, path: str, body: dict) -> list[str]:
        """The `data:` payloads of the upstream's SSE answer, in order ([DONE] too)."""
        assert self.session is not None
        out = []
        async with self.session.post(self.upstream + path, json=body) as r:
            if r.status != 200:
                raise _Upstream(r.status, await r.read(), r.headers.get("Content-Type", "application/json"))
            async for raw in r.content:
                line = raw.decode("utf-8").rstrip("\r\n")
                if line.startswith("data:"):
                    out.append(line[5:].lstrip(" "))
        return out

    async def _sse(self, request: web.Request, events: list, added: tuple[str, ...],
                   headers: dict) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await out.prepare(request)
        for e in events:
            data = e if isinstance(e, str) else json.dumps(e, ensure_ascii=False, separators=(",", ":"))
            await out.write(f"data: {client_event(data, added)}\n\n".encode())
        await out.write_eof()
        return out


class _Upstream(Exception):
    """The upstream answered an error: it goes to the client as it came."""

    def __init__(self, status: int, body: bytes, content_type: str):
        self.status, self.body, self.content_type = status, body, content_type


__all__ = ["COMPLETION", "FILLED_HEADER", "Proxy", "Settings", "UNFILLED_HEADER"]
