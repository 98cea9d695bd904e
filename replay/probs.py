"""Per-token probability entries as llama-server sent them, for any endpoint and shape.

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
from typing import Any, Iterable


@dataclass(frozen=True)
class TokenProb:
    """One probability entry as sent: `value` is a natural-log prob in both modes."""

    id: int | None
    token: str
    logprob: float
    top: tuple[tuple[int | None, str, float], ...]  # (id, piece, logprob), as sent
    kind: str  # "logprob" (pre-sampling) or "prob" (post_sampling_probs)

    @property
    def is_placeholder(self) -> bool:
        """prob 1.0 / logprob 0.0 with no alternatives: the speculative-path placeholder."""
        return self.logprob == 0.0 and not self.top


def _entry(e: dict) -> TokenProb:
    if "prob" in e:
        p = float(e["prob"])
        lp = math.log(p) if p > 0 else -math.inf
        top = tuple((t.get("id"), t.get("token", ""), math.log(t["prob"]) if t["prob"] > 0 else -math.inf)
                    for t in e.get("top_probs") or [])
        kind = "prob"
    else:
        lp = float(e["logprob"])
        top = tuple((t.get("id"), t.get("token", ""), float(t["logprob"])) for t in e.get("top_logprobs") or [])
        kind = "logprob"
    return TokenProb(id=e.get("id"), token=e.get("token", ""), logprob=lp, top=top, kind=kind)


def _entries_of(obj: dict, endpoint: str) -> list[dict]:
    from .readers import entries_of
    return list(entries_of(endpoint, obj) or [])


def token_probs(endpoint: str, response: dict | None = None, events: Iterable[dict] | None = None) -> list[TokenProb]:
    """The probability entries of a non-stream `response` or of decoded stream `events`."""
    if events is not None:
        out: list[TokenProb] = []
        for ev in events:
            # the final /completion chunk repeats the whole result without probabilities
            out.extend(_entry(e) for e in _entries_of(ev, endpoint))
        return out
    if response is None:
        return []
    return [_entry(e) for e in _entries_of(response, endpoint)]


def n_generated(endpoint: str, final: dict | None) -> int | None:
    """How many tokens the server says it generated (None if the response does not say)."""
    if not final:
        return None
    if endpoint == "/completion":
        v = final.get("tokens_predicted")
    else:
        v = (final.get("usage") or {}).get("completion_tokens")
    if v is None:
        v = (final.get("timings") or {}).get("predicted_n")
    return int(v) if v is not None else None


def n_prompt(endpoint: str, final: dict | None) -> int | None:
    """How many prompt tokens the server says it evaluated (None if it does not say)."""
    if not final:
        return None
    if endpoint == "/completion" and "tokens_evaluated" in final:
        return int(final["tokens_evaluated"])
    usage = final.get("usage") or {}
    if "prompt_tokens" in usage:
        return int(usage["prompt_tokens"])
    t = final.get("timings") or {}
    if "prompt_n" in t:
        return int(t["prompt_n"]) + int(t.get("cache_n", 0))
    return None


def n_prompt_cached(final: dict | None) -> int | None:
    """How many prompt tokens the server took from its slot's cache instead of evaluating them
    (timings.cache_n = n_prompt_tokens_cache, server-context.cpp:3639; the OpenAI usage's
    prompt_tokens_details.cached_tokens); None if the response does not say."""
    if not final:
        return None
    count = lambda v: v if type(v) is int and v >= 0 else None  # noqa: E731 (bools are not counts)
    t = final.get("timings") or {}
    if count(t.get("cache_n")) is not None:
        return t["cache_n"]
    details = (final.get("usage") or {}).get("prompt_tokens_details") or {}
    return count(details.get("cached_tokens")) if isinstance(details, dict) else None


def drafted(final: dict | None) -> bool | None:
    """Whether the server ran its speculative loop for this response (timings.draft_n > 0);
    None if the response does not say."""
    t = (final or {}).get("timings") or {}
    n = t.get("draft_n")
    return n > 0 if type(n) is int else None


def summarize(values: list[TokenProb]) -> dict[str, Any]:
    n = len(values)
    ph = sum(v.is_placeholder for v in values)
    mean = sum(v.logprob for v in values) / n if n else None
    return {"tokens": n, "placeholders": ph, "real": n - ph, "mean_logprob": mean}
