"""The n-gram drafters, on token sequences whose answers can be read off (loop/drafters.py).

Each drafter sees `inp` (the tokens in the target's KV), the last sampled token and the step's
n_max, and proposes what followed an earlier occurrence of the current context. Their exact
agreement with llama-server is proven live (tests/test_trace_live.py, 20 seeds each); these
pin the rules themselves.
"""
from __future__ import annotations

import pytest

from replay.loop.drafters import (
    DRAFTERS,
    NgramCache,
    NgramMap,
    NgramMod,
    NgramSimple,
    make_drafters,
)
from replay.loop.replayable import PRIORITY
from replay.loop.state import SlotState
from replay.settings import resolve

CYCLE = [1, 2, 3, 4, 5]


# --- ngram-simple --------------------------------------------------------------------------

def test_ngram_simple_copies_what_followed_the_last_earlier_match():
    # the current 2-gram is [1, 2] (inp's last token + the sampled one); it last occurred at 4
    assert NgramSimple(size_n=2, size_m=3).draft([1, 2, 3, 4, 1, 2, 3, 4, 1], 2, n_max=10) == [3, 4, 1]


def test_ngram_simple_needs_n_plus_m_plus_two_tokens():
    assert NgramSimple(size_n=2, size_m=3).draft([1, 2, 3, 1, 2, 3], 1, n_max=10) == []


def test_ngram_simple_never_matches_at_position_0():
    # [9, 1] occurs only at the very start, which upstream's search never checks (ngram-map.cpp:85)
    assert NgramSimple(size_n=2, size_m=2).draft([9, 1, 5, 6, 7, 8, 9], 1, n_max=10) == []


# --- ngram-mod -----------------------------------------------------------------------------

def test_ngram_mod_follows_the_table_it_learned_from_the_prompt():
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    mod = NgramMod(n_match=2, n_max=4, n_min=2)
    mod.begin(prompt)
    # window [6, 7] -> 5, [7, 5] -> 6, [5, 6] -> 7, [6, 7] -> 5: four tokens, n_max
    assert mod.draft(prompt, 7, n_max=10) == [5, 6, 7, 5]


def test_ngram_mod_drafts_nothing_shorter_than_n_min():
    mod = NgramMod(n_match=2, n_max=8, n_min=4)
    mod.begin([1, 2, 3])
    assert mod.draft([1, 2, 3], 9, n_max=10) == []  # [3, 9] was never seen


def test_ngram_mod_forgets_its_table_after_five_poor_steps():
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    mod = NgramMod(n_match=2, n_max=4, n_min=2)
    mod.begin(prompt)
    for _ in range(5):
        assert mod.draft(prompt, 7, n_max=10)
        mod.accept(0)  # accepted 0 of 4 < 25%
    assert mod.entries == {} and mod.draft(prompt, 7, n_max=10) == []


# --- ngram-map-k / k4v ---------------------------------------------------------------------

@pytest.mark.parametrize("key_only", [True, False], ids=["map-k", "map-k4v"])
def test_ngram_map_drafts_the_continuation_of_the_matched_key(key_only):
    seq = CYCLE * 4
    drafter = NgramMap(key_only, size_n=2, size_m=3, min_hits=1)
    drafter.begin(seq[:12])
    # key [4, 5] (inp's last token + the sampled 5) was followed by 1, 2, 3 before
    assert drafter.draft(seq[:14], seq[14], n_max=10) == seq[15:18] == [1, 2, 3]


def test_ngram_map_needs_two_keys_and_a_value_of_context():
    drafter = NgramMap(True, size_n=2, size_m=3)
    drafter.begin(CYCLE)
    assert drafter.draft(CYCLE, 1, n_max=10) == []  # 5 tokens < 2 * 2 + 3


def test_ngram_map_k_drafts_as_many_tokens_as_were_last_accepted():
    seq = CYCLE * 6
    drafter = NgramMap(True, size_n=2, size_m=3)
    drafter.begin(seq[:12])
    assert len(drafter.draft(seq[:14], seq[14], n_max=10)) == 3
    drafter.accept(1)
    assert drafter.draft(seq[:19], seq[19], n_max=10) == [1]



def _k4v_after(blocks: list[list[int]]) -> list[int]:
    """k4v's draft for the key [1, 2] after a text where it was followed by each of `blocks` in turn."""
    seq: list[int] = []
    for i, b in enumerate(blocks):
        seq += [1, 2] + b + [20 + i, 30 + i]
    drafter = NgramMap(False, size_n=2, size_m=3, min_hits=1)
    drafter.begin(seq[:5])
    return drafter.draft(seq + [1], 2, n_max=10)


def test_ngram_map_k4v_drafts_only_when_one_continuation_occurs_twice_as_often_as_the_others():
    a, b = [7, 8, 9], [6, 5, 4]
    assert _k4v_after([a, b]) == [] and _k4v_after([a, b, a, b]) == []  # no continuation dominates
    # A dominates two to one, and what is drafted is the matched (latest) occurrence's continuation,
    # B, as upstream does (common/ngram-map.cpp:503-507)
    assert _k4v_after([a, a, b]) == b

# --- ngram-cache ---------------------------------------------------------------------------

def test_ngram_cache_chains_its_most_frequent_continuations_up_to_eight_tokens():
    seq = CYCLE * 3
    assert NgramCache().draft(seq[:-1], seq[-1], n_max=16) == [1, 2, 3, 4, 5, 1, 2, 3]


def test_ngram_cache_drafts_nothing_from_a_context_it_has_not_seen_twice():
    assert NgramCache().draft([1, 2, 3], 4, n_max=16) == []


# --- the factory ---------------------------------------------------------------------------

def test_every_replayable_type_has_a_factory_entry_in_priority_order():
    assert list(DRAFTERS) == sorted(DRAFTERS, key=PRIORITY.index)
    assert set(DRAFTERS) == set(PRIORITY)


def test_drafters_come_in_the_servers_priority_order_with_the_flags_values():
    spec = resolve("speculative", flags={"spec_types": ("ngram-mod", "ngram-simple"), "ngram_mod_n_match": 7,
                                         "ngram_simple_size_n": 3})
    simple, mod = make_drafters(spec)
    assert (simple.name, simple.n) == ("ngram-simple", 3)
    assert (mod.name, mod.n) == ("ngram-mod", 7)


def test_stateful_drafters_outlive_a_request_in_the_slots_state():
    spec = resolve("speculative", flags={"spec_types": ("ngram-mod", "ngram-map-k", "ngram-simple")})
    state = SlotState()
    first, second = make_drafters(spec, state=state), make_drafters(spec, state=state)
    kept = {d.name for a, d in zip(first, second) if a is d}
    assert kept == {"ngram-mod", "ngram-map-k"}  # ngram-simple is stateless: a new one per request
    # ngram-mod's table is the server's, the map the slot's (DrafterKind.scope)
    assert set(state.server.drafters) == {"ngram-mod"} and set(state.drafters) == {"ngram-map-k"}
    other = make_drafters(spec, state=SlotState(state.server))  # another slot of the same server
    assert {d.name for a, d in zip(first, other) if a is d} == {"ngram-mod"}
