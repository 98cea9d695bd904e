"""One table of llama-server's settings (replay/settings): spelled as the server spells its flags,
the source of every command's server options, of the config objects, of the transcript block
`record` writes and of the command lines the harness starts servers with."""
from __future__ import annotations

import json
import re

import pytest
from cli_helpers import run

from replay.cli import main
from replay.errors import Exit
from replay.llamacpp.process import ServerConfig
from replay.settings import BY_ATTR, SETTINGS, describe, flags_block, recorded_flags, resolve, rows


def _server_options(command: str) -> dict[str, tuple[str, ...]]:
    """{attr: option names} of a command's options that are settings rows."""
    cmd = main.commands[command]
    return {p.name: tuple(p.opts) for p in cmd.params if p.name in BY_ATTR}


@pytest.mark.parametrize("command,groups", [("record", ("speculative", "context", "sampling")),
                                            ("trace", ("speculative", "context", "sampling")),
                                            ("recover", ("speculative", "context", "sampling")),
                                            ("diff", ("speculative", "context", "sampling"))])
def test_every_command_takes_the_server_flags_as_the_table_spells_them(command, groups):
    assert _server_options(command) == {s.attr: s.names for s in rows(*groups)}


def test_check_takes_the_speculative_flags_it_can_compare_with_slots():
    assert set(_server_options("check")) == {s.attr for s in rows("speculative")} - {"draft_model"}


def test_record_and_trace_share_the_ngram_spellings():
    """Regression: record took `--spec-ngram NAME=VALUE` while trace took eleven --spec-ngram-* flags."""
    for command in ("record", "trace"):
        assert _server_options(command)["ngram_mod_n_match"] == ("--spec-ngram-mod-n-match",)


def test_flags_resolve_over_props_over_the_transcript_over_the_defaults():
    recorded = recorded_flags({"--spec-type": ["ngram-mod"], "--ctx-size": 512, "--spec-ngram-mod-n-match": "20"}, None)
    props = {"default_generation_settings": {"n_ctx": 256}}
    spec = resolve("speculative", flags={"ngram_mod_n_max": 32}, recorded=recorded, props=props)
    ctx = resolve("context", flags={"n_batch": 64}, recorded=recorded, props=props)
    assert (spec.spec_types, spec.ngram_mod_n_match, spec.ngram_mod_n_max, spec.ngram_mod_n_min) == \
        (("ngram-mod",), 20, 32, 48)
    assert spec.sources["spec_types"] == "server.flags" and spec.sources["ngram_mod_n_max"] == "command line"
    assert (ctx.n_ctx, ctx.sources["n_ctx"]) == (256, "/props")  # what the server reported it ran with
    assert (ctx.n_batch, ctx.sources["n_batch"], ctx.n_ubatch, ctx.sources["n_ubatch"]) == (64, "command line", 512, "default")
    assert ("--spec-ngram-mod-n-match", 20, "server.flags") in describe(spec)


def test_the_first_build_with_a_flag_is_a_column_of_the_table():
    assert BY_ATTR["draft_sampling"].since == 11368  # PR #27694 (builds/loop_shapes.py, era H)
    assert BY_ATTR["spec_types"].since is None
    assert resolve("speculative").draft_n_max == 3  # the default since b9246 (era C)


def test_the_transcript_keeps_the_servers_flags_by_their_spelling_and_reads_them_back():
    given = {"spec_types": ("ngram-mod", "draft-simple"), "draft_model": "d.gguf", "ngram_mod_n_match": 20,
             "draft_n_max": 5, "n_ctx": 256, "flash_attn": "off", "top_k": 8}
    block = json.loads(json.dumps(flags_block(given)))  # as it is stored
    assert block == {"--spec-type": ["ngram-mod", "draft-simple"], "--spec-draft-model": "d.gguf",
                     "--spec-draft-n-max": 5, "--spec-ngram-mod-n-match": 20, "--ctx-size": 256,
                     "--flash-attn": "off", "--top-k": 8}
    recorded = recorded_flags(block, None)
    spec = resolve("speculative", recorded=recorded)
    ctx = resolve("context", recorded=recorded)
    assert spec.given() == {k: v for k, v in given.items() if k in spec.given()} and len(spec.given()) == 4
    assert (ctx.n_ctx, ctx.flash_attn) == (256, "off")


