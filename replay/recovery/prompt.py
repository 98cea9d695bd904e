"""The prompt token ids the server evaluated, recorded or rebuilt.

Recorded ids (our transcripts, a pair's `prompt_tokens`) are used as they are.
Otherwise they are rebuilt as the server builds them: a text prompt is
tokenized with add_special=true, parse_special=true
(tools/server/server-context.cpp:4650); a chat request is first rendered
with the GGUF's chat template (add_generation_prompt, the model's bos/eos
strings). Either way the count is checked against what the server reported
(`usage.prompt_tokens` / `tokens_evaluated`), and a disagreement is an error:
a replay from the wrong prompt would be silently wrong.
"""
from __future__ import annotations

from ..errors import TranscriptError
from ..runtime.llama import Model
from ..transcripts.entries import n_prompt
from ..transcripts.readers import CHAT, Record


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


def render_chat(rec: Record, model: Model) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    tmpl = model.chat_template()
    if not tmpl:
        raise TranscriptError(f"{model.path.name} has no chat template to rebuild the prompt from",
                              source=rec.source, record=rec.index)
    bos = model.piece(model.bos).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.piece(model.eos).decode("utf-8", "replace") if model.eos >= 0 else ""
    fmt = Jinja2ChatFormatter(template=tmpl, eos_token=eos, bos_token=bos, add_generation_prompt=True)
    try:
        return fmt(messages=rec.request["messages"], tools=rec.request.get("tools")).prompt
    except Exception as e:  # jinja2 raises many types for bad templates/messages
        raise TranscriptError(f"could not render the chat template: {e}", source=rec.source,
                              record=rec.index) from e
