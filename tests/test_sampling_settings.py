"""The sampling settings the server applies to a request (settings/sampling.py), layer by layer:
built-in defaults, the server's flags, the model file's general.sampling.* keys (only where the
flag was not given), the request, and the server's own echo. Each rule cites the line of
tools/server/server-schema.cpp or common/ it mirrors; the live field grid (test_field.py) shows
them on real servers."""
from __future__ import annotations

import math

import pytest

from replay.errors import TranscriptError
from replay.llamacpp.models import tiny_target, with_sampling_defaults
from replay.runtime.llama import Model
from replay.settings.sampling import (
    DEFAULT_SAMPLERS,
    effective,
    requested_n_probs,
    samplers_from_chars,
    samplers_from_names,
    server_sampling,
)


@pytest.fixture(scope="module")
def model_with_defaults(tmp_path_factory):
    path = with_sampling_defaults(tiny_target(), tmp_path_factory.mktemp("gguf") / "defaults.gguf",
                                  {"top_k": 3, "top_p": 0.9, "penalty_repeat": 1.05, "sequence": "top_k;temperature",
                                   "temp": 0.7})
    with Model(path) as m:
        yield m


def test_the_model_files_keys_apply_where_no_flag_was_given(model_with_defaults):
    layer = server_sampling(flags={"top_k": 8}, model_meta=model_with_defaults.meta)
    assert layer["top_k"] == (8, "command line")  # the flag sets its user bit: the file's top_k does not apply
    assert layer["top_p"] == (pytest.approx(0.9), "model file")
    assert layer["penalty_repeat"] == (pytest.approx(1.05), "model file")
    assert layer["temp"] == (pytest.approx(0.7), "model file")
    assert layer["samplers"] == (("top_k", "temperature"), "model file")
    assert layer["min_p"] == (0.05, "default")  # not in the file


def test_sampling_seq_sets_no_bit_so_the_files_sequence_wins(model_with_defaults):
    assert server_sampling(flags={"sampling_seq": "kpt"}, model_meta=model_with_defaults.meta)["samplers"] == \
        (("top_k", "temperature"), "model file")
    assert server_sampling(flags={"samplers": "min_p;temperature"}, model_meta=model_with_defaults.meta)[
        "samplers"] == (("min_p", "temperature"), "command line")


def test_the_model_files_values_are_read_as_the_server_renders_and_parses_them(model_with_defaults):
    # llama_model_meta_val_str renders a float with %f; strtof reads that text back
    assert model_with_defaults.meta("general.sampling.top_p") == "0.900000"


def test_a_request_overrides_every_layer_and_says_so(model_with_defaults):
    layer = server_sampling(model_meta=model_with_defaults.meta)
    eff = effective("/completion", {"prompt": "x", "top_k": 2, "temperature": -1, "seed": 5}, layer)
    assert (eff.params.top_k, eff.sources["top_k"]) == (2, "request")
    assert (eff.params.temp, eff.params.top_p, eff.sources["top_p"]) == (0.0, pytest.approx(0.9), "model file")
    assert ("--temp", 0.0, "request") in eff.describe()


def test_sampler_names_are_lowercased_with_their_aliases_and_a_string_is_read_letter_by_letter():
    assert samplers_from_names(["Top_K", "minp", "TOPNSIGMA", "typp", "nucleus", "temp", "typical"]) == \
        ("top_k", "min_p", "top_n_sigma", "typ_p", "top_p", "temperature")  # "typical" is not a name
    assert samplers_from_chars("kmt") == ("top_k", "min_p", "temperature")
    # no ';' splitting for a string: every letter counts (t, p, k, t, e, m, p, a, ...)
    assert samplers_from_chars("top_k;temp")[:3] == ("temperature", "top_p", "top_k")
    eff = effective("/completion", {"samplers": "top_k;temp"}, server_sampling())
    assert eff.params.samplers == samplers_from_chars("top_k;temp")


def test_n_predict_takes_the_first_present_of_n_predict_max_completion_tokens_max_tokens():
    layer = server_sampling(flags={"n_predict": 50})
    assert effective("/v1/chat/completions", {"max_tokens": 30, "max_completion_tokens": 10}, layer).n_predict == 10
    assert effective("/completion", {"n_predict": 7, "max_tokens": 30}, layer).n_predict == 7
    assert effective("/completion", {}, layer).n_predict == 50  # the server's -n
    assert effective("/completion", {"n_predict": -1}, layer).n_predict == 50  # -1 keeps the server's limit


def test_logprobs_true_asks_for_one_alternative_on_completion_and_twenty_on_chat():
    assert requested_n_probs("/completion", {"logprobs": True}) == 1
    assert requested_n_probs("/v1/completions", {"logprobs": 3}) == 3
    assert requested_n_probs("/v1/chat/completions", {"logprobs": True}) == 20
    assert requested_n_probs("/v1/chat/completions", {"logprobs": True, "top_logprobs": 4, "n_probs": 9}) == 4
    assert requested_n_probs("/v1/chat/completions", {"logprobs": False, "n_probs": 2}) == 2


def test_stop_replaces_the_servers_reverse_prompts_unless_empty():
    layer = server_sampling(flags={"antiprompt": ("User:",)})
    assert effective("/completion", {}, layer).stop == ("User:",)
    assert effective("/completion", {"stop": ["\n"]}, layer).stop == ("\n",)
    assert effective("/completion", {"stop": []}, layer).stop == ("User:",)


