"""Which CPU variant replays a transcript: the table of a release build's variants, which of them a
CPU runs, and the choice from the probes of the first real entry (quick tier: pure functions)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.run.kernels.choice import EXACT, choose_variant, witnesses
from replay.run.kernels.types import Probe
from replay.errors import KernelsError
from replay.paths import FIXTURES
from replay.runtime.variants import VARIANTS, host_cpu_flags, runnable, score
from replay.transcripts.readers import read_text

AVX2_HOST = "fpu sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2".split()
ZEN4_HOST = AVX2_HOST + "avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16".split()


def test_the_table_is_upstreams_fourteen_x86_variants_in_its_order():
    assert list(VARIANTS) == ["x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell", "skylakex",
                              "cannonlake", "cascadelake", "icelake", "cooperlake", "zen4", "alderlake",
                              "sapphirerapids"]


def test_an_avx2_host_runs_the_six_variants_up_to_haswell_best_first():
    assert runnable(list(VARIANTS), AVX2_HOST) == ["haswell", "piledriver", "ivybridge", "sandybridge", "sse42", "x64"]


def test_an_avx512_host_loads_zen4_and_cannot_run_amx_or_avx_vnni():
    can = runnable(list(VARIANTS), ZEN4_HOST)
    assert can[0] == "zen4" and "sapphirerapids" not in can and "alderlake" not in can
    assert score(VARIANTS["skylakex"], ZEN4_HOST) < score(VARIANTS["icelake"], ZEN4_HOST) < score(VARIANTS["zen4"], ZEN4_HOST)


def test_avx512_needs_all_five_foundation_flags():
    assert score(VARIANTS["skylakex"], [f for f in ZEN4_HOST if f != "avx512bw"]) == 0


def test_the_first_processors_flags_line_is_read(tmp_path):
    """/proc/cpuinfo as Linux writes it: a flags line per processor, tab-padded; the first one counts, an
    ARM file (Features, no flags) or no file at all gives none."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx2  fma\nbugs\t\t: spectre\n\n"
                    "processor\t: 1\nflags\t\t: fpu sse2 avx512f\n")
    assert host_cpu_flags(info) == {"fpu", "sse2", "avx2", "fma"}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm\n")
    assert host_cpu_flags(info) == frozenset()
    assert host_cpu_flags(tmp_path / "absent") == frozenset()


def test_this_hosts_flags_are_the_ones_lscpu_reports():
    """On this host, the flags read are the kernel's, as util-linux's lscpu reports them by another route
    (its Flags line), so the variants chosen are the ones this CPU runs."""
    import shutil
    import subprocess
    if shutil.which("lscpu") is None:
        pytest.skip("lscpu (util-linux) is not installed")
    out = subprocess.run(["lscpu"], capture_output=True, text=True, env={"LC_ALL": "C"}).stdout
    line = next((x for x in out.splitlines() if x.startswith("Flags:")), None)
    if line is None:
        pytest.skip("lscpu reports no Flags line on this host")
    assert host_cpu_flags() == frozenset(line.split(":", 1)[1].split())


def test_the_exact_variant_is_chosen_and_its_equals_are_named():
    c = choose_variant([Probe("haswell", 0.031, record=0), Probe("piledriver", 0.0, record=0),
                        Probe("ivybridge", 0.0, record=0), Probe("x64", 0.002, record=0)])
    assert (c.variant, c.how, c.equal) == ("piledriver", "matched", ("ivybridge",))
    assert c.describe() == "piledriver (AVX FMA), matched on the first entry of record 1 (as exactly: ivybridge)"


def test_a_difference_of_one_float32_rounding_is_exact_and_more_is_not():
    assert choose_variant([Probe("x64", EXACT, record=0)]).how == "matched"
    with pytest.raises(KernelsError):
        choose_variant([Probe("x64", 3 * EXACT, record=0)])


def test_no_match_is_refused_in_one_line_naming_the_nearest_and_the_causes():
    with pytest.raises(KernelsError) as e:
        choose_variant([Probe("haswell", 0.019, record=2), Probe("x64", 0.047, record=2)], not_runnable=["zen4"])
    msg = str(e.value)
    assert "\n" not in msg and "record 3" in msg and "nearest haswell (AVX2) 0.019" in msg
    assert "GPU" in msg and "zen4" in msg and "--server-backend" in msg