def test_transcripts_recorded_before_server_flags_still_read():
    legacy = {"types": ["draft-simple"], "draft_model": "d.gguf", "draft_sampling": "greedy", "draft_n_max": None,
              "ngram": {"mod-n-match": "20"}, "n_ctx": 256, "n_parallel": 1, "threads": 2}
    assert recorded_flags(None, legacy) == {"--spec-type": ("draft-simple",), "--spec-draft-model": "d.gguf",
                                            "--spec-draft-sampling": "greedy", "--spec-ngram-mod-n-match": 20,
                                            "--ctx-size": 256, "--threads": 2, "--parallel": 1}


def test_an_unknown_recorded_flag_is_refused_by_name():
    with pytest.raises(ValueError, match="'--frobnicate' is not a llama-server flag"):
        recorded_flags({"--frobnicate": 1}, None)


@pytest.mark.parametrize("attr,value,message", [("draft_n_max", "three", "--spec-draft-n-max takes an integer"),
                                                ("flash_attn", "maybe", "--flash-attn: 'maybe' is not one of"),
                                                ("spec_types", "draft-magic", "--spec-type: unknown value")])
def test_a_bad_value_names_the_flag(attr, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BY_ATTR[attr].parse(value)


def test_a_bad_flag_value_on_the_command_line_is_a_usage_error(tmp_path):
    r = run("trace", "--prompt", "bcd", "-m", tmp_path / "m.gguf", "--spec-draft-n-max", "x")
    assert r.exit_code == Exit.USAGE and "--spec-draft-n-max takes an integer" in r.output


def test_spec_type_takes_a_comma_list_or_repeats_like_the_server():
    from replay.cli.options import given_flags
    assert given_flags({"spec_types": (("ngram-mod", "draft-simple"), ("ngram-cache",))}) == \
        {"spec_types": ("ngram-mod", "draft-simple", "ngram-cache")}


def test_server_command_lines_use_the_servers_spellings(tmp_path):
    cfg = ServerConfig(tmp_path / "t.gguf", draft_model=tmp_path / "d.gguf", spec_types=("draft-simple",),
                       draft_n_max=5, n_ubatch=128)
    args = cfg.args()
    assert args[:2] == ["-m", str(tmp_path / "t.gguf")]
    pairs = dict(zip(args[2::2], args[3::2]))
    assert pairs == {"--spec-type": "draft-simple", "--spec-draft-model": str(tmp_path / "d.gguf"),
                     "--spec-draft-n-max": "5", "--ctx-size": "2048", "--ubatch-size": "128", "--threads": "2",
                     "--parallel": "1"}
    with pytest.raises(ValueError, match="not llama-server settings: draft"):
        ServerConfig(tmp_path / "t.gguf", draft=tmp_path / "d.gguf")


@pytest.mark.build
def test_every_flag_is_spelled_as_in_the_servers_arg_parser(b11434):
    """Each row's names appear together in one common_arg({...}) of b11434's common/arg.cpp (a flag with a
    negation, `--repack` / `-nr, --no-repack`, declares the second in a second {...})."""
    from replay.proof.patch_proof import pinned_tree
    source = (pinned_tree("b11434") / "common" / "arg.cpp").read_text()
    declared = [tuple(re.findall(r'"(-[^"]+)"', a + b))
                for a, b in re.findall(r"common_arg\(\s*\{([^}]*)\}(?:\s*,\s*\{([^}]*)\})?", source)]
    for s in SETTINGS:
        assert any(set(s.names) <= set(names) for names in declared), f"{s.names} not declared together in arg.cpp"


def test_every_speculative_type_of_b11434_is_in_the_table_and_the_unreplayable_are_refused_by_name():
    """common/speculative.cpp:72-84 lists draft-dspark; it was missing, and click rejected it."""
    from replay.loop.replayable import PRIORITY, UNSUPPORTED
    from replay.settings.table import SPEC_TYPES
    assert set(SPEC_TYPES) == {"none", *PRIORITY, *UNSUPPORTED}
    assert "draft-dspark" in UNSUPPORTED and "hidden states" in UNSUPPORTED["draft-dspark"]


def test_every_kv_cache_type_the_table_accepts_has_a_ggml_type():
    """-ctk iq4_nl was accepted by the table and raised KeyError in Context: one table now."""
    from replay.settings.cache_types import GGML_CACHE_TYPES
    from replay.settings.table import BY_ATTR
    assert BY_ATTR["cache_type_k"].choices == tuple(GGML_CACHE_TYPES) == BY_ATTR["cache_type_v"].choices
    assert GGML_CACHE_TYPES["iq4_nl"] == 20  # GGML_TYPE_IQ4_NL, ggml/include/ggml.h
