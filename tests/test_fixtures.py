"""Specification of the tiny GGUF fixtures in fixtures/ (see fixtures/make_tiny.py).

* The committed files are exactly what the generator produces.
* llama.cpp loads both models with an 8-token character vocabulary a..h:
  "bcdbc" tokenizes to [1, 2, 3, 1, 2] with no BOS and no space prefix,
  detokenizes back, and "h" (id 7) is the end-of-generation token.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
MODEL_FILES = ["tiny-target.gguf", "tiny-draft.gguf"]


def _load_make_tiny():
    spec = importlib.util.spec_from_file_location("make_tiny", FIXTURES / "make_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tiny = _load_make_tiny()


# --------------------------------------------------------------------------
# The generator is deterministic and the committed files are its output.
# --------------------------------------------------------------------------

def test_regenerating_gives_byte_identical_files(tmp_path):
    target, draft = make_tiny.generate(tmp_path)

    for fresh in (target, draft):
        committed = FIXTURES / fresh.name
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed.name} is stale: run `python fixtures/make_tiny.py`"
        )


def test_fixtures_are_tiny():
    for name in MODEL_FILES:
        assert (FIXTURES / name).stat().st_size <= 24 * 1024


# --------------------------------------------------------------------------
# llama.cpp sees the vocabulary we intend.
# --------------------------------------------------------------------------

_silent_log = None  # module-level so llama.cpp never calls a freed callback


@pytest.fixture(scope="module")
def lc():
    import llama_cpp  # a dependency (pyproject.toml): its absence is a broken install, not a skip
    llama_cpp.llama_backend_init()

    global _silent_log
    _silent_log = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p(0))
    return llama_cpp


@pytest.fixture(scope="module", params=MODEL_FILES)
def model(request, lc):
    params = lc.llama_model_default_params()
    m = lc.llama_model_load_from_file(str(FIXTURES / request.param).encode(), params)
    assert m, f"llama.cpp failed to load {request.param}"
    yield m
    lc.llama_model_free(m)


def tokenize(lc, vocab, text: str, add_special: bool = False) -> list[int]:
    data = text.encode()
    buf = (lc.llama_token * 64)()
    n = lc.llama_tokenize(vocab, data, len(data), buf, len(buf), add_special, False)
    assert n >= 0
    return list(buf[:n])


def piece(lc, vocab, token: int) -> str:
    buf = ctypes.create_string_buffer(16)
    n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    assert n >= 0
    return buf.raw[:n].decode()


def test_vocabulary_is_the_characters_a_to_h(lc, model):
    vocab = lc.llama_model_get_vocab(model)

    assert lc.llama_vocab_n_tokens(vocab) == 8
    assert [piece(lc, vocab, t) for t in range(8)] == list("abcdefgh")


def test_bcdbc_tokenizes_to_one_token_per_character(lc, model):
    vocab = lc.llama_model_get_vocab(model)

    assert tokenize(lc, vocab, "bcdbc") == [1, 2, 3, 1, 2]


def test_no_bos_is_added_even_with_add_special(lc, model):
    vocab = lc.llama_model_get_vocab(model)

    assert not lc.llama_vocab_get_add_bos(vocab)
    assert tokenize(lc, vocab, "bcdbc", add_special=True) == [1, 2, 3, 1, 2]


def test_bcdbc_detokenizes_back(lc, model):
    vocab = lc.llama_model_get_vocab(model)

    assert "".join(piece(lc, vocab, t) for t in [1, 2, 3, 1, 2]) == "bcdbc"


def test_h_is_eos_and_end_of_generation(lc, model):
    vocab = lc.llama_model_get_vocab(model)

    assert lc.llama_vocab_eos(vocab) == 7
    assert lc.llama_vocab_is_eog(vocab, 7)
    assert not any(lc.llama_vocab_is_eog(vocab, t) for t in range(7))


def test_decoding_bcdbc_gives_finite_logits(lc, model):
    params = lc.llama_context_default_params()
    params.n_ctx = 64
    params.n_threads = 1
    params.n_threads_batch = 1
    ctx = lc.llama_init_from_model(model, params)
    try:
        tokens = (lc.llama_token * 5)(1, 2, 3, 1, 2)
        assert lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, 5)) == 0
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(8,))
        assert np.all(np.isfinite(logits))
    finally:
        lc.llama_free(ctx)
