"""Shared fixtures: the real llama.cpp build, SmolLM2, and live servers.

Everything heavy is built or fetched once into ~/.cache/spec-replay (or
$SPEC_REPLAY_CACHE) on first use, so a fresh machine needs nothing beyond
`scripts/setup`. Servers are session-scoped and always stopped.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from replay import models
from replay.build import BuildSpec, ensure_built
from replay.server import LlamaServer, ServerConfig

os.environ.setdefault("SPEC_REPLAY_TESTING", "1")


@pytest.fixture(scope="session")
def b11434():
    """The real b11434 llama-server, llama-speculative and llama-quantize."""
    return ensure_built(BuildSpec("b11434"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return models.smollm2()


@pytest.fixture(scope="session")
def smollm2_draft(b11434) -> Path:
    return models.smollm2_draft(b11434.quantize)


def _server(binaries, config: ServerConfig):
    srv = LlamaServer(config, binary=binaries.server)
    srv.start()
    return srv


@pytest.fixture(scope="session")
def plain_server(b11434, smollm2):
    """SmolLM2 without speculation: the reference for real probabilities."""
    srv = _server(b11434, ServerConfig(model=smollm2))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def self_draft_server(b11434, smollm2):
    """SmolLM2 as its own draft (draft-simple): every token after the first is speculative."""
    srv = _server(b11434, ServerConfig(model=smollm2, draft=smollm2, spec_types=("draft-simple",)))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def ngram_mod_server(b11434, smollm2):
    """SmolLM2 with the ngram-mod drafter (drafts 48-64 tokens after a 24-token match)."""
    srv = _server(b11434, ServerConfig(model=smollm2, spec_types=("ngram-mod",)))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server_factory(b11434):
    """Start extra servers on demand; all are stopped at the end of the session."""
    started = []

    def start(config: ServerConfig) -> LlamaServer:
        srv = _server(b11434, config)
        started.append(srv)
        return srv
    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def compile_cpp(tmp_path_factory):
    """Compile a C++ reference program with g++ (the libstdc++ the emulations must match)."""
    import shutil
    import subprocess

    def compile_(name: str, source: str) -> Path:
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.fail("g++ is needed to check the emulation against libstdc++ (scripts/setup installs it)")
        d = tmp_path_factory.mktemp(name)
        (d / f"{name}.cpp").write_text(source)
        subprocess.run([gxx, "-O1", "-o", str(d / name), str(d / f"{name}.cpp")], check=True)
        return d / name
    return compile_
