"""recover starts loading the loop's draft model beside the target (commands/trace.py Drafts.prefetch;
commands/recover.py _loop_drafts): two models then load at once, each in its own thread, and each must
still learn from its own load log which extra buffer types its weights took (runtime/llama.py: a
thread's own capture), since that decides whether a replay computes as the server did with or without
--no-repack. Real loads of the tiny fixtures."""
from __future__ import annotations

import pytest

from replay.commands.recover import _loop_drafts
from replay.commands.trace import Drafts
from replay.errors import ModelError
from replay.paths import FIXTURES
from replay.runtime.llama import Model
from replay.transcripts.readers import read_file

REPACKED, PLAIN = FIXTURES / "tiny-gemma3-q4_0-target.gguf", FIXTURES / "tiny-gemma3-target.gguf"


def test_two_models_loading_at_once_each_read_their_own_load_log():
    with Model(REPACKED) as m:
        alone = m.buffers
    if not alone:
        pytest.skip("Q4_0 weights take no extra buffer type on this host: the logs could not tell the loads apart")
    for _ in range(3):
        drafts = Drafts()
        drafts.prefetch(str(PLAIN))
        with Model(REPACKED) as target:
            plain = drafts.get(str(PLAIN))
            assert (target.buffers, plain.buffers) == (alone, ())
            plain.close()


def test_a_draft_that_cannot_load_fails_where_it_is_asked_for(tmp_path):
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 40)
    drafts = Drafts()
    drafts.prefetch(str(bad))  # nothing is raised here: the loop may never ask for it
    with pytest.raises(ModelError, match="truncated or corrupt|not a GGUF"):
        drafts.get(str(bad))


def test_drafts_are_loaded_early_only_for_a_target_the_loop_replays(tmp_path):
    """The recorded draft model of a speculating transcript, on a sliding-window target (its values come from
    the loop past 256 positions) but not on a target whose memory drops a suffix, nor when the file is not
    here."""
    recs = read_file(FIXTURES / "transcripts" / "tiny-draft-simple.json")
    recorded = recs[0].flags.get("--spec-draft-model") or recs[0].flags.get("-md")
    assert recorded and _loop_drafts(FIXTURES / "tiny-target.gguf", recs, {}) == []
    given = {"draft_model": str(FIXTURES / "tiny-gemma3-draft.gguf")}
    assert _loop_drafts(REPACKED, recs, given) == [given["draft_model"]]
    assert _loop_drafts(REPACKED, recs, {"draft_model": str(tmp_path / "absent.gguf")}) == []
