"""`spec-replay patch`: a server-context.cpp fix for the user's tree, proven on rebuilt servers.

The patched b11434 server, speculating (draft-simple greedy t0/t1, probabilistic t1,
ngram-mod; SmolLM2 and the tiny fixture), must give every emitted token a real entry
with a full top-N list on all three endpoints, stream and not, pre- and post-sampling,
equal to `trace`'s prediction, and (sample-and-match setups) to the unspeculated
server's values; with n_probs 0 it must answer exactly like the unpatched server.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
from click.testing import CliRunner
from tiers import WIDE

from replay.cli import main
from replay.errors import Exit, PatchError
from replay.llamacpp import models
from replay.llamacpp.build import BuildSpec, ensure_built
from replay.proof.patch_proof import (
    check_no_probs,
    check_values,
    default_setups,
    pinned_tree,
    saved_patch,
)
from replay.proof.patches import SERVER_FILE, detect_server_profile, server_patch

pytestmark = pytest.mark.build  # every test reads or builds a pinned llama.cpp tree


def _git_apply_check(tree, patch_file):
    return subprocess.run(["git", "--git-dir=/nonexistent", "apply", "--check", "-p1", str(patch_file)],
                          cwd=tree, capture_output=True, text=True)


@pytest.mark.parametrize("profile", ["b11434", "0c1e570"])
def test_the_patch_applies_to_each_known_tree(profile, tmp_path):
    tree = pinned_tree(profile)
    assert detect_server_profile(tree) == profile
    out = tmp_path / "fix.patch"
    r = CliRunner().invoke(main, ["patch", "--source", str(tree), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert _git_apply_check(tree, out).returncode == 0
    text = out.read_text()
    assert "populate_token_probs(slot, result, false, params_base.special, i_verify[i])" in text
    assert "-                result.prob         = 1.0f; // set later" in text


def test_a_tree_with_other_code_is_refused_naming_the_function(tmp_path):
    tree = tmp_path / "llama.cpp"
    (tree / "tools" / "server").mkdir(parents=True)
    src = (pinned_tree("b11434") / SERVER_FILE).read_text()
    (tree / SERVER_FILE).write_text(src.replace("// TODO: set result.probs", "// probs: see below"))
    with pytest.raises(PatchError, match=r"post_decode\(\) does not contain .*speculative emission placeholder"):
        server_patch(tree)
    (tree / SERVER_FILE).write_text(src.replace("void populate_token_probs(", "void fill_token_probs("))
    r = CliRunner().invoke(main, ["patch", "--source", str(tree)])
    assert r.exit_code == Exit.ERROR
    assert r.output.strip().splitlines() == [
        f"Error: {SERVER_FILE}: cannot find populate_token_probs(); this llama.cpp version is not one "
        "spec-replay knows how to patch (b11434, 0c1e570)"]


def test_not_a_llama_cpp_tree_and_an_existing_output_are_clean_errors(tmp_path):
    r = CliRunner().invoke(main, ["patch", "--source", str(tmp_path)])
    assert r.exit_code == Exit.ERROR and "no tools/server/server-context.cpp" in r.output
    out = tmp_path / "keep.patch"
    out.write_text("mine")
    r = CliRunner().invoke(main, ["patch", "--build", "b11434", "-o", str(out)])
    assert r.exit_code == Exit.ERROR and "exists" in r.output
    assert out.read_text() == "mine"


def test_an_already_patched_tree_is_refused(tmp_path):
    tree = tmp_path / "t"
    shutil.copytree(pinned_tree("0c1e570") / "tools" / "server", tree / "tools" / "server")
    p = tmp_path / "fix.patch"
    p.write_text(server_patch(tree).diff)
    subprocess.run(["git", "--git-dir=/nonexistent", "apply", "-p1", str(p)], cwd=tree, check=True)
    with pytest.raises(PatchError, match="already patched"):
        server_patch(tree)


@pytest.fixture(scope="session")
def patched_b11434(b11434):
    diff = server_patch(pinned_tree("b11434")).diff
    return ensure_built(BuildSpec("b11434", patch=saved_patch(diff, "server-b11434")))


@pytest.mark.model
@pytest.mark.live_server
def test_patched_server_reports_what_trace_predicts_everywhere(patched_b11434, b11434, smollm2, smollm2_draft):
    setups = default_setups(smollm2, smollm2_draft, models.tiny_target(), models.tiny_draft())
    rows = check_values(patched_b11434, b11434, setups, seeds=range(1, 2), tree=pinned_tree("b11434"))
    assert len(rows) == 4 * 3 * 2 * 2 + 3 * 2 * 2 * 2  # SmolLM2: 3 endpoints, tiny: 2; x stream x mode
    failed = [(r.setup, r.endpoint, r.stream, r.mode, r.problems[:2]) for r in rows if not r.passed]
    assert not failed
    for r in rows:
        assert r.tokens > 0 and r.real == r.tokens  # every token real, with a full top-N list
        assert r.vs_trace <= 1e-6
        if "probabilistic" not in r.setup:
            assert r.vs_plain is not None and r.vs_plain <= 5e-4
    # measured: the pre- and post-sampling values equal trace's bit for bit
    assert max(r.vs_trace for r in rows) == 0.0


@pytest.mark.model
@pytest.mark.live_server
@WIDE
def test_without_probabilities_the_patch_changes_nothing(patched_b11434, b11434, smollm2, smollm2_draft):
    setups = default_setups(smollm2, smollm2_draft, models.tiny_target(), models.tiny_draft())
    rows = check_no_probs(patched_b11434, b11434, setups, seeds=range(1, 6))
    assert [r.problems for r in rows] == [[]] * len(setups)
    assert all(r.tokens > 0 for r in rows)


@pytest.mark.model
@pytest.mark.live_server
@pytest.mark.other_builds
def test_patched_0c1e570_server_reports_real_values(smollm2, smollm2_draft):
    unpatched = ensure_built(BuildSpec("0c1e570", cpu="native"))
    diff = server_patch(pinned_tree("0c1e570")).diff
    patched = ensure_built(BuildSpec("0c1e570", patch=saved_patch(diff, "server-0c1e570"), cpu="native"))
    setups = [s for s in default_setups(smollm2, smollm2_draft, models.tiny_target(), models.tiny_draft())
              if s.name in ("smol draft-simple greedy t1", "smol ngram-mod t0")]
    setups = [type(s)(**{**s.__dict__, "endpoints": ("/completion",)}) for s in setups]
    rows = check_values(patched, unpatched, setups, seeds=range(1, 2), tree=pinned_tree("0c1e570"))
    assert all(r.passed for r in rows), [(r.setup, r.problems) for r in rows if not r.passed]
    assert all(r.real == r.tokens > 0 for r in rows)
