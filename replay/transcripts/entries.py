"""Per-token probability entries as llama-server sent them, for any endpoint and file layout.

llama-server reports, per emitted token, `{id, token, bytes, logprob, top_logprobs}`
(or, with `post_sampling_probs`, `{..., prob, top_probs}`) in:

    /completion            completion_probabilities[]           (stream: one per chunk)
    /v1/completions        choices[0].logprobs.content[]        (stream: per chunk)
    /v1/chat/completions   choices[0].logprobs.content[]        (stream: per chunk)

Tokens sampled inside the speculative loop carry a placeholder
(tools/server/server-context.cpp, b11434 :4350-4357: `result.prob = 1.0f; // set later`)
and an empty top list; in streams they carry nothing at all
(tools/server/server-task.cpp :1067-1081 only attaches non-empty lists).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from replay.transcripts.readers import Record, entries_of


@dataclass(frozen=True)
class SentEntry:
    """One probability entry as the server sent it; `logprob` is a natural-log prob in both modes."""

    id: int | None
    token: str
    logprob: float
    top: tuple[tuple[int | None, str, float], ...]  # (id, piece, logprob), as sent
    kind: str  # "logprob" (pre-sampling) or "prob" (post_sampling_probs)

    @property
    def is_placeholder(self) -> bool:
        """prob 1.0 / logprob 0.0 with no alternatives: the speculative-path placeholder."""
        return is_placeholder(self.logprob, self.top)


def is_placeholder(logprob: float, top: Sequence, n_probs: int = 1) -> bool:
    """The speculative path's placeholder: logprob 0.0 (prob 1.0) and no alternatives, where the
    request asked for some (`n_probs` > 0). server-context.cpp:4350-4357 sends `result.prob = 1.0f;
    // set later` and no probs for every token its speculative loop emits.

    >>> is_placeholder(0.0, ()), is_placeholder(0.0, (), n_probs=0), is_placeholder(-0.1, ())
    (True, False, False)
    """
    return logprob == 0.0 and not top and n_probs > 0


def parse_entry(e: dict) -> SentEntry:
    """One entry as the server sent it, in either mode (post-sampling `prob`s are logged; a value
    the server left null is -inf, an alternative without one is dropped)."""
    def log(p) -> float:
        return math.log(p) if p is not None and p > 0 else -math.inf

    if "prob" in e:
        return SentEntry(id=e.get("id"), token=e.get("token", ""), logprob=log(float(e["prob"])),
                         top=tuple((t.get("id"), t.get("token", ""), log(t.get("prob", 0)))
                                   for t in e.get("top_probs") or []), kind="prob")
    lp = e.get("logprob")
    return SentEntry(id=e.get("id"), token=e.get("token", ""), logprob=float(lp) if lp is not None else -math.inf,
                     top=tuple((t.get("id"), t.get("token", ""), float(t["logprob"])) for t in e.get("top_logprobs") or []
                               if t.get("logprob") is not None), kind="logprob")


def _entries_of(obj: dict, endpoint: str) -> list[dict]:
    return list(entries_of(endpoint, obj) or [])


def sent_entries(endpoint: str, response: dict | None = None, events: Iterable[dict] | None = None) -> list[SentEntry]:
    """The probability entries of a non-stream `response` or of decoded stream `events`."""
    if events is not None:
        out: list[SentEntry] = []
        for ev in events:
            # the final /completion chunk repeats the whole result without probabilities
            out.extend(parse_entry(e) for e in _entries_of(ev, endpoint))
        return out
    if response is None:
        return []
    return [parse_entry(e) for e in _entries_of(response, endpoint)]


def _count(v) -> int | None:
    """A token count as the server sends it (the readers validated its type); null or absent: None."""
    return v if type(v) is int and v >= 0 else None  # bools are not counts


def _obj(v) -> dict:
    return v if isinstance(v, dict) else {}


def n_generated(endpoint: str, final: dict | None) -> int | None:
    """How many tokens the server says it generated (None if the response does not say)."""
    if not final:
        return None
    v = _count(final.get("tokens_predicted")) if endpoint == "/completion" else \
        _count(_obj(final.get("usage")).get("completion_tokens"))
    return v if v is not None else _count(_obj(final.get("timings")).get("predicted_n"))


def n_prompt(endpoint: str, final: dict | None) -> int | None:
    """How many prompt tokens the server says it evaluated (None if it does not say)."""
    if not final:
        return None
    if endpoint == "/completion" and _count(final.get("tokens_evaluated")) is not None:
        return final["tokens_evaluated"]
    v = _count(_obj(final.get("usage")).get("prompt_tokens"))
    if v is not None:
        return v
    t = _obj(final.get("timings"))
    if _count(t.get("prompt_n")) is not None:
        return t["prompt_n"] + (_count(t.get("cache_n")) or 0)
    return None


def n_prompt_cached(final: dict | None) -> int | None:
    """How many prompt tokens the server took from its slot's cache instead of evaluating them
    (timings.cache_n = n_prompt_tokens_cache, server-context.cpp:3639; the OpenAI usage's
    prompt_tokens_details.cached_tokens); None if the response does not say."""
    if not final:
        return None
    v = _count(_obj(final.get("timings")).get("cache_n"))
    if v is not None:
        return v
    return _count(_obj(_obj(final.get("usage")).get("prompt_tokens_details")).get("cached_tokens"))


def drafted(final: dict | None) -> bool | None:
    """Whether the server ran its speculative loop for this response (timings.draft_n > 0; a server
    writes draft_n only when the slot drafted, tools/server/server-common.cpp:99-102, so timings
    without it mean no draft); None if the response has no timings."""
    timings = (final or {}).get("timings")
    if not isinstance(timings, dict) or "predicted_n" not in timings:
        return None
    if "draft_n" not in timings:
        return False
    n = _count(timings.get("draft_n"))
    return n > 0 if n is not None else None


def record_entries(rec: Record) -> list[SentEntry]:
    """Every probability entry a record's response carries, in order (body or stream chunks)."""
    return sent_entries(rec.endpoint, rec.response) if not rec.stream else sent_entries(rec.endpoint,
                                                                                        events=rec.chunks())
