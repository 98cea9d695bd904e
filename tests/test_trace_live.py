"""`trace` reproduces the real b11434 server's speculative loop token for token.

For every configuration the issue names, 6 seeds each (12 until the suite had to fit CI's hour): the server answers a
/completion request (recorded as a transcript), and `spec-replay trace` must
reproduce every emitted token and the server's `timings.draft_n` and
`timings.draft_n_accepted` totals from the same seed: the first request alone, and
all of them as one JSONL traced in order.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiers import default_and_wide

from replay.cli import main
from replay.commands.record import RequestItem, record_one
from replay.llamacpp.models import tiny_draft, tiny_target
from replay.llamacpp.process import ServerConfig
from replay.transcripts.format import dumps

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]
SEEDS = range(1, 7)
REPEAT = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, wrote the weather in "
          "his book, and watched the ships pass slowly along the dark coast until morning came. ")

CONFIGS = {
    # name: (model, draft, spec types, draft sampling, temperature, prompt, n_predict)
    "smol-self-greedy-t0": ("smol", "smol", ("draft-simple",), None, 0.0, "Once upon a time", 24),
    "smol-self-greedy-t1": ("smol", "smol", ("draft-simple",), None, 1.0, "Once upon a time", 24),
    "smol-self-probabilistic-t1": ("smol", "smol", ("draft-simple",), "probabilistic", 1.0, "Once upon a time", 24),
    "smol-q2k-probabilistic-t1": ("smol", "q2k", ("draft-simple",), "probabilistic", 1.0, "Once upon a time", 24),
    "smol-ngram-simple": ("smol", None, ("ngram-simple",), None, 0.0, REPEAT * 4, 48),
    "smol-ngram-mod": ("smol", None, ("ngram-mod",), None, 0.0, REPEAT * 4, 48),
    "smol-ngram-map-k": ("smol", None, ("ngram-map-k",), None, 0.0, REPEAT * 4, 48),
    "smol-ngram-cache": ("smol", None, ("ngram-cache",), None, 0.0, REPEAT * 4, 48),
    "smol-ngram-map-k4v": ("smol", None, ("ngram-map-k4v",), None, 0.0, REPEAT * 4, 48),
    "tiny-greedy-t0": ("tiny", "tiny-draft", ("draft-simple",), None, 0.0, "bcdbc", 24),
    "tiny-greedy-t1": ("tiny", "tiny-draft", ("draft-simple",), None, 1.0, "bcdbc", 24),
    "tiny-probabilistic-t1": ("tiny", "tiny-draft", ("draft-simple",), "probabilistic", 1.0, "bcdbc", 24),
}


def _check_against(res: dict, t: dict, seed: int) -> None:
    """trace's result for one record equals the server's: every emitted id and its draft totals."""
    assert res["reproduced"] is True, (seed, res["first_divergence"], res["draft_n"], res["server_draft_n"])
    assert [e["id"] for e in res["emitted"]] == t["response"]["tokens"], seed
    srv_t = t["response"]["timings"]
    assert (res["draft_n"], res["draft_n_accepted"]) == (srv_t.get("draft_n", 0), srv_t.get("draft_n_accepted", 0)), seed


@pytest.mark.parametrize("name", default_and_wide(CONFIGS, {"smol-self-greedy-t0", "smol-q2k-probabilistic-t1", "smol-ngram-mod",
                                                             "tiny-greedy-t0", "tiny-greedy-t1", "tiny-probabilistic-t1"}))
def test_trace_reproduces_the_server(name, start_server, smollm2, smollm2_draft, tmp_path):
    model_key, draft_key, types, sampling, temp, prompt, n_predict = CONFIGS[name]
    paths = {"smol": smollm2, "q2k": smollm2_draft, "tiny": tiny_target(), "tiny-draft": tiny_draft(), None: None}
    model, draft = paths[model_key], paths[draft_key]
    cfg = ServerConfig(model, draft_model=draft, spec_types=types, draft_sampling=sampling,
                       n_ctx=2048 if model_key == "smol" else 256)
    srv = start_server(cfg)
    recorded = []
    for seed in SEEDS:
        body = {"prompt": prompt, "n_predict": n_predict, "n_probs": 1, "temperature": temp, "seed": seed}
        recorded.append(record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block()))
    draft_args = ["-md", str(draft)] if draft else []
    # the first request alone, as a single-record transcript
    one = tmp_path / "first.json"
    one.write_text(dumps(recorded[0]))
    r = CliRunner().invoke(main, ["trace", str(one), "-m", str(model), "--json", *draft_args])
    assert r.exit_code == 0, r.output[-2000:]
    _check_against(json.loads(r.stdout), recorded[0], SEEDS[0])
    # every request as one JSONL, traced in order: drafter state that outlives a request (ngram-mod's
    # table, ngram-cache) must carry over exactly as on the server; each record from its own seed
    jsonl = tmp_path / "all.jsonl"
    jsonl.write_text("".join(json.dumps(t) + "\n" for t in recorded))
    r = CliRunner().invoke(main, ["trace", str(jsonl), "-m", str(model), "--json", *draft_args])
    assert r.exit_code == 0, r.output[-2000:]
    results = json.loads(r.stdout)["records"]
    assert len(results) == len(SEEDS)
    for res, t, seed in zip(results, recorded, SEEDS):
        _check_against(res, t, seed)
    drafted, accepted = sum(x["draft_n"] for x in results), sum(x["draft_n_accepted"] for x in results)
    assert drafted > 0, "the configuration never drafted: the test would prove nothing"
    if sampling == "probabilistic" or model_key == "tiny":
        assert accepted < drafted, "no rejection ever happened"


def test_rejection_steps_are_shown_with_their_draws(self_draft_server, smollm2, smollm2_draft, start_server, tmp_path):
    srv = start_server(ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",),
                                      draft_sampling="probabilistic"))
    t = record_one(srv.url, RequestItem("/completion", {"prompt": "Once upon a time", "n_predict": 16,
                                                        "temperature": 1, "seed": 3}), srv.config.flags_block())
    path = tmp_path / "t.json"
    path.write_text(dumps(t))
    r = CliRunner().invoke(main, ["trace", str(path), "-m", str(smollm2), "-md", str(smollm2_draft), "--json"])
    res = json.loads(r.stdout)
    rej = [s for s in res["steps"] if s["rule"] == "rejection"]
    assert rej and all(len(s["draft_q"]) == len(s["draft"]) for s in rej)
    assert any(s["resampled"] is not None and s["uniforms"][-1][1] is not None for s in rej)
    r = CliRunner().invoke(main, ["trace", str(path), "-m", str(smollm2), "-md", str(smollm2_draft)])
    assert r.exit_code == 0 and "reproduced: all" in r.output and "rejection" in r.output


@pytest.fixture(scope="module")
def server_0c1e570():
    """llama-server built from llama-cpp-python 0.3.36's vendored llama.cpp (0c1e570)."""
    from replay.llamacpp.build import BuildSpec, ensure_built
    return ensure_built(BuildSpec("0c1e570", cpu="native"))


