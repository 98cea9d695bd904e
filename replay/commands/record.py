"""Record requests to a running llama-server as replayable transcripts.

For each request: snapshot /props and /slots, compute the prompt token ids the
way the server does (chat: /apply-template then /tokenize; text prompts:
/tokenize; both with add_special=true, parse_special=true as
tools/server/server-context.cpp:4650 tokenizes completion prompts), send the
request (stream or not), keep the response verbatim, and cross-check the
prompt ids against the count the server reports.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from replay.version import __version__
from replay.errors import ServerError, TranscriptError, json_error
from replay.llamacpp.http import get_json, post_json, post_sse
from replay.transcripts.entries import n_prompt
from replay.transcripts.format import ENDPOINTS, FORMAT, VERSION, final_response, now_iso

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # include/llama.h:37, "random"


@dataclass
class RequestItem:
    """One request to record: where it came from, its endpoint and body."""

    endpoint: str
    body: dict
    source: str = "<request>"
    line: int | None = None


def parse_request_lines(text: str, default_endpoint: str, source: str) -> Iterator[RequestItem | TranscriptError]:
    """Parse a JSONL file of requests; yields an error (not raises) for a bad line, so the rest go on.

    A line is either a request body, or `{"endpoint": "/completion", "request": {...}}`.
    Blank lines and lines starting with `#` are skipped.
    """
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            yield TranscriptError(f"line {n}: invalid JSON ({json_error(e)})", source=source)
            continue
        try:
            yield make_item(obj, default_endpoint, source, n)
        except TranscriptError as e:
            yield e


def make_item(obj: Any, default_endpoint: str, source: str, line: int | None = None) -> RequestItem:
    where = f"line {line}: " if line is not None else ""
    if not isinstance(obj, dict):
        raise TranscriptError(f"{where}a request must be a JSON object, got {type(obj).__name__}", source=source)
    if "request" in obj and isinstance(obj["request"], dict):
        endpoint, body = obj.get("endpoint", default_endpoint), obj["request"]
    else:
        endpoint, body = default_endpoint, obj
    if endpoint not in ENDPOINTS:
        raise TranscriptError(f"{where}endpoint {endpoint!r} is not one of {', '.join(ENDPOINTS)}", source=source)
    validate_request(endpoint, body, f"{source}{', ' + where.rstrip(': ') if where else ''}")
    return RequestItem(endpoint=endpoint, body=body, source=source, line=line)


def validate_request(endpoint: str, body: dict, where: str) -> None:
    """Refuse what cannot be replayed exactly, before anything is sent."""
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not -1 <= seed < 2**32):
        raise TranscriptError(f"\"seed\" {str(seed)[:20]} is not a 32-bit seed", source=where)
    if seed is None or seed in (-1, LLAMA_DEFAULT_SEED):
        raise TranscriptError("request has no fixed seed (seed unset or -1): the server would draw a random one "
                              "and the run could never be replayed; set e.g. \"seed\": 1", source=where)
    if endpoint == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            raise TranscriptError("a /v1/chat/completions request needs a \"messages\" list", source=where)
    else:
        p = body.get("prompt")
        if not (isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))):
            raise TranscriptError(f"a {endpoint} request needs one \"prompt\": a string or a list of token ids "
                                  "(several prompts in one request cannot be recorded as one transcript)", source=where)


def prompt_token_ids(url: str, endpoint: str, body: dict) -> list[int]:
    """The prompt ids the server will evaluate, asked of the server itself."""
    if endpoint == "/v1/chat/completions":
        text = post_json(url, "/apply-template", body).get("prompt")
        if not isinstance(text, str):
            raise ServerError(f"{url}/apply-template did not return a prompt", url=url)
    else:
        p = body["prompt"]
        if isinstance(p, list):
            return list(p)
        text = p
    ids = ids_of(post_json(url, "/tokenize", tokenize_body(text)))
    if ids is None:
        raise ServerError(f"{url}/tokenize did not return tokens", url=url)
    return ids


def tokenize_body(text: str) -> dict:
    """/tokenize's body for a prompt, as the server tokenizes a completion prompt (server-context.cpp:4650)."""
    return {"content": text, "add_special": True, "parse_special": True}


def ids_of(res: Any) -> list[int] | None:
    """The ids of a /tokenize answer (plain ids, or {"id": ...} pieces), None if it holds none.

    >>> ids_of({"tokens": [1, {"id": 7, "piece": "a"}]}), ids_of({})
    ([1, 7], None)
    """
    toks = res.get("tokens") if isinstance(res, dict) else None
    if not isinstance(toks, list):
        return None
    return [t["id"] if isinstance(t, dict) else int(t) for t in toks]


