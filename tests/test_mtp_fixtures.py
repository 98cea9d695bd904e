"""The MTP fixtures (fixtures/make_tiny_mtp.py): tiny hy_v3 targets with one and two nextn layers, which
the real b11434 llama-server loads and speculates with under `--spec-type draft-mtp` (its MTP draft
context, common/speculative.cpp:1390-1828), accepting some drafts and rejecting others.

Measured here (b11434, one slot, temperature 0, 48 tokens each of "hello world the", "abcabc", "The
quick brown fox", "Once upon a time"): the F32 one-head target drafted 84, 107, 54 and 48 tokens and
accepted 18, 10, 28 and 30.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import ServerConfig
from replay.paths import FIXTURES

PROMPTS = ("hello world the", "abcabc", "The quick brown fox", "Once upon a time")
FILES = ("tiny-hyv3-mtp1.gguf", "tiny-hyv3-mtp2.gguf", "tiny-hyv3-q8_0-mtp1.gguf", "tiny-hyv3-q8_0-mtp2.gguf")


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
                                                            "temperature": 0.0, "cache_prompt": False}),
                       srv.config.flags_block())
        timings = t["response"]["timings"]
        drafted, accepted = drafted + timings["draft_n"], accepted + timings["draft_n_accepted"]
        placeholders += sum(p["logprob"] == 0.0 and not p["top_logprobs"]
                            for p in t["response"]["completion_probabilities"][1:])
    print(f"\n{name}: drafted {drafted}, accepted {accepted}, placeholders {placeholders} of {4 * 47}")
    assert 0 < accepted < drafted, (drafted, accepted)
    assert placeholders >= 4 * 40, placeholders
    assert "creating MTP draft context" in srv.log()
