"""`tune` on traffic recorded from real b11434 servers: eight chat requests at temperature 0 per server,
SmolLM2 drafting for itself on a one-slot server, Gemma 3 with its Q2_K draft on a server started with
default flags (4 slots, a unified KV cache), and SmolLM2 with n-gram drafting on a default-flag server;
and eight at temperature 1 with a probabilistic draft (the rejection rule).

Every sweep must first reproduce the transcript (tokens and draft totals: tune refuses otherwise); at
temperature 0 every setting must emit the recorded tokens, and the verifier's expected acceptance must be
the count (an argmax keeps a draft token with probability 0 or 1).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from tiers import WIDE

from replay.commands.record import RequestItem, record_one
from replay.commands.tune import prepare, timed_records
from replay.errors import TranscriptError
from replay.llamacpp.process import ServerConfig
from replay.run.tune import tune
from replay.runtime.llama import Model
from replay.transcripts.format import dumps
from replay.transcripts.readers import read_text
from replay.tuning.calibrate import fit

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

TOPICS = ["the sea", "a lighthouse", "bread", "the moon", "a river", "winter", "a library", "the wind"]
TEXT = ("The keeper climbed the stairs at dusk, lit the lamp, wound the clock, wrote the weather in the log, "
        "and watched the ships pass the rocks until the morning came.")


def _record(srv, bodies: list[dict]) -> list:
    lines = [dumps(record_one(srv.url, RequestItem("/v1/chat/completions", b), srv.config.flags_block()), indent=None)
             for b in bodies]
    return read_text("\n".join(lines) + "\n", "chat.jsonl")


def _chat(k: int, content: str, max_tokens: int = 40) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "seed": 7 + k}


def _sweep(recs, model_path, varies, flags, **kw):
    """The Python API over the records as the JSONL they were recorded to (run/tune.py)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "chat.jsonl"
        path.write_text("".join(json.dumps(r.container) + "\n" for r in recs))
        return tune(path, model_path, varies, flags=flags, **kw)


def _same_tokens_and_expectation_is_the_count(runs) -> None:
    assert all(r.exact for r in runs[0].records)
    for run_ in runs:
        if run_ is not runs[0]:
            assert all(r.same_tokens for r in run_.records), (run_.setting.spelled,
                                                              [r.record for r in run_.records if not r.same_tokens])
        exp = run_.expected
        assert exp is not None and exp.along == "the recorded tokens"
        assert exp.drafted == run_.total("drafted") and exp.accepted == pytest.approx(run_.total("accepted"), abs=1e-6)
    print("\n" + "\n".join(f"{r.setting.spelled}: {r.tokens} tokens, {r.target_decodes} target decodes, "
                           f"drafted {r.total('drafted')}, accepted {r.total('accepted')}" for r in runs))