def snapshot_of(url: str, props: dict, slots: Any, listed: Any) -> dict:
    """A transcript's `server` block from the server's /props, /slots and /v1/models answers."""
    try:  # the model's size and parameter count (reading/identity.py)
        meta = listed["data"][0]["meta"]
        meta = {k: meta[k] for k in ("size", "n_params", "n_vocab", "ftype") if k in meta}
    except (KeyError, IndexError, TypeError):
        meta = None
    return {"url": url, "build_info": props.get("build_info"), "props": props, "slots": slots,
            **({"models_meta": meta} if meta else {})}


def server_snapshot(url: str) -> dict:
    """/props and /slots; raises ServerError if this is not a llama.cpp server."""
    try:
        props = get_json(url, "/props")
    except ServerError as e:
        if e.status is not None:
            raise ServerError(f"{url} is not a llama.cpp server (GET /props answered HTTP {e.status})",
                              url=url, status=e.status) from e
        raise
    if not isinstance(props, dict) or "build_info" not in props:
        raise ServerError(f"{url} is not a llama.cpp server (/props has no build_info)", url=url)
    try:
        slots = get_json(url, "/slots")
    except ServerError:
        slots = None  # started with --no-slots
    try:
        listed = get_json(url, "/v1/models")
    except ServerError:
        listed = None
    return snapshot_of(url, props, slots, listed)


def transcript_of(endpoint: str, body: dict, added: tuple[str, ...], prompt_ids: list[int], server: dict, *,
                  response: Any = None, events: list | None = None, recorded_at: str | None = None,
                  ran_with: int | None = None) -> dict:
    """A transcript in this format (transcripts/format.py) of one exchange: the body sent, the fields added
    to it, the response (or the stream's events, their data payloads), the prompt ids and the server's
    snapshot with its flags (`server`: server_snapshot's, with "flags"); `recorded_at`: when it was sent
    (now, if not given); `ran_with`: how many other generation requests the recorder had at the server
    while it ran, where it knows (the proxy)."""
    out = {
        "format": FORMAT, "version": VERSION, "recorded_at": recorded_at or now_iso(), "tool": f"spec-replay {__version__}",
        "endpoint": endpoint, "request": body, "added_fields": list(added), "stream": events is not None,
        "response": response, "events": events,
        "prompt_tokens": prompt_ids, "prompt_tokens_checked_against": None,
        "server": server,
    }
    if ran_with is not None:
        out["ran_with"] = ran_with
    return out


def record_one(url: str, item: RequestItem, flags: dict, *, snapshot: dict | None = None) -> dict:
    """Send one request and return its transcript. `flags` is the transcript's `server.flags`: the
    flags the server was started with, by llama-server's spelling (settings.flags_block)."""
    body = dict(item.body)
    added = []
    # trace replays the loop from a fresh prompt evaluation, so a request that reused the slot's
    # cache (recover can rebuild that state from timings.cache_n, trace cannot) may sample
    # differently; /completion can also return the generated ids themselves.
    if "cache_prompt" not in body:
        body["cache_prompt"] = False
        added.append("cache_prompt")
    # the generated ids; on the OpenAI endpoints they (and the settings the server used, its grammar
    # among them) come back only under "__verbose" (tools/server/server-task.cpp:404-455)
    if "return_tokens" not in body:
        body["return_tokens"] = True
        added.append("return_tokens")
    if item.endpoint != "/completion" and "verbose" not in body:
        body["verbose"] = True
        added.append("verbose")
    snap = snapshot or server_snapshot(url)
    prompt_ids = prompt_token_ids(url, item.endpoint, body)
    stream, sent_at = bool(body.get("stream")), now_iso()
    events = response = None
    if stream:
        events = list(post_sse(url, item.endpoint, body))
        if not events:
            raise ServerError(f"{url}{item.endpoint} sent an empty stream", url=url)
    else:
        response = post_json(url, item.endpoint, body)
    t = transcript_of(item.endpoint, body, tuple(added), prompt_ids, {**snap, "flags": flags},
                      response=response, events=events, recorded_at=sent_at)
    final = final_response(t)
    reported = n_prompt(item.endpoint, final)
    if reported is not None:
        if reported != len(prompt_ids):
            raise TranscriptError(f"the server evaluated {reported} prompt tokens but /tokenize gave {len(prompt_ids)}: "
                                  "the prompt ids cannot be reconstructed exactly", source=item.source, record=item.line)
        t["prompt_tokens_checked_against"] = ("tokens_evaluated" if item.endpoint == "/completion" else "usage.prompt_tokens")
    return t
