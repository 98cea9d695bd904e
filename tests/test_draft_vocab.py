"""The server drafts only with a draft model whose vocabulary matches the target's, token text by token
text from id 5 (common_speculative_are_compatible, common/speculative.cpp:106-174). Two files whose
token-text arrays are the same bytes match without reading every text through libllama (0.25 s on a
262k vocabulary); one differing text is still found, and named, as the server's check finds it."""
from __future__ import annotations

import struct

import pytest

import replay.loop.draft_model as draft_model
from replay.loop.draft_model import compatibility
from replay.paths import FIXTURES
from replay.runtime.gguf import vocab_digest
from replay.runtime.llama import Model

TARGET, DRAFT = FIXTURES / "tiny-target.gguf", FIXTURES / "tiny-draft.gguf"


@pytest.fixture(scope="module")
def target():
    m = Model(TARGET)
    yield m
    m.close()


def _one_text_changed(target: Model, token: int, path) -> None:
    """A copy of the target whose token `token` reads otherwise (one byte of its text, same length)."""
    from replay.runtime.binding import L  # (not at module level: pytest's collection would load libllama)
    raw = TARGET.read_bytes()
    text = L.llama_vocab_get_text(target.vocab, token)
    needle = struct.pack("<Q", len(text)) + text
    assert raw.count(needle) == 1, text
    at = raw.index(needle) + 8
    changed = bytearray(raw)
    changed[at] = ord("Q") if raw[at] != ord("Q") else ord("R")
    path.write_bytes(bytes(changed))


def test_files_with_the_same_token_texts_match_by_their_digest(target, monkeypatch):
    assert vocab_digest(TARGET) == vocab_digest(DRAFT) is not None
    assert vocab_digest(FIXTURES / "tiny-gemma3-target.gguf") != vocab_digest(TARGET)
    draft = Model(DRAFT)
    try:
        assert draft_model._compatibility(target, draft) is None
        monkeypatch.setattr(draft_model, "vocab_digest", lambda path: None)  # text by text, as the server reads
        assert draft_model._compatibility(target, draft) is None
    finally:
        draft.close()


def test_one_token_text_that_differs_is_found_and_named(target, tmp_path):
    other_path = tmp_path / "other.gguf"
    _one_text_changed(target, 6, other_path)  # the fixture has 8 tokens, a..h
    assert vocab_digest(other_path) != vocab_digest(TARGET)
    other = Model(other_path)
    try:
        assert compatibility(target, other) == "token 6 differs between the draft's vocabulary and the target's"
    finally:
        other.close()
