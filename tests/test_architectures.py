"""The architectures users run, on tiny random models (fixtures/make_tiny_arch.py), against real b11434 servers.

    gemma3         interleaved sliding-window attention (an iSWA KV cache, window 4)
    qwen3          QK-norm, GQA, byte-level BPE with merges
    granitehybrid  Mamba-2 + attention: the target's memory cannot drop a suffix, so the server
                   verifies drafts from checkpoints and replays the kept tokens (the loop's
                   checkpoint path, server-context.cpp:4272-4330)

For each, like the tiny Llama: trace token-exact on 20 seeds (draft-simple greedy at t 0 and 1,
probabilistic at t 1, an n-gram drafter), recover exact against the unspeculated server, the server
patch bit-exact (patch --verify's checks), and the distribution lab's server and trace paths unbiased.

The quantized pairs (Gemma 3 Q4_0, Qwen 3 Q8_0, Granite hybrid Q4_0 at width 32) are where a wrong
prompt schedule shows: on quantized weights the batch shape changes the values (F32 barely moves),
so each is shown to reject the schedule the server does not run, and traced token-exact.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiers import default_and_wide

from replay.cli import main
from replay.commands.record import RequestItem, record_one
from replay.commands.recover import Recoverer
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.paths import FIXTURES
from replay.proof.matrix import max_value_diff
from replay.runtime.llama import Model
from replay.transcripts.format import dumps
from replay.transcripts.readers import read_text

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]
ARCHS = ("gemma3", "qwen3", "granitehybrid")
SEEDS = range(1, 21)
PROMPT = "hello world, the cat"
# the n-gram drafter that drafts on each model's own output (granitehybrid's text repeats no bigram
# the way ngram-simple looks for one, ngram-map-k's keys do)
NGRAM = {"gemma3": ("ngram-simple", {"ngram_simple_size_n": 2, "ngram_simple_size_m": 8}),
         "qwen3": ("ngram-simple", {"ngram_simple_size_n": 2, "ngram_simple_size_m": 8}),
         "granitehybrid": ("ngram-map-k", {"ngram_map_k_size_n": 2, "ngram_map_k_size_m": 8})}


QUANTIZED = {"gemma3": "q4_0", "qwen3": "q8_0", "granitehybrid": "q4_0"}  # fixtures/make_tiny_arch.py


def files(arch: str, quantized: bool = False) -> tuple[Path, Path]:
    q = f"-{QUANTIZED[arch]}" if quantized else ""
    return FIXTURES / f"tiny-{arch}{q}-target.gguf", FIXTURES / f"tiny-{arch}{q}-draft.gguf"


def _config(arch: str, mode: str) -> tuple[ServerConfig, Path | None, float]:
    target, draft = files(arch)
    if mode == "ngram":
        kind, flags = NGRAM[arch]
        return ServerConfig(target, spec_types=(kind,), n_ctx=256, **flags), None, 0.0
    return (ServerConfig(target, draft_model=draft, spec_types=("draft-simple",), n_ctx=256,
                         draft_sampling="probabilistic" if mode == "probabilistic-t1" else None),
            draft, 0.0 if mode == "greedy-t0" else 1.0)


def _record_all(srv: LlamaServer, temp: float, seeds=SEEDS, n_predict: int = 32) -> list[dict]:
    return [record_one(srv.url, RequestItem("/completion", {"prompt": PROMPT, "n_predict": n_predict, "n_probs": 3,
                                                            "temperature": temp, "seed": s, "cache_prompt": False}),
                       srv.config.flags_block()) for s in seeds]


@pytest.mark.parametrize("mode", ["greedy-t0", "greedy-t1", "probabilistic-t1", "ngram"])
@pytest.mark.parametrize("arch", ARCHS)
def test_trace_reproduces_the_server_on_each_architecture(arch, mode, start_server, tmp_path):
    cfg, draft, temp = _config(arch, mode)
    srv = start_server(cfg)
    src = tmp_path / "all.jsonl"
    src.write_text("".join(dumps(t, indent=None) + "\n" for t in _record_all(srv, temp)))
    r = CliRunner().invoke(main, ["trace", str(src), "-m", str(files(arch)[0]), "--json"] +
                           (["-md", str(draft)] if draft else []))
    assert r.exit_code == 0, r.output[-2000:]
    recs = json.loads(r.stdout)["records"]
    assert len(recs) == 20 and all(x["reproduced"] for x in recs), \
        [(x["first_divergence"], x["divergence"]) for x in recs if not x["reproduced"]][:2]
    assert all((x["draft_n"], x["draft_n_accepted"]) == (x["server_draft_n"], x["server_draft_n_accepted"])
               for x in recs)
    drafted, accepted = sum(x["draft_n"] for x in recs), sum(x["draft_n_accepted"] for x in recs)
    assert drafted > 0, "the configuration never drafted: the test would prove nothing"
    rules = {s["rule"] for x in recs for s in x["steps"]}
    if temp > 0:
        assert accepted < drafted, "no draft was ever rejected"
    if mode == "probabilistic-t1":
        assert any(rule.startswith("rejection") for rule in rules)
    if arch == "granitehybrid" and mode != "ngram":
        # the checkpoint path ran: a partly accepted step restored, and its kept tokens replayed
        assert any("checkpoint restored" in rule for rule in rules), rules
        assert any(rule.startswith("checkpoint replay") for rule in rules), rules


@pytest.mark.parametrize("arch", ARCHS)
def test_recovered_values_are_the_unspeculated_servers(arch, start_server):
    """Every value recover fills equals what the same server build reports without speculation."""
    target = files(arch)[0]
    plain = start_server(ServerConfig(target, n_ctx=256))
    worst, compared, filled = 0.0, 0, 0
    model = Model(target)
    try:
        for mode in ("greedy-t0", "probabilistic-t1"):
            cfg, _, temp = _config(arch, mode)
            spec = _record_all(start_server(cfg), temp, seeds=range(1, 6))
            ref = _record_all(plain, temp, seeds=range(1, 6))
            records = read_text("".join(json.dumps(t) + "\n" for t in spec), f"{arch}-{mode}.jsonl")
            recoverer = Recoverer(model, records=records)
            done_all = [recoverer.recover(rec) for rec in records]
            recoverer.close()
            for done, p in zip(done_all, ref):
                c = done.report.summary()["counts"]
                assert c["mismatch"] == c["unaligned"] == 0, done.report.to_json()["tokens"][:3]
                filled += c["placeholder"] + c["missing"]
                # compared up to where the runs part (probabilistic drafts change the draws)
                w, n = max_value_diff(done.container, p)
                worst, compared = max(worst, w), compared + n
    finally:
        model.close()
    assert filled > 20 and compared > 40
    assert worst <= 5e-4, f"{arch}: max |recovered - unspeculated| {worst:.2e}"
    print(f"\n{arch}: max |recovered - unspeculated| {worst:.2e} over {compared} tokens ({filled} filled)")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_server_patch_reports_what_trace_predicts(arch, b11434):
    """patch --verify's value checks on this architecture: the patched speculating server's values are
    trace's prediction and the unspeculated server's, bit for bit where the schedule allows."""
    from replay.llamacpp.build import BuildSpec, ensure_built
    from replay.proof.patch_proof import Setup, check_values, pinned_tree, saved_patch
    from replay.proof.patches import server_patch
    tree = pinned_tree("b11434")
    patched = ensure_built(BuildSpec("b11434", patch=saved_patch(server_patch(tree).diff, "server-b11434")))
    target, draft = files(arch)
    setups = [Setup(f"{arch} {mode}", target, draft, ("draft-simple",), sampling, temp, PROMPT, 16, 256,
                    ("/v1/completions", "/completion"))
              for mode, sampling, temp in (("greedy t0", None, 0.0), ("probabilistic t1", "probabilistic", 1.0))]
    rows = check_values(patched, b11434, setups, seeds=range(1, 3), tree=tree)
    bad = [(r.setup, r.endpoint, r.stream, r.mode, r.problems[:2]) for r in rows if not r.passed]
    assert not bad, bad
    assert max(r.vs_trace for r in rows) <= 5e-4


def _lab_prefix(target: Path) -> str:
    """The most likely first token after PROMPT (top-k 3, t 1) that is one token on its own: the lab's prefix."""
    from replay.proof.distribution import _after
    with Model(target) as m:
        (_, after), = _after(m, [m.tokenize(PROMPT, add_special=True, parse_special=False)])
        for t in [int(i) for i in after.ids]:
            piece = m.piece(t).decode("utf-8", "replace")
            if m.tokenize(piece, add_special=False, parse_special=False) == [t] and not m.is_eog(t):
                return piece
    raise AssertionError("no single-token prefix")


