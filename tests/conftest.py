"""Shared fixtures: the real llama.cpp build, SmolLM2, and live servers.

Tiers, by marker (pyproject.toml):

    build         needs a llama.cpp program built by our CMakeLists.txt (first use: minutes)
    live_server   starts a real llama-server
    model         needs a real model: SmolLM2 or Gemma 3 (fetched into the cache on first use)

`pytest -m "not build and not live_server and not model and not ray and not processes and not browser"`
is the quick tier (about a minute): it builds and downloads nothing, and starts no Ray head, no
worker processes and no browser (`ray`, `processes` and `browser` tests also build nothing, and run
in the default suite). The fixtures below enforce the markers: a test that uses a build, a server
or SmolLM2 without carrying the marker fails, so the quick tier cannot silently grow heavy.

Servers are fresh for every test that uses one (`plain_server`, `self_draft_server`,
`start_server`): a test that asserts exact server behaviour must not depend on what an earlier
test left in a slot (prompt cache, drafter state, a request cut short by a timeout), so the
suite passes in any order. Everything heavy is built or fetched once into ~/.cache/spec-replay
(or $SPEC_REPLAY_CACHE).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from replay.llamacpp import models
from replay.llamacpp.build import BuildSpec, ensure_built
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.runtime import binding

os.environ.setdefault("SPEC_REPLAY_TESTING", "1")
# What runs on this host is known once for the whole run (runtime/health.py), also by the quick tier's
# subprocesses, whose cache root is empty: a verdict is about the host, not about what was built. Where
# it is kept is set once the tests are collected (pytest_collection_finish): the cache's own health/ for a
# run that builds, a directory of the run's own for the quick tier, which leaves the cache untouched.
from replay.paths import cache_root  # noqa: E402
from replay.runtime import health  # noqa: E402

# One libllama for the whole test process, loaded once the tests are collected
# (pytest_collection_finish): the kernels of the servers the suite starts when it runs any (b11434's
# own libllama on the best CPU variant that runs here, the one llamacpp/kernels.py gives the servers),
# else llama-cpp-python's own. In-process CLI calls then keep it (cli/options.py: choose_libllama);
# tests of another libllama run the CLI in a subprocess (tests/test_binding.py). llama-cpp-python's
# own library is -march=native: on an AVX2 host it computes as haswell does, but on an AMX host (AMX
# left out, AVX512-FP16 and AVX-VNNI kept) as no variant does (0.033 nats on a Gemma 3 Q4_K first entry).
os.environ.pop(binding.ENV, None)


# what each fixture needs; a test whose fixtures (transitively) need a marker must carry it
NEEDS = {"b11434": ("build",), "server_cpu": ("build",), "smollm2": ("model",), "smollm2_draft": ("model", "build"), "gemma3": ("model",),
         "gemma3_draft": ("model", "build"),
         "start_server": ("build", "live_server"), "module_server": ("build", "live_server"),
         "browser": ("browser",), "open_page": ("browser",)}


def pytest_collection_modifyitems(config, items):
    """Refuse to run a suite in which a test's fixtures (transitively) need a marker it lacks."""
    bad = []
    for item in items:
        needed = {m for f in item.fixturenames for m in NEEDS.get(f, ())}
        missing = sorted(m for m in needed if item.get_closest_marker(m) is None)
        if missing:
            bad.append(f"{item.nodeid} needs {', '.join(missing)} but is not marked so")
    if bad:
        raise pytest.UsageError("tests with missing markers:\n  " + "\n  ".join(bad))


_OWN_HEALTH: list[str | None] = [None]  # the quick tier's own verdict directory, removed when the run ends


def pytest_sessionfinish(session, exitstatus):
    if _OWN_HEALTH[0] is not None:
        shutil.rmtree(_OWN_HEALTH[0], ignore_errors=True)


def pytest_collection_finish(session):
    """Load the test process's libllama (see above), once: b11434's when a collected test is marked
    `build` (building it first on a fresh machine, as its first such test would), else llama-cpp-python's."""
    heavy = any(item.get_closest_marker(m) is not None for item in session.items for m in ("build", "model",
                                                                                            "live_server"))
    if health.CACHE_ENV not in os.environ:
        if heavy:
            os.environ[health.CACHE_ENV] = str(cache_root() / "health")
        else:
            os.environ[health.CACHE_ENV] = _OWN_HEALTH[0] = tempfile.mkdtemp(prefix="spec-replay-health-")
    if any(item.get_closest_marker("build") is not None for item in session.items):
        from replay.llamacpp.libllama import libllama_of
        binding.use_libllama(libllama_of(ensure_built(BuildSpec("b11434"))))
    binding.load()


@pytest.fixture(autouse=True)
def _no_build_unless_marked(request, monkeypatch, tmp_path_factory):
    """In a test not marked `build`, any attempt to build llama.cpp fails instead of building, and
    the server's own request parsing (spec-replay-request, built with a tree) is not at hand: such a
    test runs the same whether or not an earlier test built something. A quick-tier test (no
    `build`, `model` or `live_server`) also gets an empty cache root, for its subprocesses too: the
    CLI it runs finds no build there (no CPU variants to probe, no build's own libllama), as on a
    machine where nothing was built."""
    marks = {m for m in ("build", "model", "live_server") if request.node.get_closest_marker(m) is not None}
    if not marks:
        monkeypatch.setenv("SPEC_REPLAY_CACHE", str(tmp_path_factory.mktemp("empty-cache")))
    if "build" not in marks:
        from replay.llamacpp import build
        from replay.tokens import server_view

        def refuse(*a, **k):
            raise AssertionError("this test builds llama.cpp but is not marked `build`")
        monkeypatch.setattr(build, "ensure_built", refuse)
        monkeypatch.setattr(server_view, "find_helper", lambda build: None)


