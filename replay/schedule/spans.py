"""Where the user messages of a chat prompt start, as llama-server finds them for its checkpoint cuts.

A chat request's prompt is rendered from its messages by the chat template; for a target that
checkpoints (schedule/prompt.py), the server also ends prompt batches before user messages. It
finds them by the template's user-start marker:

1. The marker: for a template the chat autoparser handles (common/chat.cpp:1337-1355), render no
   message and one user message (add_generation_prompt false) and take what the second adds
   before the message text, split into markers ("<...>", "[...]") and text, leading end markers
   and blank text dropped, trimmed (autoparser::detect_user_start_marker,
   common/chat-diff-analyzer.cpp:389-445, the diff of calculate_diff_split,
   common/chat-auto-parser-helpers.cpp:84-205). Some templates have it set by a workaround
   (chat-diff-analyzer.cpp:36-175). Templates with a specialized handler
   (common_chat_try_specialized_template, common/chat.cpp:1090-1229), the legacy (non-jinja) path and
   --skip-chat-parsing have none: those prompts are not cut at user messages.
2. The positions: the marker is tokenized (no BOS, special tokens parsed, common/chat.cpp:147-151)
   and every prompt position where its tokens occur starts a user message
   (common_chat_msg_delimiters::split, common/chat.cpp:153-185; with the assistant marker, which
   only ends spans, it is a delimiter: a position matching the assistant marker first is not a
   user start).

The markers only need the template's rendering; `render(messages)` is given by the caller
(tokens/prompt_ids.py renders with the transcript's template).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from replay.schedule.prompt import MessageSpans

# the autoparser's probe texts (common/chat-diff-analyzer.cpp:28-30)
USER_MSG = "U_USER_MSG Hello END_U"
USER_MSG_TWO = "V_USER_MSG Hello END_V"
ASSISTANT_MSG = "A_ASST_MSG I can help END_A"

# Templates handled by a specialized parser: no message delimiters (common/chat.cpp:1090-1229), as
# (name, substrings all present, substrings all absent), checked in the server's order
SPECIALIZED: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("Ministral 3", ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]"), ("[CALL_ID]",)),
    ("LLM-jp harmony", ("chat_format=llm-jp-harmony-v1",), ()),
    ("GPT-OSS", ("<|channel|>",), ()),
    ("Muse Glimmer", ("<atem:function_calls>", "<|eom|>"), ()),
    ("Functionary v3.2", (">>>all", ">>>${recipient}"), ()),
    ("Kimi K2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), ()),
    ("Kimi K3", ("<|open|>", "<|close|>", "<|end_of_msg|>"), ()),
    ("Ling 3", ("<role>ASSISTANT</role>", "<arg_key>"), ()),
    ("Cohere2 MoE", ("<|START_TEXT|>", "<|START_ACTION|>"), ()),
    ("LFM2", ("<|tool_list_start|>", "<|tool_list_end|>"), ()),
    ("LFM2.5", ("List of tools: [",), ("<|tool_list_start|>",)),
    ("GigaChat v3", ("<|role_sep|>", "<|message_sep|>"), ("<|function_call|>",)),
    ("MiniMax M3", ("]<]minimax[>[", "<tool_call>", "<invoke name="), ()),
    ("Gemma 4", ("'<|tool_call>call:'",), ()),
    ("MiniCPM5", ("Tool usage guidelines:", '<function name="', '<param name="'), ()),
    ("Qwen3-Coder", ("<tool_call>", "<function=", "<parameter="), ("'<tool_call><function=' ~ tool_call.name ~ '>'",)),
)

# user_start set by a workaround (chat-diff-analyzer.cpp:36-175), by the template text it keys on
USER_START_WORKAROUNDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"), "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>"),  # Command R+
    (("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOL_RESPONSE>"), "<SPECIAL_11>User"),  # Nemotron Nano v2
    (("{%- set system_prompt = '<|start_header_id|>' + 'system' + '<|end_header_id|>\\n\\n' + message['content'] "
      "| trim + '\\n' + system_prompt_suffix + '<|eot_id|>' -%}",), "<|start_header_id|>user<|end_header_id|>"),
    (("if not loop.last and '[BEGIN FINAL RESPONSE]' in asst_text",), "<|begin_user|>"),  # Apriel 1.6
)


def specialized(src: str) -> str | None:
    """The name of the specialized handler the server uses for template `src`, if any.

    >>> specialized("{{ '<|channel|>' }}"), specialized("{{ '<|im_start|>' }}")
    ('GPT-OSS', None)
    """
    for name, present, absent in SPECIALIZED:
        if all(p in src for p in present) and not any(a in src for a in absent):
            return name
    return None


@dataclass(frozen=True)
class Segment:
    marker: bool
    value: str


def segments(text: str) -> list[Segment]:
    """segmentize_markers: "<...>" and "[...]" are markers, the rest text (chat-auto-parser-helpers.cpp:266-300).

    >>> [(s.marker, s.value) for s in segments("<|im_start|>user\\n")]
    [(True, '<|im_start|>'), (False, 'user\\n')]
    """
    out: list[Segment] = []
    opener, last = "", 0
    for i, ch in enumerate(text):
        if not opener and ch in "<[":
            if last < i:
                out.append(Segment(False, text[last:i]))
            last, opener = i, ch
        elif opener and ((opener == "<" and ch == ">") or (opener == "[" and ch == "]")):
            out.append(Segment(True, text[last:i + 1]))
            last, opener = i + 1, ""
    if last < len(text):
        out.append(Segment(False, text[last:]))
    return out


def _ctrim(s: str) -> str:
    """trim_whitespace: C isspace (space, \\t, \\n, \\v, \\f, \\r) at both ends."""
    return s.strip(" \t\n\v\f\r")


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _common_suffix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def diff_right(left: str, right: str) -> str:
    """What `right` has that `left` has not: calculate_diff_split's `right`
    (chat-auto-parser-helpers.cpp:84-205), segment by segment from both ends, then by characters
    where both remainders start (end) with text.

    >>> diff_right("", "<|im_start|>user\\nHi<|im_end|>\\n")
    '<|im_start|>user\\nHi<|im_end|>\\n'
    >>> diff_right("<a>x</a>", "<a>x</a><b>y</b>")
    '<b>y</b>'
    """
    ls, rs = segments(left), segments(right)
    if not ls:
        return right
    if not rs:
        return ""
    l0, l1, r0, r1 = 0, len(ls) - 1, 0, len(rs) - 1
    left_done = right_done = False
    while l0 != l1 and r0 != r1:
        advanced = False
        if ls[l0] == rs[r0]:
            l0, r0, advanced = l0 + 1, r0 + 1, True
        if ls[l1] == rs[r1]:
            if l0 != l1:
                l1 -= 1
            else:
                left_done = True
            if r0 != r1:
                r1 -= 1
            else:
                right_done = True
            advanced = True
        if not advanced:
            break
    if l0 == l1 and r0 != r1:
        if ls[l0] == rs[r1]:
            r1 -= 1
            left_done = True
        elif ls[l0] == rs[r0]:
            r0 += 1
            left_done = True
    elif r0 == r1 and l0 != l1:
        if ls[l1] == rs[r0]:
            l1 -= 1
            right_done = True
        elif ls[l0] == rs[r0]:
            l0 += 1
            right_done = True
    elif l0 == l1 and r0 == r1 and ls[l0] == rs[r0] and ls[l0].marker:
        left_done = right_done = True
    text_suffix = not ls[l1].marker and not rs[r1].marker
    text_prefix = not rs[r0].marker and not ls[l0].marker
    rem_l = "".join(s.value for s in ls[l0:(l1 if left_done else l1 + 1)])
    rem_r = "".join(s.value for s in rs[r0:(r1 if right_done else r1 + 1)])
    suf = _common_suffix_len(rem_l, rem_r) if text_suffix else 0
    pre = _common_prefix_len(rem_l[:len(rem_l) - suf], rem_r[:len(rem_r) - suf]) if text_prefix else 0
    out_l = rem_l[pre:len(rem_l) - suf]
    out_r = rem_r[pre:len(rem_r) - suf]
    if out_l == "" and out_r != "" and len(left) <= len(right) and right.startswith(left):
        return right[len(left):]
    return out_r


Render = Callable[[list[dict]], "str | None"]  # messages -> rendered text (add_generation_prompt false), None on error


def user_start_marker(src: str, render: Render) -> str:
    """The user-start delimiter the server derives from template `src` ("" when it has none).

    >>> chatml = lambda ms: "".join(f"<|im_start|>{m['role']}\\n{m['content']}<|im_end|>\\n" for m in ms)
    >>> user_start_marker("<|im_start|>", chatml)
    '<|im_start|>user'
    """
    if specialized(src):
        return ""
    marker = ""
    a, b = render([]), render([{"role": "user", "content": USER_MSG}])
    if a is None or b is None:
        a = render([{"role": "user", "content": USER_MSG_TWO}, {"role": "assistant", "content": ASSISTANT_MSG}])
        b = render([{"role": "user", "content": USER_MSG_TWO}, {"role": "assistant", "content": ASSISTANT_MSG},
                    {"role": "user", "content": USER_MSG}])
    if a is not None and b is not None:
        usermsg = diff_right(a, b)
        if ASSISTANT_MSG in usermsg:
            usermsg = usermsg[usermsg.index(ASSISTANT_MSG) + len(ASSISTANT_MSG):]
        cut = usermsg.find(USER_MSG)
        candidate = usermsg if cut < 0 else usermsg[:cut]
        out, seen_marker = [], False
        for seg in segments(candidate):
            low = seg.value.lower()
            if seg.marker and not seen_marker and ("end" in low or "close" in low):
                continue
            if not seg.marker and not seen_marker and not _ctrim(seg.value):
                continue
            seen_marker |= seg.marker
            out.append(seg.value)
        marker = _ctrim("".join(out))
    for needles, start in USER_START_WORKAROUNDS:  # applied after the analysis (chat-diff-analyzer.cpp:267-269)
        if all(n in src for n in needles):
            marker = start
    return marker


# assistant_start set by a workaround (chat-diff-analyzer.cpp:36-175)
ASSISTANT_START_WORKAROUNDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (USER_START_WORKAROUNDS[1][0], "<SPECIAL_11>Assistant"),  # Nemotron Nano v2
    (USER_START_WORKAROUNDS[2][0], "<|start_header_id|>assistant<|end_header_id|>"),  # Fireworks v2
    (("<|begin|>assistant<|think|><|end|>",), "<|begin|>assistant"),  # Solar Open
    (USER_START_WORKAROUNDS[3][0], "<|begin_assistant|>"),  # Apriel 1.6
)


def assistant_start_marker(src: str, render: Render) -> str:
    """The assistant-start delimiter (autoparser::detect_assistant_start_marker, chat-diff-analyzer.cpp:
    352-387): what an assistant message adds after a user message, before its text, trimmed. The
    reasoning markers it also cuts at are not looked for (templates that render reasoning tags
    before the content are not covered).

    >>> chatml = lambda ms: "".join(f"<|im_start|>{m['role']}\\n{m['content']}<|im_end|>\\n" for m in ms)
    >>> assistant_start_marker("<|im_start|>", chatml)
    '<|im_start|>assistant'
    """
    if specialized(src):
        return ""
    user = {"role": "user", "content": USER_MSG}
    a, b = render([user]), render([user, {"role": "assistant", "content": ASSISTANT_MSG}])
    marker = ""
    if a is not None and b is not None:
        right = diff_right(a, b)
        cut = right.find(ASSISTANT_MSG)
        marker = _ctrim(right if cut < 0 else right[:cut])
    for needles, start in ASSISTANT_START_WORKAROUNDS:
        if all(n in src for n in needles):
            marker = start
    return marker


def user_starts(tokens: Sequence[int], user: Sequence[int], assistant: Sequence[int] = ()) -> MessageSpans:
    """The positions where `user` (the tokenized marker) occurs in `tokens`, scanning as
    common_chat_msg_delimiters::split does: the assistant delimiter is tried first when the autoparser
    found one (it is added first, common/chat.cpp:1348-1353), the scan moves one token at a time.

    >>> user_starts([9, 1, 2, 5, 1, 2, 7], [1, 2]).user_starts
    (1, 4)
    """
    out = []
    delims = [(False, list(assistant)), (True, list(user))]
    for i in range(len(tokens)):
        for is_user, d in delims:
            if d and i + len(d) <= len(tokens) and list(tokens[i:i + len(d)]) == d:
                if is_user:
                    out.append(i)
                break
    return MessageSpans(tuple(out))
