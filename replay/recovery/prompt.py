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

from typing import Sequence

from ..errors import TranscriptError
from ..runtime.llama import Model
from ..schedule.prompt import NO_SPANS, MessageSpans
from ..schedule.spans import assistant_start_marker, user_start_marker, user_starts
from ..transcripts.entries import n_prompt
from ..transcripts.readers import CHAT, Record

# llama-server's template for a model file that has none: each message as
# <|im_start|>ROLE\nCONTENT<|im_end|>\n, then <|im_start|>assistant\n for the generation prompt
# (CHATML_TEMPLATE_SRC, common/chat.cpp:715-721; the same text, written here in Jinja)
CHATML_FALLBACK = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
                   "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def prompt_ids(rec: Record, model: Model) -> list[int]:
    ids = rec.prompt_ids
    how = "recorded prompt_tokens"
    if ids is None:
        ids, how = rebuild(rec, model)
    reported = n_prompt(rec.endpoint, rec.final())
    if reported is not None and reported != len(ids):
        raise TranscriptError(f"the server evaluated {reported} prompt tokens but the {how} have {len(ids)}; "
                              "record with `spec-replay record` to keep the exact ids", source=rec.source, record=rec.index)
    return ids


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


def render_chat(rec: Record, model: Model) -> str:
    fmt = _formatter(chat_template(rec, model), model, True)
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
