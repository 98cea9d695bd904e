"""Every host users and CI run on: kernels are known to run before they are loaded, a variant whose
kernels crash is never chosen and is named, and nothing spec-replay starts dies of a signal.

Specification:
- a library or CPU variant is judged in a subprocess first (runtime/health.py): how the probe ends is
  the verdict, kept per host and library, and a crash stops nothing but that subprocess;
- llama-cpp-python's own library, which scripts/setup builds to run here, runs here;
- a library whose probe dies is refused in one line (exit 3), nothing written; one that dies only with
  extra buffer types is usable with --no-repack and refused without it, in one line that says so;
- a variant that dies is not a candidate of the kernel choice, not the one a server the project starts
  computes with, and `--version` names it; a transcript that needs it is refused in one line;
- SPEC_REPLAY_INJECT_CRASH stands for an AMX host's crash on any host; on an AMX host whose AMX kernels
  crash (the host these tests were written on) the real sapphirerapids verdict is checked too.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay.paths import FIXTURES
from replay.runtime import health
from replay.runtime.binding import bundled_dir
from replay.runtime.variants import host_cpu_flags

TINY = FIXTURES / "tiny-target.gguf"
TRANSCRIPT = FIXTURES / "transcripts" / "tiny-draft-simple.json"


def cli(*args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    import os
    p = subprocess.run([sys.executable, "-m", "replay.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    assert "Traceback" not in p.stderr and p.returncode >= 0, p.stderr[-3000:]
    return p


def errors(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("Error:")]


@pytest.fixture
def fresh_verdicts(tmp_path, monkeypatch) -> Path:
    """An empty verdict cache of this test's own (subprocesses too): every judgement is probed anew."""
    d = tmp_path / "health"
    monkeypatch.setenv(health.CACHE_ENV, str(d))
    return d


# --- the verdict, from how the probe ended (pure) --------------------------------------------------

def test_a_probe_that_hangs_or_cannot_run_is_no_crash():
    hung = health.parse_probe("zen4", None, "ok plain\n")
    assert (hung.plain, hung.extra, hung.crashed, hung.runs(False)) == ("ok", "hung", True, True)
    broken = health.parse_probe("zen4", 3, "error BindingError: no libllama.so there\n")
    assert not broken.crashed and not broken.runs(False)
    assert broken.describe() == "zen4: cannot run on this host (error: BindingError: no libllama.so there)"


def test_a_crash_before_the_first_decode_is_a_crash_of_both_modes():
    h = health.parse_probe("x64", -11, "")
    assert (h.plain, h.extra, h.runs(False)) == ("SIGSEGV", "not run", False)
    assert h.describe() == "x64: crashes on this host (SIGSEGV)"


def test_injected_crashes_name_a_signal_or_are_refused():
    env = {health.INJECT_ENV: "zen4:SEGV"}
    assert health.injected_crash("zen4", env)[0].name == "SIGSEGV"
    with pytest.raises(ValueError, match="not a signal name"):
        health.injected_crash("zen4", {health.INJECT_ENV: "zen4:oops"})


# --- llama-cpp-python's own library, probed for real ------------------------------------------------

