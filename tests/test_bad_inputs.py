"""Every bad input ends in one clear line with the documented exit code (docs/cli.md: 2 a bad option or
argument, 3 a file or server that cannot be used, 1 a check that failed), and nothing is lost: the output
is never an input (`--in-place` says that on purpose). Each case is one a new user met (issue 33)."""
from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import one_error, run

from replay.llamacpp.models import tiny_draft, tiny_target
from replay.llamacpp.process import free_port
from replay.paths import FIXTURES

T = FIXTURES / "transcripts" / "tiny-draft-simple.json"


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf", "0.1x"])
@pytest.mark.parametrize("command", ["recover", "diff"])
def test_a_tolerance_that_is_not_a_finite_number_of_nats_is_refused(command, value, tmp_path):
    """--tolerance -1 called every value wrong ("0.000 nats disagree"), nan and inf every value right."""
    extra = ("-o", tmp_path / "o.json") if command == "recover" else ()
    r = run(command, T, "-m", tiny_target(), "--tolerance", value, *extra)
    assert r.exit_code == 2
    why = f"{value!r} is not a number of nats" if value == "0.1x" else f"{value!r}: give a finite number of nats, 0 or more"
    assert one_error(r) == f"Error: Invalid value for '--tolerance': {why} (see 'main {command} --help')"
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.json").exists()


def test_the_output_is_never_the_input_even_with_force(tmp_path):
    src = tmp_path / "t.json"
    shutil.copy(T, src)
    before = src.read_bytes()
    for args in (("-o", src, "--force"), ("-o", tmp_path / "." / "t.json", "--force")):
        r = run("recover", src, "-m", tiny_target(), *args)
        assert r.exit_code == 2 and one_error(r) == (f"Error: -o {args[1]} is the input {src}: write elsewhere, or give "
                                                     "--in-place to replace the transcript on purpose (see 'main "
                                                     "recover --help')")
    for flag in ("--report", "--html"):
        r = run("diff", src, "-m", tiny_target(), flag, src, "--force")
        assert r.exit_code == 2 and one_error(r) == f"Error: {flag} {src} is the input {src}: write elsewhere (see 'main diff --help')"
    assert src.read_bytes() == before
    r = run("recover", src, "-m", tiny_target(), "--in-place")  # on purpose
    assert r.exit_code == 0 and src.read_bytes() != before


@pytest.mark.parametrize("command", ["recover", "diff", "trace"])
def test_a_directory_is_one_line_with_exit_3_as_a_missing_file_is(command, tmp_path):
    extra = ("-o", tmp_path / "o.json") if command == "recover" else ()
    for args, line in (((tmp_path, "-m", tiny_target()), f"Error: {tmp_path} is a directory, not a transcript file"),
                       ((T, "-m", tmp_path), f"Error: {tmp_path} is a directory, not a model file"),
                       ((tmp_path / "missing.json", "-m", tiny_target()),
                        f"Error: a transcript file not found: {tmp_path / 'missing.json'}")):
        r = run(command, *args, *extra)
        assert r.exit_code == 3, (args, r.output)
        assert one_error(r) == line and len(r.output.strip().splitlines()) == 1


def test_a_context_too_small_says_once_what_the_whole_record_needs():
    """-c 8 said "need 9 positions", -c 20 "need 21"; only -c 24 worked (5 prompt tokens, 20 generated,
    the last never decoded)."""
    for c in ("8", "20", "23"):
        r = run("diff", T, "-m", tiny_target(), "-c", c)
        assert r.exit_code == 3
        assert one_error(r) == (f"Error: {T}, record 1: prompt + completion need 24 positions but the context holds {c}: "
                                "pass --ctx-size 24 or more")
    assert run("diff", T, "-m", tiny_target(), "-c", "24").exit_code == 0


def test_check_takes_the_draft_as_the_server_spells_it():
    """`check URL -md draft.gguf` was parsed as `-m d`."""
    url = f"http://127.0.0.1:{free_port()}"
    r = run("check", url, "-md", tiny_draft())
    assert r.exit_code == 3 and one_error(r).startswith(f"Error: cannot tell: cannot reach {url}/props")


def test_check_json_on_an_unreachable_server_is_the_promised_error_object():
    r = run("check", f"http://127.0.0.1:{free_port()}", "--json")
    assert r.exit_code == 3
    err = json.loads(r.stdout)["error"]
    assert err["exit_code"] == 3 and err["message"].startswith("cannot tell: cannot reach")