@pytest.mark.parametrize("arch", default_and_wide(ARCHS, {"qwen3"}))
def test_the_servers_loop_and_trace_keep_the_target_distribution(arch, b11434):
    from replay.proof.distribution import Lab, run_lab
    target, draft = files(arch)
    lab = Lab(target, draft, prompt=PROMPT, prefix=_lab_prefix(target), seeds=range(1, 801))
    res = run_lab(lab, b11434.server, None, paths=("a", "b-greedy", "b-probabilistic", "c-greedy",
                                                   "c-probabilistic"))
    for p in res.paths:
        assert p.runs >= 150, (p.key, p.runs)
        assert p.verdict == "preserves", (p.key, p.counts, res.reference, p.p_value)
    for a, b, same, n in res.agreements():
        assert same == n, (a, b, same, n)


LONG_PROMPT = "hello world, the cat sat on the mat and the dog " * 4  # 120 tokens: cut into [n - 4, 4]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_quantized_fixture_refuses_the_prompt_schedule_the_server_does_not_run(arch, start_server, tmp_path,
                                                                                 monkeypatch):
    """The server cuts a sliding-window or hybrid target's prompt (schedule/prompt.py) and not a plain
    transformer's: recover with the server's schedule is exact; with the other one (the cut left out,
    as before it was reproduced; or, for Qwen 3, added) the first token's real value disagrees beyond
    the tolerance and recover refuses in one line."""
    from cli_helpers import one_error, run

    import replay.run.recover as recover_mod
    import replay.schedule.memory as memory_mod
    from replay.schedule.memory import checkpoint_rules
    target = files(arch, quantized=True)[0]
    srv = start_server(ServerConfig(target, n_ctx=256))
    src = tmp_path / "plain.jsonl"
    src.write_text("".join(dumps(record_one(srv.url, RequestItem("/completion", {
        "prompt": LONG_PROMPT, "n_predict": 16, "n_probs": 3, "temperature": 1.0, "seed": s}), srv.config.flags_block()),
        indent=None) + "\n" for s in (1, 2, 3)))
    good = run("recover", src, "-m", target, "-o", tmp_path / "good.jsonl", "--json")
    assert good.exit_code == 0, good.output
    reps = json.loads(good.stdout)["records"]
    cuts = arch != "qwen3"
    assert all(r["schedule"]["checkpoints"] is cuts and r["summary"]["max_abs_diff_real"] <= 5e-4 for r in reps)

    def other(model, removes, **kw):
        rules = checkpoint_rules(model, removes, **kw)
        return type(rules)(not rules.enabled, rules.n_ctx_checkpoints, rules.min_step, rules.build)
    monkeypatch.setattr(memory_mod, "checkpoint_rules", other)  # where a slot is made (SlotConfig.open)
    worst = max(r.summary()["max_abs_diff_real"] for r in recover_mod.recover(src, target).records)
    assert worst > 5e-4, f"{arch}: the wrong schedule is within the tolerance ({worst:.2e}): the fixture proves nothing"
    err = one_error(run("recover", src, "-m", target, "-o", tmp_path / "bad.jsonl"))
    assert "token 0" in err, err
    print(f"\n{arch} {QUANTIZED[arch]}: the wrong prompt schedule is {worst:.2e} off")