@pytest.fixture(scope="session")
def b11434():
    """The real b11434 llama-server, llama-speculative and llama-quantize."""
    return ensure_built(BuildSpec("b11434"))


@pytest.fixture(scope="session")
def patched(b11434):
    """The same b11434 build patched by `spec-replay patch`: it reports the values its speculative loop
    computed (the truth of a speculating server's values)."""
    from replay.proof.patch_proof import pinned_tree, saved_patch
    from replay.proof.patches import server_patch
    return ensure_built(BuildSpec("b11434", patch=saved_patch(server_patch(pinned_tree("b11434")).diff,
                                                              "server-b11434")))


@pytest.fixture(scope="session")
def server_cpu(b11434) -> tuple[str, ...]:
    """`--server-cpu V` for a transcript of a server this suite started from the b11434 build on this
    host: V is the variant it computed with, the best that runs on this host (llamacpp/kernels.py). For subprocess runs of tests that
    are not about finding the kernels (tests/test_cpu_variants.py is), which would otherwise probe
    every variant on every long prompt."""
    from replay.llamacpp.kernels import variants_that_run
    can = variants_that_run(b11434.bin_dir)
    return ("--server-cpu", can[0]) if can else ()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return models.smollm2()


@pytest.fixture(scope="session")
def smollm2_draft(b11434, smollm2) -> Path:
    return models.smollm2_draft(b11434.quantize)


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M Q4_K_M: sliding-window attention (window 512), a 262,144-token vocabulary, no chat template."""
    return models.gemma3()


@pytest.fixture(scope="session")
def gemma3_draft(b11434, gemma3) -> Path:
    return models.gemma3_draft(b11434.quantize)


class _Servers:
    """Starts servers on demand (b11434 unless another binary is given) and stops them all."""

    def __init__(self, binaries):
        self.binaries, self.started = binaries, []

    def __call__(self, config: ServerConfig, binary: Path | None = None) -> LlamaServer:
        srv = LlamaServer(config, binary=binary or self.binaries.server)
        self.started.append(srv)
        srv.start()
        return srv

    def stop(self) -> None:
        for srv in self.started:
            srv.stop()


@pytest.fixture
def start_server(b11434):
    """start_server(config) -> a fresh running LlamaServer (b11434), stopped when the test ends."""
    servers = _Servers(b11434)
    yield servers
    servers.stop()


@pytest.fixture
def plain_server(start_server, smollm2):
    """SmolLM2 without speculation: the reference for real probabilities."""
    return start_server(ServerConfig(smollm2))


@pytest.fixture
def self_draft_server(start_server, smollm2):
    """SmolLM2 as its own draft (draft-simple): every token after the first is speculative."""
    return start_server(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",)))


@pytest.fixture
def ngram_mod_server(start_server, smollm2):
    """SmolLM2 with the ngram-mod drafter (drafts 48-64 tokens after a 24-token match)."""
    return start_server(ServerConfig(smollm2, spec_types=("ngram-mod",)))


@pytest.fixture(scope="module")
def module_server(b11434):
    """module_server(config) -> a running LlamaServer for one module's module-scoped fixtures
    (which record from it once); stopped when the module ends."""
    servers = _Servers(b11434)
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def compile_cpp(tmp_path_factory):
    """Compile a C++ reference program with g++ (the libstdc++ the emulations must match)."""
    import shutil
    import subprocess

    def compile_(name: str, source: str, include: tuple[Path, ...] = ()) -> Path:
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.fail("g++ is needed to check the emulation against libstdc++ (scripts/setup installs it)")
        d = tmp_path_factory.mktemp(name)
        (d / f"{name}.cpp").write_text(source)
        subprocess.run([gxx, "-O1", *[f"-I{i}" for i in include], "-o", str(d / name), str(d / f"{name}.cpp")],
                       check=True)
        return d / name
    return compile_


@pytest.fixture(scope="module")
def tiny_evals(request, tmp_path_factory) -> Path:
    """A JSONL of the module's N_RECORDS independent tiny-fixture records (test_workers, test_ray)."""
    from cli_helpers import tiny_jsonl
    return tiny_jsonl(tmp_path_factory.mktemp("evals") / "evals.jsonl", request.module.N_RECORDS)


@pytest.fixture(scope="module")
def tiny_evals_one_worker(tiny_evals, tmp_path_factory) -> bytes:
    """`tiny_evals` recovered by one process: the bytes every sharded run must write."""
    from cli_helpers import recover_in_subprocess
    out = tmp_path_factory.mktemp("one") / "out.jsonl"
    r = recover_in_subprocess(tiny_evals, models.tiny_target(), out)
    assert r.returncode == 0, r.stderr
    return out.read_bytes()


def pytest_runtest_logreport(report):
    """With SPEC_REPLAY_TEST_TIMES=FILE, append each phase's duration as it ends (setup includes the
    fixtures it builds: servers, llama.cpp trees), so that a run cut short still says where its time went."""
    path = os.environ.get("SPEC_REPLAY_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.1f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
