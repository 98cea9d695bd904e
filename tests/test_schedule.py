"""The server's prompt schedule for targets that checkpoint (schedule/prompt.py, schedule/spans.py):
where b11434 cuts prompt batches, where it saves checkpoints, what a new request keeps, and where a
chat prompt's user messages start. Pure: the rules as tools/server/server-context.cpp:3442-3905 and
common/chat*.cpp state them. That these are the server's batches is proven on real servers in
test_gemma.py (values within 5e-4 only with these cuts)."""
from __future__ import annotations

import pytest

from replay.builds.prompt_rules import rules_of_build
from replay.schedule.prompt import (
    CheckpointRules,
    Mark,
    MessageSpans,
    next_batch,
    plan_reuse,
    prompt_batches,
    with_checkpoint,
)
from replay.schedule.spans import assistant_start_marker, diff_right, specialized, user_start_marker, user_starts

ON, OFF = CheckpointRules(True), CheckpointRules(False)


def cuts(n, **kw):
    return [(b.start, b.end, b.checkpoint) for b in prompt_batches(n, n_batch=kw.pop("n_batch", 2048),
                                                                   n_ubatch=kw.pop("n_ubatch", 512), **kw)]


def test_a_model_that_can_drop_a_suffix_gets_one_batch_per_n_batch():
    assert cuts(821, rules=OFF) == [(0, 821, False)]
    assert cuts(5000, rules=OFF) == [(0, 2048, False), (2048, 4096, False), (4096, 5000, False)]


def test_the_last_4_plus_n_ubatch_and_the_last_4_tokens_go_in_batches_of_their_own():
    assert cuts(821, rules=ON) == [(0, 305, False), (305, 817, True), (817, 821, True)]


def test_the_first_batch_takes_no_checkpoint_because_the_memory_is_empty():
    assert cuts(100, rules=ON) == [(0, 96, False), (96, 100, True)]


@pytest.mark.parametrize("n, expected", [
    (1, [(0, 1, False)]), (4, [(0, 4, False)]),  # nothing can be cut off
    (5, [(0, 1, False), (1, 5, True)]),
    (516, [(0, 512, False), (512, 516, True)]),  # n - 516 = 0: no first cut
    (517, [(0, 1, False), (1, 513, True), (513, 517, True)]),
])
def test_short_prompts(n, expected):
    assert cuts(n, rules=ON) == expected


def test_a_long_prompt_fills_n_batch_first_and_is_cut_near_its_end():
    assert cuts(3000, rules=ON) == [(0, 2048, False), (2048, 2484, False), (2484, 2996, True), (2996, 3000, True)]


def test_the_cuts_are_bounded_by_n_batch():
    # -b 256 -ub 256: min(n_batch, 4 + n_ubatch) = 256
    assert cuts(600, rules=ON, n_batch=256, n_ubatch=256) == [(0, 256, False), (256, 344, False),
                                                             (344, 596, True), (596, 600, True)]


def test_a_chat_prompt_is_cut_before_its_last_user_message_and_checkpointed_there():
    spans = MessageSpans((1, 40))  # a system message at 1.., the user message at 40
    assert cuts(100, rules=ON, spans=spans) == [(0, 1, False), (1, 40, True), (40, 96, True), (96, 100, True)]


def test_earlier_user_messages_break_only_once_min_step_past_the_last_checkpoint():
    spans = MessageSpans((10, 20, 25, 30))
    # no checkpoint yet while the second batch fills: it breaks at 20; the third, with one at 10,
    # runs past 25 (within 8192 of it) to the last user message
    assert cuts(60, rules=ON, spans=spans) == [(0, 10, False), (10, 20, True), (20, 30, True), (30, 56, True),
                                               (56, 60, True)]
    small = CheckpointRules(True, min_step=5)
    assert cuts(60, rules=small, spans=spans) == [(0, 10, False), (10, 20, True), (20, 25, True), (25, 30, True),
                                                 (30, 56, True), (56, 60, True)]


@pytest.mark.parametrize("build, expected", [
    # gated (b9940..): no checkpoint yet at 10, the last user message at 40; near the end, whatever the spacing
    (11434, [(0, 10, False), (10, 40, True), (40, 96, True), (96, 100, True)]),
    # every user start (b9771..b9934); the last batch is within min-step of the checkpoint at 40 (no near-end gate)
    (9800, [(0, 10, False), (10, 40, True), (40, 96, True), (96, 100, False)]),
    (9400, [(0, 40, False), (40, 96, True), (96, 100, False)]),  # the last user message (b9310..b9763)
    (9200, [(0, 96, False), (96, 100, True)]),  # none (..b9305)
])
def test_user_message_breaks_by_build(build, expected):
    assert cuts(100, rules=CheckpointRules(True, build=rules_of_build(build)), spans=MessageSpans((10, 40))) == expected