def test_no_match_is_the_nearest_only_when_allowed_and_says_why():
    c = choose_variant([Probe("haswell", 0.019, record=0), Probe("x64", 0.047, record=0)],
                       allow_nearest="--server-backend")
    assert (c.variant, c.how, c.diff) == ("haswell", "nearest", 0.019)
    assert "--server-backend" in c.describe() and "0.019 nats off" in c.describe()


def test_a_shared_batch_witness_that_matches_exactly_names_the_kernels():
    """On a 4-slot server a record computed alone is exact on the server's kernels, whatever the
    others' batches did to theirs (measured: records 1 and 7 of 8 concurrent, on x64)."""
    c = choose_variant([Probe("haswell", 0.053, record=5), Probe("x64", 0.0, record=0)], shared="a 4-slot server")
    assert (c.variant, c.how, c.record) == ("x64", "matched", 0)


def test_shared_batches_with_no_exact_witness_leave_the_kernels_unknown_not_the_nearest():
    """Sharing moved a first entry 0.03 to 0.24 nats, and made piledriver the nearest to an x64 server's
    (measured): the nearest means nothing then, so the host's best is used and the kernels are unknown."""
    c = choose_variant([Probe("haswell", 0.053, record=5), Probe("piledriver", 0.03, record=5),
                        Probe("x64", 0.11, record=5)], shared="a 4-slot server (/props total_slots)",
                       allow_nearest="--server-backend")
    assert (c.variant, c.how, c.diff) == ("haswell", "unknown", None)
    assert c.describe().startswith("haswell (AVX2), this host's best; the server's kernels are unknown (a 4-slot "
                                   "server (/props total_slots); no variant reproduces the first entry of record 6")


def test_variants_that_could_not_be_evaluated_are_an_error_not_a_choice():
    with pytest.raises(KernelsError, match="could not be evaluated"):
        choose_variant([Probe("x64", None, "the worker process died", record=0)])


def _record(first_logprob, top, cached=0):
    return {"request": {"prompt": "hi", "n_probs": 1}, "endpoint": "/completion",
            "response": {"content": "a b", "completion_probabilities": [
                {"id": 1, "token": "a", "bytes": [97], "logprob": first_logprob, "top_logprobs": top},
                {"id": 2, "token": " b", "bytes": [32, 98], "logprob": 0.0, "top_logprobs": []}],
                "timings": {"cache_n": cached, "prompt_n": 3, "predicted_n": 2}}}


def test_the_probed_record_is_the_first_whose_prompt_the_server_evaluated_in_full():
    top = [{"id": 1, "token": "a", "bytes": [97], "logprob": -0.5}]
    lines = [_record(0.0, []), _record(-0.5, top, cached=2), _record(-0.5, top)]
    recs = read_text("".join(json.dumps(r) + "\n" for r in lines), "t.jsonl")
    assert witnesses(recs) == [2]
    assert witnesses(recs[:2]) == [1]  # a cached prompt is a weaker witness, but better than none
    assert witnesses(recs[:1]) == []


def test_a_transcript_with_shared_batches_offers_several_witnesses_full_prompts_first():
    top = [{"id": 1, "token": "a", "bytes": [97], "logprob": -0.5}]
    lines = [_record(-0.5, top, cached=2)] + [_record(0.0, [])] + [_record(-0.5, top)] * 5
    recs = read_text("".join(json.dumps(r) + "\n" for r in lines), "t.jsonl")
    assert witnesses(recs) == [2]
    assert witnesses(recs, shared=True, limit=4) == [2, 3, 4, 5]
    assert witnesses(recs[:3], shared=True) == [2, 0]


