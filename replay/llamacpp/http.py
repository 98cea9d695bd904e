"""A small HTTP client for llama-server: JSON calls and SSE streams (stdlib only).

Every failure becomes a ServerError naming the URL (and status), never a
traceback: connection refused, timeouts, non-JSON bodies, error objects.
"""
from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

from replay.errors import ServerError

DEFAULT_TIMEOUT = 3600.0  # a long generation on a busy CPU server takes minutes; 600 s timed out under load


def _url(base: str, path: str) -> str:
    """base + path, after checking base is an http(s) server address.

    >>> _url("http://127.0.0.1:8080/", "/props")
    'http://127.0.0.1:8080/props'
    >>> _url("localhost:8080", "/props")
    Traceback (most recent call last):
    ...
    replay.errors.ServerError: 'localhost:8080' is not a server URL: give http://HOST:PORT
    """
    try:
        parts = urllib.parse.urlsplit(base)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:  # a bad port or an unclosed [IPv6 bracket
        ok = False
    if not ok:
        raise ServerError(f"{base!r} is not a server URL: give http://HOST:PORT", url=base)
    return base.rstrip("/") + path


def _open(base: str, path: str, body: Any | None, timeout: float):
    url = _url(base, path)
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")
        try:
            msg = json.loads(detail).get("error", {})
            detail = msg.get("message", detail) if isinstance(msg, dict) else str(msg)
        except (ValueError, AttributeError):
            pass
        raise ServerError(f"{url} answered HTTP {e.code}: {detail.strip()[:300]}", url=url, status=e.code) from None
    except (socket.timeout, TimeoutError):
        raise ServerError(f"no answer from {url} within {timeout:.0f}s", url=url) from None
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise ServerError(f"no answer from {url} within {timeout:.0f}s", url=url) from e
        raise ServerError(f"cannot reach {url}: {reason}", url=url) from e


def get_json(base: str, path: str, timeout: float = 30.0) -> Any:
    """GET a JSON document."""
    with _open(base, path, None, timeout) as resp:
        return _decode(base, path, resp.read())


def post_json(base: str, path: str, body: Any, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """POST a JSON body and return the decoded JSON answer."""
    with _open(base, path, body, timeout) as resp:
        return _decode(base, path, resp.read())


def post_sse(base: str, path: str, body: Any, timeout: float = DEFAULT_TIMEOUT) -> Iterator[str]:
    """POST and yield the `data:` payloads of the SSE answer, as text, in order.

    The `[DONE]` sentinel of the OpenAI endpoints is yielded too (the caller
    records it); comment lines (pings) are skipped.
    """
    url = _url(base, path)
    with _open(base, path, body, timeout) as resp:
        try:
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if line.startswith("data:"):
                    yield line[5:].lstrip(" ")
        except (socket.timeout, http.client.HTTPException, OSError) as e:
            raise ServerError(f"stream from {url} broke off: {e}", url=url) from e


def _decode(base: str, path: str, raw: bytes) -> Any:
    url = _url(base, path)
    try:
        return json.loads(raw)
    except ValueError:
        raise ServerError(f"{url} did not answer JSON (is it a llama.cpp server?)", url=url) from None
