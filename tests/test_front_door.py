"""Every run starts at one front door (replay/run/): the Python API gives the report the command line
gives, kernels and all.

Before it, `replay.recover()` never chose the libllama or probed the kernels the CLI chose: on a
transcript computed with other kernels than this host's best, an API user got other values than the
CLI printed. Here the API and the CLI each run in a fresh process (a process holds one libllama), and
their reports are compared byte for byte:

* the committed transcripts, recover, diff and trace (with b11434 built: its kernels are probed);
* a real SmolLM2 transcript from a b11434 server computing with the x64 kernels, which are not this
  host's best (a server on a variant of our choosing stands in for another host's), where the host's
  best kernels are shown to give other values.

The quick tier holds the same for the committed transcripts in-process (one libllama loaded).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli_command, run
from tiers import default_and_wide

from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES
from replay.report import schema as report_json

TRANSCRIPTS = sorted((FIXTURES / "transcripts").glob("*.json"))

API = """
import json, sys
import replay
from replay.report import schema as report_json
what, src, model, out = sys.argv[1:5]
flags = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
if what == "recover":
    text = report_json.dumps(replay.recover(src, model, flags=flags).to_json(), indent=2) + "\\n"
else:
    text = report_json.dumps(replay.trace(src, model, flags=flags).report, indent=2) + "\\n"
open(out, "w").write(text)
"""


def _api(what: str, src: Path, model: Path, out: Path, flags: dict | None = None) -> str:
    p = subprocess.run([sys.executable, "-c", API, what, str(src), str(model), str(out), json.dumps(flags or {})],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return out.read_text()


def _cli(*args) -> subprocess.CompletedProcess:
    p = subprocess.run(cli_command(*args), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _same_reports(src: Path, model: Path, draft: Path, tmp: Path) -> dict:
    """The API's recover and trace reports against the CLI's recover --report, diff --report and trace
    --json, each in a fresh process, once a first run has probed the kernels (what later runs of this
    model probe, and so report, depends on the classes the first learnt: run/kernels/classes.py);
    returns the recover report."""
    _cli("diff", src, "-m", model)
    api = _api("recover", src, model, tmp / "api.json")
    _cli("recover", src, "-m", model, "-o", tmp / "out.json", "--report", tmp / "recover.json")
    _cli("diff", src, "-m", model, "--report", tmp / "diff.json")
    assert (tmp / "recover.json").read_text() == api
    assert (tmp / "diff.json").read_text() == api
    traced = _api("trace", src, model, tmp / "api-trace.json", {"-md": str(draft)})
    assert _cli("trace", src, "-m", model, "-md", draft, "--json").stdout == traced
    return json.loads(api)


@pytest.mark.parametrize("src", TRANSCRIPTS, ids=lambda p: p.name)
def test_the_api_gives_the_clis_reports_in_one_process(src, tmp_path):
    """In-process (the quick tier's one libllama, kept by both): the same report, recover and trace."""
    import replay
    got = report_json.dumps(replay.recover(src, tiny_target()).to_json(), indent=2) + "\n"
    r = run("recover", src, "-m", tiny_target(), "-o", tmp_path / "out.json", "--report", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r.json").read_text() == got
    traced = replay.trace(src, tiny_target(), flags={"-md": tiny_draft()})
    r = run("trace", src, "-m", tiny_target(), "-md", tiny_draft(), "--json")
    assert r.exit_code == 0, r.output
    assert r.stdout == report_json.dumps(traced.report, indent=2) + "\n"


@pytest.mark.build
@pytest.mark.parametrize("src", default_and_wide(
    TRANSCRIPTS, {"tiny-draft-simple.json", "tiny-v1-chat-stream-post.json", "tiny-completion-grammar-probabilistic.json",
                  "tiny-v1-completions.json"}, ids=[p.name for p in TRANSCRIPTS]))
def test_the_api_gives_the_clis_reports_on_the_kernels_it_probes(src, tmp_path, b11434):
    """Fresh processes, b11434 built: both choose its libllama and probe its CPU variants."""
    rep = _same_reports(src, tiny_target(), tiny_draft(), tmp_path)
    num = rep["records"][0]["numerics"]
    assert "b11434" in num["libllama"] and num["cpu"]["how"] == "matched", num


@pytest.mark.build
@pytest.mark.live_server
@pytest.mark.model
def test_the_api_replays_a_transcript_on_its_servers_kernels_not_this_hosts_best(b11434, smollm2, tmp_path):
    from replay.commands.record import RequestItem, record_one
    from replay.llamacpp.kernels import variants_that_run
    from replay.llamacpp.process import LlamaServer, ServerConfig
    from replay.transcripts.format import dumps
    best = variants_that_run(b11434.bin_dir)[0]
    assert best != "x64", "this host runs nothing above x64: nothing to tell apart"
    body = {"messages": [{"role": "user", "content": "Write two sentences about a lighthouse."}], "max_tokens": 24,
            "temperature": 0, "seed": 3, "logprobs": True, "top_logprobs": 3}
    with LlamaServer(ServerConfig(smollm2, draft_model=smollm2, spec_types=("draft-simple",), n_ctx=1024),
                     binary=b11434.with_cpu("x64").server) as srv:
        assert srv.kernels.variant == "x64"
        src = tmp_path / "t.json"
        src.write_text(dumps(record_one(srv.url, RequestItem("/v1/chat/completions", body), srv.config.flags_block())))
    rep = _same_reports(src, smollm2, smollm2, tmp_path)
    cpu = rep["records"][0]["numerics"]["cpu"]
    assert cpu["variant"] == "x64" and cpu["how"] == "matched", cpu
    # this host's best kernels compute the transcript otherwise: what the API gave before it chose them
    p = subprocess.run(cli_command("diff", src, "-m", smollm2, "--server-cpu", best), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 1 and "token 0" in p.stderr, p.stderr[-2000:]
