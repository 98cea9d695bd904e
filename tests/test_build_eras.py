"""The loop shape no pinned tree has, on its own real build: era H (b11368..b11382), the rejection
verifier's first builds, whose n-gram drafts cut to n_max at t > 0 go through rejection against empty
draft distributions. `pytest -m other_builds` builds b11368 for it (builds/loop_shapes.py; the pinned trees are eras I
and G); the default run leaves it out.

Every configuration of the build matrix (replay/proof/matrix.py), 10 seeds each: trace token-exact
in the shape chosen from build_info, recover equal to the build's own unspeculated server.
"""
from __future__ import annotations

import pytest

from replay.builds.loop_shapes import shape_for
from replay.llamacpp import models
from replay.llamacpp.build import BuildSpec, ensure_built
from replay.proof.matrix import CONFIGS, run_config

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model, pytest.mark.other_builds]


@pytest.fixture(scope="module")
def b11368():
    return ensure_built(BuildSpec("b11368", cpu="native"))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_era_h_is_replayed_on_its_own_build(cfg, b11368, smollm2):
    assert shape_for(build_info=b11368.build_info).era.key == "H"
    out = run_config(cfg, b11368, smollm2, models.smollm2_draft(b11368.quantize))
    assert out["reproduced"] == out["records"] == 10, out["divergences"][:2]
    assert out["drafted"] > 0 and out["mismatch"] == 0
    # a probabilistic draft changes the draws, so that run parts from the unspeculated one early
    least = 5 if cfg.sampling == "probabilistic" else 50
    assert out["max_diff"] <= 5e-4 and out["compared"] >= least, (out["max_diff"], out["compared"])
    if cfg.name == "ngram-simple t1":
        assert out["ngram_rejection_steps"] > 0, "the q-trim path never ran: the test would prove nothing"
