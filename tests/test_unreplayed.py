"""Flags and request fields the replay does not reproduce (settings/table.py: UNREPLAYED_FLAGS and
UNREPLAYED_FIELDS): each is replayed where only the target's values matter (recover), or refused in
one line that names it, never quietly ignored. Quick tier: the committed tiny transcripts, their
recorded flags or request edited as a user's server would have written them."""
from __future__ import annotations

import json

import pytest
from cli_helpers import one_error, run, same_repair

from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES

NAME = "tiny-draft-simple.json"


def _edited(tmp_path, flags: dict | None = None, request: dict | None = None):
    t = json.loads((FIXTURES / "transcripts" / NAME).read_text())
    if flags is not None:
        t.setdefault("server", {})["flags"] = {"--spec-draft-model": "tiny-draft.gguf", **flags}
    t["request"].update(request or {})
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    return p


def _recover(tmp_path, src):
    out = tmp_path / "out.json"
    return run("recover", src, "-m", tiny_target(), "-o", out), out


@pytest.mark.parametrize("kind", ["draft-eagle3", "draft-dflash", "draft-dspark"])
def test_transcripts_of_drafters_that_need_hidden_states_are_recovered_and_not_traced(tmp_path, kind):
    """recover needs only the target: the repair is the same as the draft-simple twin's; trace refuses
    by name (the drafter reads the target's hidden states, which this replay feeds only MTP heads)."""
    src = _edited(tmp_path, {"--spec-type": [kind]})
    r, out = _recover(tmp_path, src)
    assert r.exit_code == 0, r.output
    twin = json.loads((FIXTURES / "transcripts" / "repaired" / NAME).read_text())
    fixed = json.loads(out.read_text())
    fixed["server"].pop("flags"), twin["server"].pop("flags")  # the edited server flags aside
    assert same_repair(json.dumps(fixed), json.dumps(twin)) is None
    err = one_error(run("trace", src, "-m", tiny_target(), "-md", tiny_draft()))
    assert f"--spec-type {kind} cannot be replayed" in err and "hidden states" in err


@pytest.mark.parametrize("flag, value", [("--lora", "adapter.gguf"), ("--lora-scaled", "adapter.gguf:0.5"),
                                         ("--override-kv", "llama.context_length=int:4096"),
                                         ("--cache-reuse", "256"), ("--reasoning-budget", "0"),
                                         ("-bs", True)])
def test_flags_that_change_the_targets_values_are_refused_by_name(tmp_path, flag, value):
    src = _edited(tmp_path, {flag: value})
    r, out = _recover(tmp_path, src)
    err = one_error(r)
    assert r.exit_code != 0 and not out.exists()
    assert flag.replace("-bs", "--backend-sampling") in err and "not replayed" in err, err


@pytest.mark.parametrize("flag, value", [("--cache-reuse", 0), ("--reasoning-budget", "-1"), ("-bs", False)])
def test_their_default_values_change_nothing_and_pass(tmp_path, flag, value):
    r, _ = _recover(tmp_path, _edited(tmp_path, {flag: value}))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("flags, request_", [({"--spec-synth-len": "3"}, None), ({"--spec-synth-rates": "0.5,0.2"}, None),
                                             ({"--no-spec-draft-backend-sampling": True}, None),
                                             ({}, {"n_indent": 4}), ({}, {"t_max_predict_ms": 800})])
def test_what_changes_only_the_loops_choices_is_recovered_and_refused_by_trace(tmp_path, flags, request_):
    src = _edited(tmp_path, flags, request_)
    r, out = _recover(tmp_path, src)
    assert r.exit_code == 0, r.output
    err = one_error(run("trace", src, "-m", tiny_target(), "-md", tiny_draft()))
    name = next(iter(flags or request_))
    assert name in err and "not replayed by trace (recover is unaffected)" in err, err


def test_backend_sampling_in_the_request_is_refused_by_both(tmp_path):
    src = _edited(tmp_path, None, {"backend_sampling": True})
    assert "\"backend_sampling\"" in one_error(_recover(tmp_path, src)[0])
    assert "\"backend_sampling\"" in one_error(run("trace", src, "-m", tiny_target(), "-md", tiny_draft()))


def test_a_recorded_spec_type_none_is_not_speculation():
    from replay.reading.record import speculating_types
    assert not speculating_types(["none"]) and speculating_types(["none", "ngram-mod"])