def test_in_b9771_to_b9934_every_user_start_cuts_even_a_model_that_does_not_checkpoint():
    every = CheckpointRules(False, build=rules_of_build(9800))
    assert every.user_breaks and cuts(100, rules=every, spans=MessageSpans((10, 40))) == [
        (0, 10, False), (10, 40, False), (40, 100, False)]
    assert not CheckpointRules(False).user_breaks


def test_other_slots_tokens_fill_the_batch_first():
    b = next_batch(3000, 0, n_batch=2048, n_ubatch=512, rules=ON, memory_empty=True, batch_used=48)
    assert (b.start, b.end) == (0, 2000)


def test_the_checkpoint_list_keeps_at_most_n_ctx_checkpoints():
    ck = [Mark(n, task=1) for n in (100, 200, 300)]
    kept = with_checkpoint(ck, Mark(400, task=2), n_max=3, min_step=8192)
    # full: another request's checkpoint within min_step of an earlier kept one goes first
    assert [c.n_tokens for c in kept] == [100, 400]
    # the same request's own checkpoints are never thinned: the oldest goes
    assert [c.n_tokens for c in with_checkpoint(ck, Mark(400, task=1), n_max=3, min_step=8192)] == [200, 300, 400]
    assert [c.n_tokens for c in with_checkpoint(ck, Mark(300, task=2), n_max=32, min_step=0)] == [100, 200, 300]
    assert with_checkpoint(ck, Mark(300, task=2), n_max=32, min_step=0)[-1].task == 2  # superseded


def test_a_request_extending_the_last_one_restores_its_checkpoint_when_the_window_lost_cells():
    ck = [Mark(305, pos_min=0, pos_max=304), Mark(817, pos_min=305, pos_max=816)]
    prev = list(range(821)) + list(range(1000, 1100))  # the last prompt and its reply
    # 920 shared; the window needs positions from 920 - 512 = 408 on
    r = plan_reuse(prev + [7, 8], prev[:-1], ck, cache_prompt=True, pos_min=300, n_swa=512)
    assert (r.n_past, r.restore) == (920, None)  # the memory still holds them
    r = plan_reuse(prev + [7, 8], prev[:-1], ck, cache_prompt=True, pos_min=408, n_swa=512)
    assert (r.n_past, r.restore.n_tokens) == (816, 817)  # at the threshold already: back to the checkpoint


def test_no_usable_checkpoint_means_the_whole_prompt_again():
    ck = [Mark(817, pos_min=500, pos_max=816)]  # its window starts after the threshold (338)
    r = plan_reuse(list(range(900)), list(range(850)), ck, cache_prompt=True, pos_min=400, n_swa=512)
    assert (r.n_past, r.restore, r.checkpoints) == (0, None, ())


def test_a_recurrent_memory_keeps_what_its_last_state_covers():
    r = plan_reuse(list(range(900)), list(range(850)), [], cache_prompt=True, pos_min=849, n_swa=0)
    assert r.n_past == 850


def test_without_cache_prompt_nothing_is_kept_and_the_checkpoints_go():
    ck = [Mark(305, pos_min=0, pos_max=304)]
    r = plan_reuse(list(range(400)), list(range(400)), ck, cache_prompt=False, pos_min=0, n_swa=512)
    assert (r.n_past, r.checkpoints) == (0, ())


def test_a_repeated_prompt_evaluates_its_last_token_again():
    r = plan_reuse([1, 2, 3], [1, 2, 3, 4], [], cache_prompt=True, pos_min=0, n_swa=0)
    assert r.n_past == 2


# --- where user messages start ------------------------------------------------------------------

def chatml(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def llama3(messages):
    return "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)


def gemma(messages):
    if not messages:
        return None  # a template that raises on no messages: the analysis takes its second variant
    return "".join(f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n{m['content']}"
                   "<end_of_turn>\n" for m in messages)


@pytest.mark.parametrize("render, user, assistant", [
    (chatml, "<|im_start|>user", "<|im_start|>assistant"),
    (llama3, "<|start_header_id|>user<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    (gemma, "<start_of_turn>user", "<start_of_turn>model"),
])
def test_the_user_start_marker_is_what_a_user_message_adds_before_its_text(render, user, assistant):
    assert user_start_marker("", render) == user
    assert assistant_start_marker("", render) == assistant


def test_templates_with_a_specialized_parser_have_no_markers():
    assert specialized("... <|channel|> ...") == "GPT-OSS"
    assert user_start_marker("... <|channel|> ...", chatml) == ""


def test_the_diff_is_taken_segment_by_segment():
    assert diff_right("<a>x</a>", "<a>x</a><b>y</b>") == "<b>y</b>"
    assert diff_right("", "abc") == "abc"


def test_user_starts_are_every_position_where_the_marker_tokens_occur():
    assert user_starts([1, 5, 6, 9, 5, 6, 9, 5, 7], [5, 6]).user_starts == (1, 4)
    # the assistant delimiter is tried first at each position
    assert user_starts([5, 6, 5, 7], [5], [5, 6]).user_starts == (2,)