def test_a_requests_logit_bias_replaces_the_servers_and_its_ignore_eos():
    layer = server_sampling(flags={"logit_bias": ("15+1.5",), "ignore_eos": True})
    p = effective("/completion", {}, layer).params
    assert (p.logit_bias, p.eog_bias) == ([(15, 1.5)], True)
    p = effective("/completion", {"logit_bias": [[3, False], ["hello", 2]]}, layer).params
    assert (p.logit_bias, p.eog_bias) == ([(3, -math.inf), ("hello", 2.0)], False)
    assert effective("/completion", {"logit_bias": {}, "ignore_eos": True}, layer).params.eog_bias is True


def test_props_reports_the_servers_merge_and_wins_over_a_reconstruction(model_with_defaults):
    """Where /props agrees with a lower layer, that layer is the value's source (the model file
    said so); where it disagrees, the server was started with a flag nobody told us about."""
    props = {"default_generation_settings": {"params": {"top_k": 5, "samplers": ["top_k", "temperature"],
                                                        "n_predict": -1}}}
    layer = server_sampling(props=props, model_meta=model_with_defaults.meta)
    assert layer["top_k"] == (5, "/props") and layer["samplers"] == (("top_k", "temperature"), "model file")
    assert layer["n_predict"] == (-1, "default")  # /props always shows -1 there, whatever -n says


def test_the_servers_echo_wins_and_a_disagreement_is_noted():
    eff = effective("/completion", {"top_k": 4}, server_sampling(),
                    echo={"top_k": 9, "temperature": 0.800000011920929, "samplers": list(DEFAULT_SAMPLERS)})
    assert (eff.params.top_k, eff.sources["top_k"]) == (9, "generation_settings")
    assert eff.sources["temp"] == "default"  # same value as the echo's float32: no disagreement
    assert "top_k 4 -> 9" in eff.notes[0]


@pytest.mark.parametrize("body,message", [({"top_k": "many"}, '"top_k" must be a number'),
                                          ({"seed": 2**40}, "is not a 32-bit seed"),
                                          ({"repeat_last_n": -3}, "outside what the server accepts"),
                                          ({"stop": [1]}, '"stop" must be a string or a list of strings')])
def test_a_field_the_server_would_refuse_is_named(body, message):
    with pytest.raises(TranscriptError, match=message):
        effective("/completion", body, server_sampling())


def test_the_chain_parameters_default_to_the_settings_tables_values():
    """SamplingParams' defaults are the table's (one place to read a default from); the seed is the
    table's -1 as the server stores it (LLAMA_DEFAULT_SEED, uint32)."""
    import dataclasses

    from replay.settings.sampling import SamplingParams
    from replay.settings.table import BY_ATTR, rows
    params = SamplingParams()
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for s in rows("sampling"):
        if s.attr in fields and s.attr not in ("seed", "logit_bias", "samplers", "dry_sequence_breakers"):
            assert getattr(params, s.attr) == pytest.approx(s.default), s.flag
    assert params.seed == BY_ATTR["seed"].default & 0xFFFFFFFF


@pytest.mark.parametrize("bad", ["15043+", "15043+x"])
def test_a_malformed_logit_bias_flag_is_a_one_line_error(bad):
    from replay.settings.sampling import parse_logit_bias
    with pytest.raises(TranscriptError, match="TOKEN_ID"):
        parse_logit_bias([bad], cli=True)


@pytest.mark.parametrize("trigger", [{"type": 0, "value": "x"}, {"type": 0, "token": None},
                                     {"type": 1, "value": 5}])
def test_a_malformed_grammar_trigger_is_refused_by_name(trigger):
    from replay.reading.settings import _triggers
    with pytest.raises(TranscriptError, match="trigger"):
        _triggers([trigger])


def test_the_old_one_candidate_rule_rolls_back_dist_only_not_mirostats_mu():
    """Before b10355 dist drew nothing when one candidate was left (builds/loop_shapes.py single_draw), and the
    emulation rolled the whole chain back after such a pass; mirostat draws and updates mu on one
    candidate too (llama-sampler.cpp llama_sampler_mirostat_v2_apply), so rolling it back left mu
    0.5 bits behind the server's. A first pass that leaves one candidate raises mu from 10 to 10.5;
    the second keeps a token of 10.25 bits' surprise only with the raised mu."""
    import math

    import numpy as np

    from replay.llamacpp.models import tiny_target
    from replay.runtime.llama import Model
    from replay.runtime.sampler import SamplerChain
    from replay.settings.sampling import SamplingParams
    model = Model(tiny_target())
    params = SamplingParams(mirostat=2, mirostat_tau=5.0, mirostat_eta=0.1, temp=1.0, seed=3)
    one = np.full(model.n_vocab, -30.0, dtype=np.float32)
    one[0] = 0.0
    two = one.copy()
    two[1] = math.log(2 ** -10.25)
    sizes = []
    for single_draw in (True, False):
        chain = SamplerChain(model, params, single_draw=single_draw)
        try:
            assert len(chain.apply(one)[0]) == 1
            sizes.append(len(chain.apply(two)[0]))
        finally:
            chain.close()
    assert sizes == [2, 2]