def test_llama_cpp_pythons_own_library_runs_here_and_is_probed_once(fresh_verdicts, monkeypatch):
    calls = []
    real = health._run_probe
    monkeypatch.setattr(health, "_run_probe", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = health.health(bundled_dir(), health.NATIVE, bundled=True)
    again = health.health(bundled_dir(), health.NATIVE, bundled=True)
    assert first == again and len(calls) == 1
    assert first.runs(repack=True), first.describe("llama-cpp-python's own libllama")
    if "avx2" in host_cpu_flags():  # the repack of Q4_0/Q4_K/IQ4_NL needs AVX2 (ggml-cpu/repack.cpp)
        assert "CPU_REPACK" in first.buffers
    assert "amx" not in " ".join(first.buffers).lower(), "scripts/setup leaves AMX out of this library"


def test_a_verdict_is_kept_per_library_and_injection(fresh_verdicts, tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libllama.so").write_bytes(b"one")
    k1 = health.verdict_key(lib, "zen4")
    (lib / "libllama.so").write_bytes(b"another build")
    k2 = health.verdict_key(lib, "zen4")
    monkeypatch.setenv(health.INJECT_ENV, "zen4:SIGILL")
    k3 = health.verdict_key(lib, "zen4")
    assert len({k1, k2, k3}) == 3 and health.verdict_key(lib, "x64") != k3


def test_a_library_whose_probe_dies_is_refused_in_one_line_and_nothing_is_written(fresh_verdicts, tmp_path):
    out = tmp_path / "out.json"
    p = cli("recover", TRANSCRIPT, "-m", TINY, "-o", out, env={health.INJECT_ENV: "native:SIGSEGV:always"})
    assert p.returncode == 3 and not out.exists(), p.stderr
    assert errors(p) == ["Error: llama-cpp-python's own libllama: crashes on this host (SIGSEGV) (injected: "
                         "SPEC_REPLAY_INJECT_CRASH) (scripts/setup builds one that runs here)"], p.stderr


def test_a_library_that_dies_with_extra_buffer_types_recovers_with_no_repack_only(fresh_verdicts, tmp_path):
    inject = {health.INJECT_ENV: "native:SIGILL"}
    out = tmp_path / "out.json"
    p = cli("recover", TRANSCRIPT, "-m", TINY, "-o", out, env=inject)
    assert p.returncode == 3 and not out.exists()
    (line,) = errors(p)
    assert "crashes on this host (SIGILL with its" in line and "--no-repack" in line, line
    p = cli("recover", TRANSCRIPT, "-m", TINY, "-o", out, "--no-repack", env=inject)
    assert p.returncode == 0 and out.exists(), p.stderr[-2000:]


def test_no_repack_is_a_setting_spelled_as_llama_server_spells_it():
    from replay.settings import BY_FLAG, flags_block
    assert BY_FLAG["-nr"] is BY_FLAG["--no-repack"] and BY_FLAG["--no-repack"].attr == "no_repack"
    assert flags_block({"no_repack": True, "no_host": True}) == {"--no-repack": True, "--no-host": True}


def test_the_repack_a_transcript_says_is_taken_and_records_that_disagree_are_refused():
    from replay.run.kernels.policy import recorded_repack, repack_modes
    from replay.errors import TranscriptError
    from replay.settings.table import RecordedFlags
    from replay.transcripts.readers import Record

    def rec(flags):
        return Record("t.json", 1, "/completion", {}, False, flags=flags)
    assert repack_modes({}, [rec({"--no-repack": True})]) == ([False], "server.flags")
    assert repack_modes({"no_repack": False}, [rec({"--no-repack": True})]) == ([True], "command line")
    assert repack_modes({}, [rec({"--spec-type": ["ngram-mod"]})]) == ([True, False], "probed")
    legacy = RecordedFlags({"--no-repack": True}, where="server.speculative")  # read from a legacy file's block
    assert repack_modes({}, [rec(legacy)]) == ([False], "server.speculative")
    with pytest.raises(TranscriptError, match="recover them separately"):
        recorded_repack([rec({"--no-repack": True}), rec({"--no-repack": False})])


# --- release-style builds: the variants ------------------------------------------------------------

@pytest.mark.build
def test_version_names_every_variant_that_crashes_here(b11434, fresh_verdicts):
    from replay.llamacpp.kernels import variants_that_run
    best = variants_that_run(b11434.bin_dir)[0]
    p = cli("--version", env={health.INJECT_ENV: f"{best}:SIGILL"})
    assert p.returncode == 0
    assert f"  {best}: crashes on this host (SIGILL with its" in p.stdout, p.stdout
    runs = next(line for line in p.stdout.splitlines() if "CPU variants that run on this host" in line)
    assert best not in runs.split(": ", 1)[1].split(", "), runs


@pytest.mark.build
def test_on_an_amx_host_the_real_sapphirerapids_verdict_decides(b11434):
    """On a host that advertises AMX, sapphirerapids is a candidate exactly when its probe ran; where its
    AMX kernels crash (measured on a Sapphire Rapids class VM: SIGILL at tilezero) it is never chosen."""
    from replay.llamacpp.kernels import variants_that_run
    if "amx_int8" not in host_cpu_flags():
        pytest.skip("this host has no AMX: tests/test_hosts.py's injected crashes stand for it")
    verdict = health.health(b11434.bin_dir, "sapphirerapids")
    assert (verdict.runs() and variants_that_run(b11434.bin_dir)[0] == "sapphirerapids") or \
        (verdict.crashed and "sapphirerapids" not in variants_that_run(b11434.bin_dir)), verdict
    print(f"\nsapphirerapids here: {verdict.describe()}")


@pytest.mark.build
@pytest.mark.live_server
def test_a_server_the_project_starts_skips_a_variant_that_crashes_and_says_which(b11434, start_server, monkeypatch,
                                                                                fresh_verdicts):
    from replay.llamacpp.kernels import variants_that_run
    from replay.llamacpp.process import ServerConfig
    best = variants_that_run(b11434.bin_dir)[0]
    monkeypatch.setenv(health.INJECT_ENV, f"{best}:SIGILL")
    srv = start_server(ServerConfig(TINY))
    assert srv.kernels.variant not in (None, best)
    assert srv.kernels.variant == variants_that_run(b11434.bin_dir)[0]
    first = srv.log().splitlines()[0]
    assert f"/cpu/{srv.kernels.variant}/llama-server computes with {srv.kernels.describe()}" in first
    assert f"{best}: crashes on this host (SIGILL" in first
    assert sorted(p.name for p in srv.kernels.program.parent.glob("libggml-cpu-*")) == \
        [f"libggml-cpu-{srv.kernels.variant}.so"]


@pytest.mark.build
@pytest.mark.live_server
def test_a_variant_that_runs_only_without_extra_buffers_serves_a_no_repack_server(b11434, start_server, monkeypatch,
                                                                                 fresh_verdicts):
    from replay.llamacpp.kernels import variants_that_run
    from replay.llamacpp.process import ServerConfig
    best = variants_that_run(b11434.bin_dir)[0]
    monkeypatch.setenv(health.INJECT_ENV, f"{best}:SIGILL")
    plain_only = variants_that_run(b11434.bin_dir, repack=False)  # on an AMX host sapphirerapids leads them
    assert best in plain_only and best not in variants_that_run(b11434.bin_dir)
    assert start_server(ServerConfig(TINY, no_repack=True)).kernels.variant == plain_only[0]


# --- a --no-repack server, recorded live ------------------------------------------------------------

NR_BODIES = [("/completion", {"prompt": "The lighthouse keeper climbed the stairs every night at nine, and",
                              "n_predict": 32, "n_probs": 3, "temperature": 1.0, "seed": 3}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours of the sea."}],
                                       "max_tokens": 24, "logprobs": True, "top_logprobs": 3, "temperature": 0.8,
                                       "seed": 5})]


@pytest.fixture(scope="module")
def no_repack_gemma(module_server, gemma3, tmp_path_factory):
    """A default-flag (-np auto: 4 slots, unified KV) Gemma 3 server started with --no-repack, drafting
    with itself, and the same server unspeculated: (the speculative JSONL as `record` wrote it, the same
    without --no-repack in its server flags, the unspeculated transcripts)."""
    from replay.commands.record import RequestItem, record_one
    from replay.llamacpp.process import ServerConfig
    from replay.transcripts.format import dumps
    flags = dict(n_ctx=4096, n_parallel=-1, no_repack=True)
    spec = module_server(ServerConfig(gemma3, draft_model=gemma3, spec_types=("draft-simple",), **flags))
    plain = module_server(ServerConfig(gemma3, **flags))
    said = [record_one(spec.url, RequestItem(ep, dict(b)), spec.config.flags_block()) for ep, b in NR_BODIES]
    truth = [record_one(plain.url, RequestItem(ep, dict(b)), plain.config.flags_block()) for ep, b in NR_BODIES]
    assert all(t["server"]["flags"]["--no-repack"] is True for t in said)
    unsaid = json.loads(json.dumps(said))
    for t in unsaid:
        del t["server"]["flags"]["--no-repack"]
    d = tmp_path_factory.mktemp("no-repack")
    paths = []
    for name, ts in (("said", said), ("unsaid", unsaid)):
        (d / f"{name}.jsonl").write_text("".join(dumps(t, indent=None) + "\n" for t in ts))
        paths.append(d / f"{name}.jsonl")
    return paths[0], paths[1], truth


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
@pytest.mark.parametrize("which", ["said", "unsaid"])
def test_a_no_repack_server_is_recovered_exactly_whether_or_not_its_flag_was_recorded(which, no_repack_gemma, gemma3,
                                                                                      b11434, tmp_path):
    """--no-repack changes Gemma 3 Q4_K_M's values (0.19 nats on a first token measured): read from the
    transcript where `record` wrote it, and found among the probed candidates where it did not."""
    from replay.proof.matrix import max_value_diff
    said, unsaid, truth = no_repack_gemma
    src = said if which == "said" else unsaid
    out = tmp_path / "fixed.jsonl"
    p = cli("recover", src, "-m", gemma3, "-o", out, "--json", "--libllama", b11434.bin_dir)
    assert p.returncode == 0, p.stderr[-2000:]
    reps = json.loads(p.stdout)["records"]
    cpu = reps[0]["numerics"]["cpu"]
    assert cpu["repack"] is False and cpu["how"] == "matched", cpu
    if which == "unsaid":  # the probe told it from the candidates with extra buffer types
        assert any(d is not None and d > 1e-3 for v, d in cpu["probes"].items() if not v.endswith("--no-repack")), cpu
    assert sum(r["summary"]["counts"]["placeholder"] for r in reps) > 0, "nothing was speculated"
    assert all(r["summary"]["counts"]["mismatch"] == 0 for r in reps)
    worst, n = 0.0, 0
    for line, t in zip(out.read_text().splitlines(), truth):
        w, k = max_value_diff(json.loads(line), t)
        worst, n = max(worst, w), n + k
    assert n >= 20 and worst <= 5e-4, (worst, n)
    print(f"\n--no-repack Gemma 3 ({which}): replayed on {cpu['description']}; max |recovered - unspeculated| "
          f"{worst:.2e} over {n} tokens")


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_a_transcript_whose_kernels_crash_here_is_refused_in_one_line_naming_them(b11434, smollm2, tmp_path,
                                                                                 monkeypatch, fresh_verdicts):
    """Recorded from the best variant that runs here; then every variant that computes it alike (its class,
    as recover finds it) is made to crash (SPEC_REPLAY_INJECT_CRASH), as sapphirerapids' AMX kernels do on
    an AMX host: recover refuses in one line that names them and asks for a host that runs them."""
    from replay.commands.record import RequestItem, record_one
    from replay.llamacpp.kernels import variants_that_run
    from replay.llamacpp.process import LlamaServer, ServerConfig
    from replay.transcripts.format import dumps
    best = variants_that_run(b11434.bin_dir)[0]
    body = {"prompt": "The lighthouse keeper climbed the stairs every night at nine, and", "n_predict": 16,
            "n_probs": 3, "temperature": 1.0, "seed": 4}
    with LlamaServer(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",)),
                     binary=b11434.with_cpu(best).server) as srv:
        src = tmp_path / "t.json"
        src.write_text(dumps(record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())))
    p = cli("recover", src, "-m", smollm2, "-o", tmp_path / "ok.json", "--json", "--libllama", b11434.bin_dir)
    assert p.returncode == 0, p.stderr[-2000:]
    cpu = json.loads(p.stdout)["records"][0]["numerics"]["cpu"]
    alike = sorted({cpu["variant"], *(e.split()[0] for e in cpu["equal"])})
    assert best in alike, cpu
    inject = ",".join(f"{v}:SIGILL:always" for v in alike)
    out = tmp_path / "refused.json"
    p = cli("recover", src, "-m", smollm2, "-o", out, "--libllama", b11434.bin_dir, env={health.INJECT_ENV: inject})
    assert p.returncode == 3 and not out.exists(), p.stderr[-2000:]
    (line,) = errors(p)
    assert "matches none of this host's CPU kernels" in line and "crash" in line, line
    assert "recover on a host that runs them" in line and all(v in line for v in alike), line
    print(f"\n{line}")
