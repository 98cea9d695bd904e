"""The MTP fixtures (fixtures/make_tiny_mtp.py): tiny hy_v3 targets with one and two nextn layers and a
tiny qwen35 (hybrid: gated delta-net and attention layers) and a tiny glm4moe (an MoE nextn layer)
with one, which
the real b11434 llama-server loads and speculates with under `--spec-type draft-mtp` (its MTP draft
context, common/speculative.cpp:1390-1828), accepting some drafts and rejecting others.

Measured here (b11434, one slot, temperature 0, 48 tokens each of "hello world the", "abcabc", "The
quick brown fox", "Once upon a time"): the F32 one-head target drafted 84, 107, 54 and 48 tokens and
accepted 18, 10, 28 and 30; the F32 qwen35 drafted 38, 37, 45 and 42 and accepted 34, 34, 31 and 32.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import ServerConfig
from replay.paths import FIXTURES

PROMPTS = ("hello world the", "abcabc", "The quick brown fox", "Once upon a time")
FILES = ("tiny-hyv3-mtp1.gguf", "tiny-hyv3-mtp2.gguf", "tiny-hyv3-q8_0-mtp1.gguf", "tiny-hyv3-q8_0-mtp2.gguf",
         "tiny-qwen35-mtp1.gguf", "tiny-qwen35-q8_0-mtp1.gguf", "tiny-glm4moe-mtp1.gguf", "tiny-glm4moe-q8_0-mtp1.gguf")


def test_the_mtp_fixtures_regenerate_byte_for_byte():
    p = subprocess.run([sys.executable, str(FIXTURES / "make_tiny_mtp.py"), "--check"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(line.split()[1] for line in p.stdout.splitlines() if line.startswith("ok")) == sorted(FILES)


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.parametrize("name", FILES)
def test_a_real_mtp_server_drafts_with_the_fixtures_heads_and_accepts_some(name, start_server):
    """Every token after the first comes from the speculative loop (placeholders: prob 1, no alternatives)
    and the drafts are partly accepted: the loop's accept, reject and resample paths all run."""
    srv = start_server(ServerConfig(FIXTURES / name, n_ctx=256, n_parallel=1, spec_types=("draft-mtp",)))
    drafted = accepted = placeholders = 0
    for prompt in PROMPTS:
        t = record_one(srv.url, RequestItem("/completion", {"prompt": prompt, "n_predict": 48, "n_probs": 2,
                                                            "temperature": 0.0, "cache_prompt": False,
                                                            "ignore_eos": True}),
                       srv.config.flags_block())
        timings = t["response"]["timings"]
        drafted, accepted = drafted + timings["draft_n"], accepted + timings["draft_n_accepted"]
        placeholders += sum(p["logprob"] == 0.0 and not p["top_logprobs"]
                            for p in t["response"]["completion_probabilities"][1:])
    print(f"\n{name}: drafted {drafted}, accepted {accepted}, placeholders {placeholders} of {4 * 47}")
    assert 0 < accepted < drafted, (drafted, accepted)
    assert placeholders >= 4 * 40, placeholders
    assert "creating MTP draft context" in srv.log()


def test_a_target_without_nextn_tensors_cannot_have_drafted_with_mtp_heads(tmp_path):
    """check_mtp (loop/draft_mtp.py) takes the fixtures and refuses, in one line, a file whose metadata
    declares a nextn layer but holds none of its tensors (hy_v3 then loads the trunk alone,
    src/models/hy-v3.cpp:26-32, and an MTP graph would run without weights) and a model with no nextn
    layers at all."""
    sys.path.insert(0, str(FIXTURES))
    import make_tiny_mtp as mk
    from make_tiny_arch import write_gguf

    from replay.errors import TranscriptError
    from replay.llamacpp.models import tiny_target
    from replay.loop.draft_mtp import check_mtp
    from replay.runtime.llama import Model

    a = mk.hy_v3(1)
    layer = a.layer_tensors
    a.layer_tensors = lambda il: [t for t in layer(il) if not t[0].startswith("nextn.")]
    trunk_only = tmp_path / "trunk-only.gguf"
    write_gguf(trunk_only, a, mk.weights(1), "trunk only")
    with Model(FIXTURES / "tiny-hyv3-q8_0-mtp2.gguf") as m:
        check_mtp(m)
        assert m.n_layer_nextn == 2
    with Model(trunk_only) as m, pytest.raises(TranscriptError, match="holds no nextn tensors"):
        check_mtp(m)
    with Model(tiny_target()) as m, pytest.raises(TranscriptError, match="has no nextn"):
        check_mtp(m)