def test_invalid_json_is_said_once(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"request": {"prompt": "unterminated')
    r = run("diff", bad, "-m", tiny_target())
    assert r.exit_code == 3
    assert "invalid JSON (Unterminated string starting at line 1 column 24)" in one_error(r)
    assert "at at" not in r.output


def test_a_draft_found_nowhere_here_asks_for_md(tmp_path, monkeypatch):
    """The README fixture records its draft as fixtures/tiny-draft.gguf, relative to where the server ran; with
    no file of that name from the transcript's folder, next to it or next to -m, one line asks for -md."""
    monkeypatch.chdir(tmp_path)
    lone = tmp_path / "target.gguf"
    lone.write_bytes(tiny_target().read_bytes())
    r = run("trace", T, "-m", lone, "--renamed-model")
    assert r.exit_code == 3
    assert one_error(r).endswith("model file not found: fixtures/tiny-draft.gguf (the transcript's "
                                 "--spec-draft-model, a path on the server's machine, is not next to the "
                                 "transcript or -m either): give the draft model file with -md PATH")


def test_trace_shows_list_settings_as_they_are_typed():
    r = run("trace", T, "-m", tiny_target(), "-md", tiny_draft())
    assert r.exit_code == 0
    line = next(x for x in r.stdout.splitlines() if x.startswith("settings: "))
    assert "--spec-type draft-simple (server.flags)" in line and "['draft-simple']" not in line


def test_an_unaligned_token_exits_1_as_documented(tmp_path):
    """Generated text this model's pieces do not spell is a disagreement between the transcript and the
    model (docs/recover.md: exit 1), not a replay that could not run."""
    t = json.loads(T.read_text())
    del t["response"]["tokens"]  # ids from token 3 on gone: the text is aligned with the model's pieces
    for e in t["response"]["completion_probabilities"][3:]:
        e.pop("id", None)
    t["response"]["completion_probabilities"][3]["token"] = "\u00e9"
    t["response"]["completion_probabilities"][3]["bytes"] = list("\u00e9".encode())
    t["response"]["content"] = "".join(e["token"] for e in t["response"]["completion_probabilities"])
    src = tmp_path / "t.json"
    src.write_text(json.dumps(t))
    r = run("diff", src, "-m", tiny_target(), "--json")
    rep = json.loads(r.stdout)
    assert any(tok["status"] == "unaligned" for rec in rep["records"] for tok in rec["tokens"]), rep
    assert r.exit_code == 1


@pytest.mark.parametrize("out, why", [
    ("/proc/x.json", "cannot write /proc/x.json: /proc takes no new file (No such file or directory)"),
    ("/sys/missing/x.json", "cannot write /sys/missing/x.json: the folder /sys/missing cannot be made ("),
    ("{file}/x.json", "cannot write {file}/x.json: {file} is a file, not a folder"),
], ids=["proc", "sys", "file-as-folder"])
@pytest.mark.parametrize("flag", ["-o", "--report", "--html"])
def test_an_output_that_cannot_be_written_is_said_before_any_model_loads_with_its_true_reason(flag, out, why, tmp_path):
    """Before, an unwritable -o was found after the whole replay, and two of these three named another reason
    ("No such file or directory" for /proc, "Operation not permitted" for /sys/missing, "File exists" for a
    file used as a folder)."""
    file = tmp_path / "a-file"
    file.write_text("")
    out, why = out.format(file=file), why.format(file=file)
    extra = () if flag == "-o" else ("-o", tmp_path / "fixed.json")
    r = run("recover", T, "-m", tiny_target(), flag, out, *extra)
    assert r.exit_code == 3 and one_error(r).startswith(f"Error: {why}"), r.output  # /sys: EPERM, or EROFS
    assert not any(line.startswith(("libllama:", "kernels:")) for line in r.output.splitlines())
    assert not (tmp_path / "fixed.json").exists()


@pytest.mark.parametrize("command", ["recover", "diff", "trace", "tune"])
def test_a_missing_draft_file_is_named_as_missing(command, tmp_path):
    extra = {"recover": ("-o", tmp_path / "o.json"), "tune": ("--vary", "--spec-draft-n-max=2,4")}.get(command, ())
    r = run(command, T, "-m", tiny_target(), "-md", tmp_path / "missing.gguf", *extra)
    assert r.exit_code == 3 and one_error(r) == f"Error: a draft model file not found: {tmp_path / 'missing.gguf'}"


def test_a_misspelled_command_is_one_line_naming_the_command_meant():
    r = run("recvoer", T)
    assert r.exit_code == 2 and r.output.strip() == (
        "Error: no such command 'recvoer': did you mean 'recover'? (see 'main --help')")


def test_a_misspelled_option_names_the_option_meant_among_those_help_shows():
    r = run("recover", T, "--tolerence", "1")
    assert r.exit_code == 2 and r.output.strip() == (
        "Error: no such option --tolerence: did you mean --tolerance? (see 'main recover --help')")


def test_a_build_older_than_any_known_loop_is_one_usage_line_and_no_hint():
    r = run("recover", T, "-m", tiny_target(), "-o", "o.json", "--build", "b99")
    assert r.exit_code == 2 and r.output.strip() == (
        "Error: Invalid value for '--build': b99 is older than b9093, the oldest build whose loop spec-replay "
        "knows (see 'main recover --help')")


def test_patch_given_both_a_source_and_a_build_says_not_both(tmp_path):
    r = run("patch", "--source", tmp_path, "--build", "b11434")
    assert r.exit_code == 2 and one_error(r) == (
        "Error: give --source DIR or --build bN|0c1e570, not both (see 'main patch --help')")


def test_record_with_a_missing_request_file_says_so_before_asking_the_server(tmp_path):
    r = run("record", f"http://127.0.0.1:{free_port()}", "--request", tmp_path / "req.json", "-o", tmp_path / "t.json")
    assert r.exit_code == 3 and one_error(r) == f"Error: {tmp_path / 'req.json'}: cannot read: No such file or directory"


def test_an_interrupted_run_is_named_by_the_files_that_are_there(tmp_path):
    """Before, with OUT.partial removed and OUT.partial.json left, the message named OUT.partial."""
    from replay.errors import OutputExistsError
    from replay.scale.journaled import Journal
    out = tmp_path / "fixed.jsonl"
    (tmp_path / "fixed.jsonl.partial.json").write_text("{}")
    with pytest.raises(OutputExistsError) as e:
        Journal(out, {}).open(resume=False, force=False)
    assert str(e.value) == (f"{tmp_path / 'fixed.jsonl.partial.json'} holds an interrupted run: pass --resume to "
                            "continue it, or --force to start over")