def test_smollm2_drafting_for_itself_on_one_slot(start_server, smollm2):
    srv = start_server(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",), n_ctx=2048))
    recs = _record(srv, [_chat(k, f"Write two sentences about {t}.") for k, t in enumerate(TOPICS)])
    runs = _sweep(recs, smollm2, ["--spec-draft-n-max=2,8", "--spec-type=draft-simple,ngram-simple"],
                  {"draft_model": str(smollm2)})
    assert len(runs[0].records) == 8
    _same_tokens_and_expectation_is_the_count(runs)
    by = {r.setting.spelled: r for r in runs}
    assert by["--spec-draft-n-max 8 --spec-type draft-simple"].target_decodes < runs[0].target_decodes < \
        by["--spec-draft-n-max 2 --spec-type draft-simple"].target_decodes
    # a one-slot server's timings are its own, but one setting's steps all draft alike: its timings cannot
    # tell a decode's cost from a row's or a draft decode's, and the fit says so (--measure does it)
    model = Model(smollm2)
    try:
        timed = timed_records(prepare(recs, model, {"draft_model": str(smollm2)}), runs[0])
    finally:
        model.close()
    assert len(timed) == 8
    with pytest.raises(TranscriptError, match="work too alike"):
        fit(timed)


@pytest.mark.sweeps
def test_gemma3_with_its_draft_on_a_default_flag_server(start_server, gemma3, gemma3_draft):
    srv = start_server(ServerConfig(gemma3, n_ctx=4096, n_parallel=-1, draft_model=gemma3_draft,
                                    spec_types=("draft-simple",)))
    recs = _record(srv, [_chat(k, f"Write two sentences about {t}.", 32) for k, t in enumerate(TOPICS)])
    runs = _sweep(recs, gemma3, ["--spec-draft-n-max=2,6", "--spec-type=draft-simple,ngram-mod,draft-simple+ngram-mod"],
                  {"draft_model": str(gemma3_draft)})
    assert len(runs) == 7 and runs[0].total("drafted") > 0
    _same_tokens_and_expectation_is_the_count(runs)
    model = Model(gemma3)
    try:
        prepared = prepare(recs, model, {"draft_model": str(gemma3_draft)})
    finally:
        model.close()
    # a 4-slot server may have decoded them in shared batches: its timings calibrate nothing
    assert all(p.read.shared for p in prepared) and timed_records(prepared, runs[0]) == []


@WIDE
def test_smollm2_ngram_drafting_on_a_default_flag_server(start_server, smollm2):
    srv = start_server(ServerConfig(smollm2, n_ctx=4096, n_parallel=-1, spec_types=("ngram-simple",),
                                    ngram_simple_size_n=4))
    recs = _record(srv, [_chat(k, f"Copy this text exactly, then say which word is about {t}:\n\n{TEXT}", 64)
                         for k, t in enumerate(TOPICS)])
    runs = _sweep(recs, smollm2, ["--spec-type=ngram-simple,ngram-map-k,ngram-mod",
                                  "--spec-ngram-simple-size-n=2,4"], {})
    assert runs[0].total("drafted") > 50  # the reply copies its prompt: the n-grams find it
    _same_tokens_and_expectation_is_the_count(runs)
    by = {r.setting.spelled: r for r in runs}
    assert by["--spec-type ngram-simple --spec-ngram-simple-size-n 4"].total("drafted") == runs[0].total("drafted")


@pytest.mark.sweeps
def test_smollm2_sampling_at_temperature_1_with_a_probabilistic_draft(start_server, smollm2):
    """The rejection rule at t > 0: the baseline reproduces the recorded run exactly; other draft lengths draw
    their own samples (their expectation is along their own tokens); --samples 5 adds runs with the next seeds."""
    srv = start_server(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",),
                                    draft_sampling="probabilistic", n_ctx=2048))
    recs = _record(srv, [{**_chat(k, f"Write two sentences about {t}."), "temperature": 1.0}
                         for k, t in enumerate(TOPICS)])
    runs = _sweep(recs, smollm2, ["--spec-draft-n-max=1,6"], {"draft_model": str(smollm2)}, samples=5)
    base = runs[0]
    assert not any(r.exact for r in base.records)
    assert all(r.expected.along == "the recorded tokens" for r in base.records)
    moved = [r for run_ in runs[1:] for r in run_.records if not r.same_tokens]
    assert moved and all(r.expected.along == "this run's tokens" for r in moved)
    for run_ in runs:
        assert all(len(r.samples) == 4 for r in run_.records)
        est = run_.sampled()["acceptance"]
        assert est.runs == 5 and est.low <= est.mean <= est.high
        # the verifier's expectation and the count describe the same draws: ~200 drafts, a rate's standard
        # deviation ~0.03, so 0.1 is over three of them
        exp = run_.expected
        assert abs(exp.acceptance - run_.acceptance) < 0.1, (run_.setting.spelled, exp.acceptance, run_.acceptance)
    print("\n" + "\n".join(f"{r.setting.spelled}: acceptance {r.acceptance:.3f}, expected {r.expected.acceptance:.3f}, "
                           f"over 5 runs {r.sampled()['acceptance'].describe()}" for r in runs))