def test_in_era_c_the_draft_model_alone_enables_draft_simple_in_trace(tmp_path):
    """b9246..b9453 enable draft-simple for -md without --spec-type ("'draft' speculative type is not
    explicitly enabled - enabling it"); trace loaded the draft model only for a listed draft-simple, so
    it replayed such a server as not speculating at all."""
    src = _edited(tmp_path, {})
    t = json.loads(src.read_text())
    t["response"]["generation_settings"]["speculative.types"] = "none"  # started without --spec-type
    src.write_text(json.dumps(t))
    r = run("trace", src, "-m", tiny_target(), "-md", tiny_draft(), "--build", "9400", "--json")
    res = json.loads(r.stdout)
    assert any("enables draft-simple itself" in n for n in res["notes"]), res["notes"]
    assert res["draft_n"] > 0


def test_a_stateful_sampler_is_recovered_only_while_the_replays_chain_selects_the_servers_tokens(tmp_path):
    """mirostat's mu follows the token its chain selects: the speculative loop's draws are not the
    replay's, so where the replay's chain selects another token than the server emitted, recover says
    so by name instead of filling post-sampling values from a drifting mu."""
    t = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple-post.json").read_text())
    t["request"]["mirostat"] = t["response"]["generation_settings"]["mirostat"] = 2  # as a server echoes it
    src = tmp_path / "t.json"
    src.write_text(json.dumps(t))
    err = one_error(_recover(tmp_path, src)[0])
    assert "mirostat 2 needs the speculative loop's own draws" in err and "(-v: details)" in err, err


@pytest.mark.parametrize("edit, named", [
    ({"request": {"chat_template_kwargs": {"enable_thinking": False}}}, '"chat_template_kwargs"'),
    ({"request": {"reasoning_effort": "low"}}, '"reasoning_effort"'),
    ({"flags": {"--chat-template": "chatml"}}, "--chat-template"),
    ({"flags": {"--no-jinja": True}}, "--no-jinja"),
])
def test_a_chat_prompt_is_not_rebuilt_from_its_messages_where_the_server_rendered_it_otherwise(tmp_path, edit, named):
    """A chat transcript recorded without its prompt's ids (an eval harness's) is rebuilt from its
    messages; the rebuilt prompt was checked by its length only, so template kwargs, another template
    or another renderer passed with values for another prompt. Without the server's own request
    parsing at hand (nothing built: the quick tier) they are refused by name; with it they are
    rendered by the server's code (tests/test_server_request.py)."""
    t = json.loads((FIXTURES / "transcripts" / "tiny-v1-chat.json").read_text())
    del t["prompt_tokens"]
    t["request"].update(edit.get("request", {}))
    if "flags" in edit:
        t["server"]["flags"] = edit["flags"]
    src = tmp_path / "t.json"
    src.write_text(json.dumps(t))
    err = one_error(_recover(tmp_path, src)[0])
    assert "cannot be rebuilt from its messages" in err and named in err, err
    # with the ids recorded the prompt is the server's, whatever rendered it
    t["prompt_tokens"] = json.loads((FIXTURES / "transcripts" / "tiny-v1-chat.json").read_text())["prompt_tokens"]
    src.write_text(json.dumps(t))
    assert _recover(tmp_path, src)[0].exit_code == 0


def test_the_same_chat_rebuilt_without_those_is_recovered(tmp_path):
    t = json.loads((FIXTURES / "transcripts" / "tiny-v1-chat.json").read_text())
    del t["prompt_tokens"]
    src = tmp_path / "t.json"
    src.write_text(json.dumps(t))
    assert _recover(tmp_path, src)[0].exit_code == 0


def test_an_mtp_transcript_of_a_target_without_nextn_layers_is_refused_by_trace(tmp_path):
    """A server cannot draft with MTP heads its model does not have (llama_init_from_model refuses the MTP
    context): a transcript that says so on the tiny Llama is refused in one line, naming the model; with
    -md as well, the draft model's MTP heads are named as not replayed."""
    src = _edited(tmp_path, {"--spec-type": ["draft-mtp"]})
    err = one_error(run("trace", src, "-m", tiny_target(), "-md", tiny_draft()))
    assert "draft-mtp with a draft model" in err
    t = json.loads(src.read_text())
    del t["server"]["flags"]["--spec-draft-model"]
    src.write_text(json.dumps(t))
    err = one_error(run("trace", src, "-m", tiny_target()))
    assert "has no nextn (MTP) layers" in err and tiny_target().name in err
