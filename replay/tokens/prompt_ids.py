"""The prompt token ids the server evaluated, recorded or rebuilt.

Recorded ids (our transcripts, a pair's `prompt_tokens`) are used as they are.
Otherwise they are rebuilt as the server builds them: a text prompt is
tokenized with add_special=true, parse_special=true
(tools/server/server-context.cpp:4650); a chat request is first rendered
with the GGUF's chat template (add_generation_prompt, the model's bos/eos
strings). Either way the count is checked against what the server reported
(`usage.prompt_tokens` / `tokens_evaluated`), and a disagreement is an error:
a replay from the wrong prompt would be silently wrong.

A model file without a chat template gets the server's own fallback, ChatML
(common_chat_templates_init, common/chat.cpp:760-786: CHATML_TEMPLATE_SRC, :715-721).
`message_spans` finds where the prompt's user messages start, for the batch cuts of a
target that checkpoints (schedule/spans.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from replay.errors import ModelError, TranscriptError
from replay.runtime.llama import Model
from replay.schedule.prompt import NO_SPANS, MessageSpans
from replay.schedule.spans import assistant_start_marker, user_start_marker, user_starts
from replay.settings.table import CHAT_TEMPLATE_FLAGS
from replay.transcripts.entries import n_prompt
from replay.transcripts.readers import CHAT, Record

if TYPE_CHECKING:
    from replay.tokens.server_view import ServerView

# llama-server's template for a model file that has none: each message as
# <|im_start|>ROLE\nCONTENT<|im_end|>\n, then <|im_start|>assistant\n for the generation prompt
# (CHATML_TEMPLATE_SRC, common/chat.cpp:715-721; the same text, written here in Jinja)
CHATML_FALLBACK = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
                   "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def prompt_ids(rec: Record, model: Model, view: "ServerView | None" = None) -> list[int]:
    """The prompt's ids: recorded, else rebuilt (by the server's own request parsing when `view` has
    it: tokens/server_view.py), and checked against the count the server reported."""
    ids = rec.prompt_ids
    how = "recorded prompt_tokens"
    if ids is None and view is not None and view.prompt is not None:
        ids, how = server_tokens(model, view.prompt), f"prompt rendered by {view.source}"
    if ids is None:
        ids, how = rebuild(rec, model)
    reported = n_prompt(rec.endpoint, rec.final())
    if reported is not None and reported != len(ids):
        raise TranscriptError(f"the server evaluated {reported} prompt tokens but the {how} have {len(ids)}; "
                              "record with `spec-replay record` to keep the exact ids", source=rec.source, record=rec.index)
    bad = next((t for t in ids if not 0 <= t < model.n_vocab), None)
    if bad is not None:  # libllama would abort on it
        raise ModelError(f"prompt token id {bad} is outside {model.path.name}'s vocabulary ({model.n_vocab} "
                         "tokens): the transcript comes from another model")
    return ids


def server_tokens(model: Model, prompt: str) -> list[int]:
    """A prompt string tokenized as the server does (tokenize_input_prompts(..., add_special=true,
    parse_special=true), tools/server/server-context.cpp:4650)."""
    return model.tokenize(prompt, add_special=True, parse_special=True)


def rebuild(rec: Record, model: Model) -> tuple[list[int], str]:
    if rec.endpoint == CHAT:
        text = render_chat(rec, model)
        return model.tokenize(text, add_special=True, parse_special=True), "chat-template rendering"
    p = rec.request.get("prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return list(p), "request's token ids"
    if isinstance(p, str):
        return model.tokenize(p, add_special=True, parse_special=True), "tokenized prompt"
    raise TranscriptError("the request has no single prompt (a string or a list of ids)", source=rec.source,
                          record=rec.index)


def chat_template(rec: Record, model: Model) -> str:
    """The template the server rendered a chat request with: the one its /props reported, else the
    model file's, else the server's ChatML fallback."""
    reported = (rec.props or {}).get("chat_template")
    if isinstance(reported, str) and reported:
        return reported
    return model.chat_template() or CHATML_FALLBACK


def _formatter(tmpl: str, model: Model, add_generation_prompt: bool):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    bos = model.piece(model.bos).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.piece(model.eos).decode("utf-8", "replace") if model.eos >= 0 else ""
    return Jinja2ChatFormatter(template=tmpl, eos_token=eos, bos_token=bos, add_generation_prompt=add_generation_prompt)


# what the server's chat path adds that a plain Jinja rendering of the messages does not reproduce
# (tools/server/server-common.cpp:1396-1421, common/chat.cpp:1080-1089, 1299-1302)
_DATED = ("strftime_now", "datetime", "date_string")


def unrebuildable(rec: Record, template: str) -> str | None:
    """Why this chat request's prompt cannot be rebuilt from its messages exactly as the server
    rendered it, or None: template kwargs and reasoning_effort (they become template variables and
    thinking switches), a template that reads the date (the server passes the day it ran), or flags
    that chose another template or renderer.

    >>> from replay.transcripts.readers import Record
    >>> r = Record(source="t", index=0, endpoint="/v1/chat/completions", request={"messages": [],
    ...            "chat_template_kwargs": {"enable_thinking": False}}, response={}, stream=False)
    >>> unrebuildable(r, "{{ messages }}")
    'the request sets "chat_template_kwargs"'
    """
    for key in ("chat_template_kwargs", "reasoning_effort"):
        if rec.request.get(key) not in (None, {}, ""):
            return f"the request sets \"{key}\""
    flag = next((f for f in CHAT_TEMPLATE_FLAGS if f in (rec.flags or {}) and f != "--jinja"), None)
    if flag is not None:
        return f"the server was started with {flag}"
    dated = next((w for w in _DATED if w in template), None)
    if dated is not None:
        return f"the chat template reads the date ({dated}), which the server took on the day it ran"
    return None


def render_chat(rec: Record, model: Model) -> str:
    tmpl = chat_template(rec, model)
    why = unrebuildable(rec, tmpl)
    if why is not None:
        raise TranscriptError(f"the chat prompt cannot be rebuilt from its messages exactly as the server rendered it: "
                              f"{why}; record with `spec-replay record` to keep the prompt's token ids",
                              source=rec.source, record=rec.index)
    fmt = _formatter(tmpl, model, True)
    try:
        return fmt(messages=rec.request["messages"], tools=rec.request.get("tools")).prompt
    except Exception as e:  # jinja2 raises many types for bad templates/messages
        raise TranscriptError(f"could not render the chat template: {e}", source=rec.source,
                              record=rec.index) from e


def message_spans(rec: Record, model: Model, prompt: Sequence[int]) -> MessageSpans:
    """Where the prompt's user messages start, as the server found them: from the chat template's
    user-start marker for a chat request (schedule/spans.py), from the request's own
    `message_delimiters` for the others (server-context.cpp:4655-4672); none without either."""
    if rec.endpoint == CHAT:
        tmpl = chat_template(rec, model)
        fmt = _formatter(tmpl, model, False)

        def render(messages: list[dict]) -> str | None:
            try:
                return fmt(messages=messages).prompt
            except Exception:  # the server's apply_template returns its error marker (chat-auto-parser-helpers.cpp:313-328)
                return None
        marker = user_start_marker(tmpl, render)
        if not marker:
            return NO_SPANS
        asst = assistant_start_marker(tmpl, render)
        return user_starts(prompt, model.tokenize(marker, add_special=False, parse_special=True),
                           model.tokenize(asst, add_special=False, parse_special=True) if asst else ())
    delims = rec.request.get("message_delimiters")
    if not isinstance(delims, list):
        return NO_SPANS
    user = next((d.get("delimiter") for d in delims if isinstance(d, dict) and d.get("role") == "user"), None)
    assistant = next((d.get("delimiter") for d in delims if isinstance(d, dict) and d.get("role") == "assistant"), None)
    if not isinstance(user, str) or not user:
        return NO_SPANS
    return user_starts(prompt, model.tokenize(user, add_special=False, parse_special=True),
                       model.tokenize(assistant, add_special=False, parse_special=True)
                       if isinstance(assistant, str) and assistant else ())
