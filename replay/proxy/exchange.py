"""One request through the proxy, as data: what it asks upstream, and what the client gets back. Pure.

recover needs the generated ids of a response and, on the OpenAI endpoints, the settings the server used
(its grammar among them): the proxy asks for them upstream as `record` does (commands/record.py), with
`return_tokens` (/completion's `tokens`, tools/server/server-context.cpp:1972) and `verbose` (the OpenAI
endpoints' `__verbose`, tools/server/server-task.cpp:403-406, 451-454, 521-523), and gives the client the
response it would have had without them: `tokens` empty as the server sends it when not asked
(server-task.cpp:344, 1054), `__verbose` absent. A field the client asked for itself stays.

    asks_probabilities(endpoint, body)   whether the response carries probabilities to fill
    upstream_request(endpoint, body)     the body sent upstream, and the fields the proxy added
    client_object(obj, added)            a response object (or a stream chunk) as the client gets it
    client_event(data, added)            an SSE data line as the client gets it
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from replay.settings.sampling import requested_n_probs

COMPLETION, V1_COMPLETIONS, V1_CHAT = "/completion", "/v1/completions", "/v1/chat/completions"
FILLED = (COMPLETION, V1_COMPLETIONS, V1_CHAT)  # the endpoints whose probabilities the proxy fills
ALIASES = {"/completions": COMPLETION, "/chat/completions": V1_CHAT}  # llama-server's own aliases


def endpoint_of(path: str) -> str | None:
    """The filled endpoint a request path names, or None (passed through).

    >>> endpoint_of("/v1/chat/completions"), endpoint_of("/chat/completions"), endpoint_of("/health")
    ('/v1/chat/completions', '/v1/chat/completions', None)
    """
    return path if path in FILLED else ALIASES.get(path)


def asks_probabilities(endpoint: str, body: Mapping[str, Any]) -> bool:
    """Whether the response will carry probabilities: n_probs (or its aliases) above 0, as the server reads
    them (settings/sampling.py requested_n_probs, tools/server/server-common.cpp:1472-1486).

    >>> asks_probabilities("/completion", {"prompt": "a", "n_probs": 3}), asks_probabilities("/completion", {"prompt": "a"})
    (True, False)
    >>> asks_probabilities("/v1/chat/completions", {"logprobs": True}), asks_probabilities("/v1/chat/completions", {"logprobs": False})
    (True, False)
    """
    return requested_n_probs(endpoint, body) > 0


def upstream_request(endpoint: str, body: Mapping[str, Any]) -> tuple[dict, tuple[str, ...]]:
    """The body to send upstream (the client's, with `return_tokens` and, on the OpenAI endpoints,
    `verbose` where the client did not set them), and the fields added, in that order.

    >>> upstream_request("/v1/chat/completions", {"messages": [], "logprobs": True})[1]
    ('return_tokens', 'verbose')
    >>> upstream_request("/completion", {"prompt": "a", "return_tokens": False})
    ({'prompt': 'a', 'return_tokens': True}, ('return_tokens',))
    >>> upstream_request("/completion", {"prompt": "a", "return_tokens": True})[1]
    ()
    """
    out, added = dict(body), []
    if out.get("return_tokens") is not True:
        out["return_tokens"] = True
        added.append("return_tokens")
    if endpoint != COMPLETION and out.get("verbose") is not True:
        out["verbose"] = True
        added.append("verbose")
    return out, tuple(added)


def client_object(obj: Any, added: tuple[str, ...]) -> Any:
    """A response object or stream chunk as the client gets it: `tokens` emptied where the proxy asked for
    them, `__verbose` dropped where it asked for it; field order kept.

    >>> client_object({"content": "a", "tokens": [5], "stop": True}, ("return_tokens",))
    {'content': 'a', 'tokens': [], 'stop': True}
    >>> client_object({"choices": [], "__verbose": {"tokens": [5]}, "timings": {}}, ("return_tokens", "verbose"))
    {'choices': [], 'timings': {}}
    """
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        if k == "__verbose" and "verbose" in added:
            continue
        out[k] = [] if k == "tokens" and "return_tokens" in added and isinstance(v, list) else v
    return out


def client_event(data: str, added: tuple[str, ...]) -> str:
    """An SSE `data:` payload as the client gets it (client_object on its JSON; `[DONE]` and anything not
    a JSON object as it came), written as the server writes JSON (compact, UTF-8).

    >>> client_event('{"content":"é","tokens":[7]}', ("return_tokens",))
    '{"content":"é","tokens":[]}'
    >>> client_event("[DONE]", ("return_tokens",))
    '[DONE]'
    """
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if not isinstance(obj, dict):
        return data
    return json.dumps(client_object(obj, added), ensure_ascii=False, separators=(",", ":"))