@pytest.mark.other_builds
@pytest.mark.parametrize("types,temp", [(("draft-simple",), 0.0), (("draft-simple",), 1.0), (("ngram-mod",), 0.0)],
                         ids=["draft-simple-t0", "draft-simple-t1", "ngram-mod"])
def test_trace_reproduces_the_0c1e570_server(server_0c1e570, smollm2, tmp_path, types, temp):
    from replay.llamacpp.process import LlamaServer
    draft = smollm2 if "draft-simple" in types else None
    prompt = "Once upon a time" if draft else REPEAT * 4
    lines = []
    with LlamaServer(ServerConfig(smollm2, draft_model=draft, spec_types=types), binary=server_0c1e570.server) as srv:
        for seed in SEEDS:
            body = {"prompt": prompt, "n_predict": 24 if draft else 48, "n_probs": 1, "temperature": temp, "seed": seed}
            t = record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())
            assert t["server"]["build_info"] == "b0-0c1e570"
            lines.append(json.dumps(t))
    jsonl = tmp_path / "all.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(main, ["trace", str(jsonl), "-m", str(smollm2), "--json"] + (["-md", str(draft)] if draft else []))
    assert r.exit_code == 0, r.output[-2000:]
    recs = json.loads(r.stdout)["records"]
    assert len(recs) == len(SEEDS) and all(x["reproduced"] for x in recs)
    assert sum(x["draft_n"] for x in recs) > 0
    assert all(s["rule"] != "rejection" for x in recs for s in x["steps"])