def test_a_committed_transcript_has_a_real_first_entry():
    recs = read_text((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text(), "tiny")
    assert witnesses(recs) == [0]


def test_variants_equal_on_the_prompt_batch_but_not_on_one_token_decodes_are_refused_not_guessed():
    """Measured on long prompts: sse42 and x64 reproduce an x64 server's first entry bit for bit, and
    their one-token decodes are 0.1 to 0.6 nats apart; taking the first exact (sse42) filled every
    value that far from the server's."""
    ps = [Probe("haswell", 0.078, record=0), Probe("sse42", 0.0, record=7, decode=(-1.2, -1.2, -2.0)),
          Probe("x64", 0.0, record=7, decode=(-1.3, -1.3, -1.9))]
    with pytest.raises(KernelsError) as e:
        choose_variant(ps, tolerance=5e-4)
    msg = str(e.value)
    assert "\n" not in msg and "record 8" in msg and "sse42, x64" in msg and "--server-cpu" in msg


def test_variants_equal_on_the_prompt_batch_are_told_apart_by_the_servers_real_entries_after_it():
    """Measured on this suite's AVX-512 host (tests/test_recover_live.py, a 200-token unspeculated
    transcript from the b11434 server, which loaded icelake): icelake, haswell and piledriver reproduce
    the 4-token prompt's first entry bit for bit and decode the next tokens up to 0.113 nats apart; the
    server's own entries for those tokens name icelake, and refusing with --server-cpu was wrong."""
    ps = [Probe("icelake", 0.0, record=0, decode=(-1.2, -2.0), later=0.0),
          Probe("haswell", 0.0, record=0, decode=(-1.3, -2.0), later=0.113),
          Probe("piledriver", 2.6e-7, record=0, decode=(-1.25, -2.1), later=0.05)]
    c = choose_variant(ps, tolerance=5e-4)
    assert (c.variant, c.how, c.equal) == ("icelake", "matched", ())
    ps[0] = Probe("icelake", 0.0, record=0, decode=(-1.2, -2.0), later=0.02)  # none reproduces them: refused
    with pytest.raises(KernelsError):
        choose_variant(ps, tolerance=5e-4)


def test_variants_equal_on_both_are_one_class_and_the_most_capable_is_used():
    ps = [Probe("haswell", 0.0, record=0, decode=(-1.2, -2.0)), Probe("piledriver", 0.0, record=0, decode=(-1.2, -2.0)),
          Probe("x64", 0.12, record=0, decode=(-1.4, -1.9))]
    c = choose_variant(ps)
    assert (c.variant, c.how, c.equal) == ("haswell", "matched", ("piledriver",))


def test_equal_variants_whose_decodes_differ_within_the_tolerance_are_one_class_with_the_spread_named():
    """f32 weights (the tiny fixtures): every variant reproduces the first entry to 3e-7 and their
    decodes differ by 5e-5, below the 5e-4 recover promises: the choice moves no value past it."""
    ps = [Probe("haswell", 1.9e-7, record=0, decode=(-1.2, -2.0)), Probe("x64", 9.7e-8, record=0, decode=(-1.20005, -2.0))]
    c = choose_variant(ps, tolerance=5e-4)
    assert (c.variant, c.how, c.equal) == ("haswell", "matched", ("x64",)) and abs(c.spread - 5e-5) < 1e-9
    assert c.describe().endswith("(as exactly: x64; one-token decodes within 5e-05)")


def test_a_probe_is_kept_and_found_again_only_for_the_same_inputs(tmp_path):
    from replay.commands.recover import RecoverOptions
    from replay.run.inputs import Inputs
    from replay.run.kernels.cache import ProbeCache, probe_key
    from replay.run.kernels.types import Candidate, ProbeJob
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    base = dict(text="{}", request=None, indices=[0], model=model, flags={}, options=RecoverOptions(),
                libllama=None, variant="x64", until_exact=EXACT)

    def key_of(text, request, indices, model, flags, options, libllama, variant, until_exact):
        job = ProbeJob(Inputs(text, "t.json", request, str(model)), flags, options, libllama)
        return probe_key(job, indices, Candidate(variant), until_exact=until_exact)
    key = key_of(**base)
    cache = ProbeCache(tmp_path / "kernels")
    assert cache.get(key) is None
    cache.put(key, Probe("x64", 0.0, record=0, decode=(-1.5, -2.0)))
    assert cache.get(key) == Probe("x64", 0.0, record=0, decode=(-1.5, -2.0))
    cache.put("bad", Probe("x64", None, "the worker process died"))  # an error is not kept
    assert cache.get("bad") is None
    for change in ({"text": "{ }"}, {"variant": "sse42"}, {"indices": [1]}, {"flags": {"n_ctx": 4096}},
                   {"options": RecoverOptions(build=11368)}, {"options": RecoverOptions(source=Path("/src"))}):
        assert key_of(**{**base, **change}) != key, change
    # what does not change a witness's values does not probe again: the tolerance, prefix reuse
    # (exact), the user's word on shared batches
    for same in (RecoverOptions(tolerance=1e-3), RecoverOptions(reuse_prefix=False),
                 RecoverOptions(shared_batches=True)):
        assert key_of(**{**base, "options": same}) == key, same
    # -t changes a one-token decode's values past 256 positions (schedule/rows.py): another probe
    assert key_of(**{**base, "flags": {"threads": 1}}) != key
    model.write_bytes(b"GGUF2")  # another model file at the same path
    assert key_of(**base) != key