@pytest.mark.parametrize("mode", ["greedy-t1", "probabilistic-t1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_trace_reproduces_the_server_on_each_quantized_fixture(arch, mode, start_server, tmp_path):
    target, draft = files(arch, quantized=True)
    cfg = ServerConfig(target, draft_model=draft, spec_types=("draft-simple",), n_ctx=256,
                       draft_sampling="probabilistic" if mode == "probabilistic-t1" else None)
    srv = start_server(cfg)
    recs = [record_one(srv.url, RequestItem("/completion", {"prompt": p, "n_predict": 32, "n_probs": 3,
                                                            "temperature": 1.0, "seed": s}), cfg.flags_block())
            for s in range(1, 6) for p in (PROMPT, LONG_PROMPT)]
    src = tmp_path / "all.jsonl"
    src.write_text("".join(dumps(t, indent=None) + "\n" for t in recs))
    r = CliRunner().invoke(main, ["trace", str(src), "-m", str(target), "-md", str(draft), "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    got = json.loads(r.stdout)["records"]
    assert all(x["reproduced"] for x in got), [(x["first_divergence"], x["divergence"]) for x in got
                                               if not x["reproduced"]][:2]
    assert sum(x["draft_n"] for x in got) > sum(x["draft_n_accepted"] for x in got) > 0
