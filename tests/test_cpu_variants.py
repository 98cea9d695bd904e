"""Transcripts recorded on another machine: servers running named CPU variants of a release-style
b11434 (one variant per directory, as a release binary on a host whose best variant that is), their
transcripts recovered and traced here by the CLI in a fresh process (a process holds one ggml), on the
kernels found from each transcript's first real entry.

Specification:
- recover finds the server's variant (or one exactly equal to it) from the first entry, says so, and
  fills values within 5e-4 of that variant's unspeculated server;
- trace reproduces the server's tokens and draft totals on it;
- a transcript whose kernels this host lacks (withheld from the library) is refused in one line that
  names the nearest; with --server-backend it is recovered at stated precision on the nearest;
- the wrong variant given by hand (--server-cpu) is refused by the first entry, not approximated;
- `check -m` names the kernels of a live server.
Real weights only: f32 fixtures do not tell kernels apart.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import WIDE, default_and_wide

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.kernels import variants_that_run
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.proof.matrix import max_value_diff
from replay.runtime.variants import PREFIX, VARIANTS, vectorised
from replay.transcripts.format import dumps

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
TOL = 5e-4
_RUNS = itertools.count()


def cli(*args, timeout: float = 900) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "replay.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p


def _bodies() -> list[tuple[str, dict]]:
    story = [("/completion", {"prompt": STORY, "n_predict": 32, "n_probs": 3, "temperature": 1.0, "seed": s})
             for s in (1, 2)]
    chat = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours of the sea."}],
                                     "max_tokens": 24, "logprobs": True, "top_logprobs": 3, "temperature": 0.8,
                                     "seed": 5})
    return story + [chat]


def _record_all(binary: Path, cfg: ServerConfig) -> list[dict]:
    with LlamaServer(cfg, binary=binary) as srv:
        return [record_one(srv.url, RequestItem(ep, dict(b)), srv.config.flags_block()) for ep, b in _bodies()]


@pytest.fixture(scope="module")
def host_variants(b11434) -> list[str]:
    """The variants of the build that run on this host, best first (a variant whose kernels crash here,
    sapphirerapids on a host whose AMX kernels die, is not one: runtime/health.py)."""
    return variants_that_run(b11434.bin_dir)


@pytest.fixture(scope="module")
def recorded(b11434, smollm2, smollm2_draft, host_variants, tmp_path_factory):
    """{variant: (speculative JSONL, unspeculated transcripts)} for the host's best variant and x64."""
    out = {}
    for v in dict.fromkeys([host_variants[0], "x64"]):
        bins = b11434.with_cpu(v)
        spec = _record_all(bins.server, ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",)))
        plain = _record_all(bins.server, ServerConfig(smollm2))
        path = tmp_path_factory.mktemp(f"cpu-{v}") / "spec.jsonl"
        path.write_text("".join(dumps(t, indent=None) + "\n" for t in spec))
        out[v] = (path, plain)
    return out


def _recover(src: Path, model: Path, lib: Path, *extra) -> tuple[subprocess.CompletedProcess, Path]:
    out = src.with_name(f"{src.stem}.fixed{next(_RUNS)}{src.suffix}")
    return cli("recover", src, "-m", model, "-o", out, "--json", "--force", "--libllama", lib, *extra), out


def test_a_release_build_has_every_variant_and_each_server_directory_one(b11434):
    assert b11434.cpu_variants == list(VARIANTS)
    for v in ("x64", "haswell"):
        d = b11434.with_cpu(v).bin_dir
        assert sorted(p.name for p in d.glob(f"{PREFIX}*")) == [f"{PREFIX}{v}.so"]


@pytest.mark.parametrize("which", ["best", "x64"])
def test_recover_finds_the_servers_kernels_and_fills_its_unspeculated_values(which, recorded, host_variants, smollm2,
                                                                            b11434):
    v = host_variants[0] if which == "best" else "x64"
    src, plain = recorded[v]
    p, out = _recover(src, smollm2, b11434.bin_dir)
    assert p.returncode == 0, p.stderr[-2000:]
    reps = json.loads(p.stdout)["records"]
    cpu = reps[0]["numerics"]["cpu"]
    assert cpu["how"] == "matched" and v in [cpu["variant"], *cpu["equal"]], cpu
    assert cpu["description"].startswith(f"{VARIANTS[cpu['variant']].label}, matched on the first entry of record 1")
    # the best class is probed first, alone: where it reproduces the entry and no other class computes
    # batches as it does (kernel signatures), nothing else is probed (choice.py batch_alone); else the
    # classes without vector kernels (x64, sse42: a tenth of the speed) are probed only where the others
    # leave the entry open: one exact class, every other probed 1e-3 nats or more off (needless_slow)
    fast = [d for label, d in cpu["probes"].items() if vectorised(label.split()[0])]
    separated = sum(d is not None and d <= 1e-6 for d in fast) == 1 and all(
        d is not None and (d <= 1e-6 or d >= 1e-3) for d in fast) and len(fast) > 1
    slow = [x for x in host_variants if not vectorised(x)]
    if "computes batches as it does" in (cpu["why_unprobed"] or ""):
        assert list(cpu["probes"]) == [cpu["variant"]] and cpu["variant"] == host_variants[0], cpu
        assert set(host_variants) <= {cpu["variant"], *cpu["equal"], *cpu["unprobed"]}, cpu
    else:
        assert (set(slow) <= set(cpu["unprobed"]) if separated else cpu["unprobed"] == []), cpu
    assert which == "best" or not cpu["unprobed"], cpu  # an x64 server: no faster class matched, so x64 was probed
    assert sum(r["summary"]["counts"]["placeholder"] for r in reps) > 0, "nothing was speculated"
    assert all(r["summary"]["counts"]["mismatch"] == 0 for r in reps)
    worst, n = 0.0, 0
    for line, truth in zip(out.read_text().splitlines(), plain):
        w, k = max_value_diff(json.loads(line), truth)
        worst, n = max(worst, w), n + k
    assert n >= 30 and worst <= TOL, (worst, n)
    print(f"\n{v} server, replayed on {cpu['variant']}: max |recovered - unspeculated| {worst:.2e} over {n} "
          f"tokens; first-entry distances {cpu['probes']}")


def test_one_record_tries_the_best_class_on_itself_and_probes_only_where_its_first_entry_disagrees(
        recorded, host_variants, smollm2, b11434, tmp_path):
    """A one-record file, the model's classes known (a first transcript learnt them): where the best
    class's batch signature is its own, recover computes on it without a probe, and the record's first
    entry, as it is recovered, decides; from another machine's kernels the run starts again with the
    others probed, and the answer is the probed one (run/kernels/policy.py, cli/recover.py)."""
    env = {"SPEC_REPLAY_PROBE_CACHE": str(tmp_path / "kernels")}
    best, x64 = ({"src": tmp_path / f"{v}-1.json", "plain": recorded[v][1][0]} for v in (host_variants[0], "x64"))
    for one, v in ((best, host_variants[0]), (x64, "x64")):
        one["src"].write_text(recorded[v][0].read_text().splitlines()[0])
    learn = tmp_path / "learn.json"
    learn.write_text(recorded[host_variants[0]][0].read_text().splitlines()[1])

    def run(src: Path) -> tuple[subprocess.CompletedProcess, Path]:
        out = tmp_path / f"{src.stem}.fixed.json"
        p = subprocess.run([sys.executable, "-m", "replay.cli", "recover", src, "-m", smollm2, "-o", out, "--force",
                            "--libllama", b11434.bin_dir, "-v"], capture_output=True, text=True, timeout=900,
                           env={**__import__("os").environ, **env})
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
        return p, out
    first, _ = run(learn)
    assert "tried first" not in first.stderr  # nothing known yet: the classes are learnt, the best probed
    assert "first learning which candidates compute alike on this model" in first.stderr, first.stderr  # said once
    p, out = run(best["src"])
    tried = [line for line in p.stderr.splitlines() if "tried first" in line]
    if not tried:
        pytest.skip("another class computes batches as the best does on this host: the probe runs (tested above)")
    assert "evaluating the first entry" not in p.stderr, p.stderr  # no probe
    worst, n = max_value_diff(json.loads(out.read_text()), best["plain"])
    assert n >= 10 and worst <= TOL, (worst, n)
    p, out = run(x64["src"])
    assert f"the {host_variants[0]} kernels tried first do not reproduce record 1's first entry" in p.stderr, p.stderr
    assert "evaluating the first entry" in p.stderr  # then probed, in a fresh process
    assert "first learning" not in p.stderr  # on the classes learnt before
    worst, n = max_value_diff(json.loads(out.read_text()), x64["plain"])
    assert n >= 10 and worst <= TOL, (worst, n)
    print(f"\n{tried[0]}; an x64 record started again: {[x for x in p.stderr.splitlines() if 'kernels:' in x][-1]}")


@pytest.mark.parametrize("which", default_and_wide(["best", "x64"], {"x64"}))
def test_trace_reproduces_the_tokens_and_draft_totals_of_a_variant_server(which, recorded, host_variants, smollm2,
                                                                         smollm2_draft, b11434):
    v = host_variants[0] if which == "best" else "x64"
    src, _ = recorded[v]
    p = cli("trace", src, "-m", smollm2, "-md", smollm2_draft, "--json", "--libllama", b11434.bin_dir)
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    res = json.loads(p.stdout)
    assert res["kernels"]["how"] == "matched"
    assert all(r["reproduced"] for r in res["records"]), [r.get("first_divergence") for r in res["records"]]


@pytest.fixture(scope="module")
def x64_class(recorded, smollm2, b11434) -> list[str]:
    """The variants whose kernels equal x64's on its transcript's first entry."""
    p, _ = _recover(recorded["x64"][0], smollm2, b11434.bin_dir)
    cpu = json.loads(p.stdout)["records"][0]["numerics"]["cpu"]
    return [cpu["variant"], *cpu["equal"]]


def test_a_transcript_whose_kernels_this_host_lacks_is_refused_in_one_line(recorded, x64_class, smollm2, b11434,
                                                                           tmp_path):
    """Withholding x64's class from the library stands for a host that cannot run the server's variant."""
    lib = tmp_path / "withheld"
    lib.mkdir()
    for f in b11434.bin_dir.iterdir():
        if f.is_file() and not any(f.name == f"{PREFIX}{v}.so" for v in x64_class):
            (lib / f.name).symlink_to(f)
    src, plain = recorded["x64"]
    p, out = _recover(src, smollm2, lib)
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert p.returncode != 0 and len(errors) == 1 and not out.exists(), p.stderr[-2000:]
    assert "matches none of this host's CPU kernels" in errors[0] and "--server-backend" in errors[0]
    # told so, it recovers at stated precision on the nearest, and says which and how far
    p, out = _recover(src, smollm2, lib, "--server-backend", "an x64 release binary")
    assert p.returncode == 0, p.stderr[-2000:]
    cpu = json.loads(p.stdout)["records"][0]["numerics"]["cpu"]
    assert cpu["how"] == "nearest" and cpu["variant"] not in x64_class and cpu["diff"] > 1e-6
    print(f"\nx64 class {x64_class} withheld: nearest {cpu['variant']}, {cpu['diff']:.3g} nats off the first entry")


def test_the_wrong_variant_given_by_hand_is_refused_by_the_first_entry(recorded, x64_class, host_variants, smollm2,
                                                                       b11434):
    other = next((v for v in host_variants if v not in x64_class), None)
    if other is None:
        pytest.skip("every variant this host runs computes as x64 does")
    src, _ = recorded["x64"]
    p, out = _recover(src, smollm2, b11434.bin_dir, "--server-cpu", other)
    assert p.returncode != 0 and not out.exists(), p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"--server-cpu {other} is not the server's kernels" in errors[0]
    report = json.loads(p.stdout)
    assert f"the {other} CPU kernels given with --server-cpu are not the server's" in report["failure"]["detail"]
    cpu = report["records"][0]["numerics"]["cpu"]
    assert (cpu["variant"], cpu["how"]) == (other, "given")


def test_check_names_the_kernels_a_live_server_computes_with(b11434, smollm2, host_variants):
    v = "x64" if "x64" in host_variants else host_variants[-1]
    with LlamaServer(ServerConfig(smollm2), binary=b11434.with_cpu(v).server) as srv:
        p = cli("check", srv.url, "-m", smollm2, "--json", "--libllama", b11434.bin_dir)
    k = json.loads(p.stdout)["kernels"]
    assert k["how"] == "matched" and v in [k["variant"], *k["equal"]], k


@WIDE
def test_a_gemma_transcript_from_the_x64_kernels_is_recovered_exactly(b11434, gemma3, gemma3_draft, tmp_path):
    """Gemma 3 (sliding-window attention, the server's checkpoint schedule) on kernels that are not
    this host's best."""
    bins = b11434.with_cpu("x64")
    prompt = ("The lighthouse keeper counted the ships that passed each night. " * 12).strip()
    body = {"prompt": prompt, "n_predict": 24, "n_probs": 2, "temperature": 1.0, "seed": 3}
    with LlamaServer(ServerConfig(gemma3, draft_model=gemma3_draft, spec_types=("draft-simple",)),
                     binary=bins.server) as srv:
        spec = record_one(srv.url, RequestItem("/completion", dict(body)), srv.config.flags_block())
    with LlamaServer(ServerConfig(gemma3), binary=bins.server) as srv:
        plain = record_one(srv.url, RequestItem("/completion", dict(body)), srv.config.flags_block())
    src = tmp_path / "gemma.json"
    src.write_text(dumps(spec))
    p, out = _recover(src, gemma3, b11434.bin_dir)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)["records"][0]
    assert rep["numerics"]["cpu"]["how"] == "matched" and rep["summary"]["counts"]["placeholder"] > 0
    worst, n = max_value_diff(json.loads(out.read_text()), plain)
    assert n >= 12 and worst <= TOL, (worst, n)
    print(f"\nGemma 3 on x64: matched {rep['numerics']['cpu']['variant']}, max |diff| {worst:.2e} over {n} tokens")


LIGHTHOUSE = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
              "in his book. ")


@pytest.fixture(scope="module")
def concurrent_x64(b11434, smollm2_draft, tmp_path_factory):
    """An x64 server started as users start it (default -np: 4 slots, unified KV; sampling defaults
    from the model file, the requests setting only the temperature), sent 5 requests at once (an
    eval harness) and then one alone; and the unspeculated x64 server's answers, one at a time."""
    import threading
    import time

    from replay.llamacpp.models import smollm2_with_defaults
    model = smollm2_with_defaults()
    bins = b11434.with_cpu("x64")
    bodies = [{"prompt": LIGHTHOUSE * (3 + k) + f"Question {k}: what happened next?", "n_predict": 32,
               "n_probs": 3, "temperature": 1.0, "seed": 40 + k} for k in range(6)]
    spec: list[dict | None] = [None] * len(bodies)
    cfg = ServerConfig(model, n_parallel=-1, draft_model=smollm2_draft, spec_types=("draft-simple",))
    with LlamaServer(cfg, binary=bins.server) as srv:
        def send(i: int) -> None:
            spec[i] = record_one(srv.url, RequestItem("/completion", dict(bodies[i])), srv.config.flags_block())
        threads = [threading.Thread(target=send, args=(i,)) for i in range(5)]
        for i, t in enumerate(threads):
            t.start()
            time.sleep(0.05 * (i % 3))
        for t in threads:
            t.join()
        send(5)
    with LlamaServer(ServerConfig(model), binary=bins.server) as srv:
        plain = [record_one(srv.url, RequestItem("/completion", dict(b)), srv.config.flags_block()) for b in bodies]
    assert all(spec) and spec[0]["server"]["props"]["total_slots"] == 4
    path = tmp_path_factory.mktemp("concurrent-x64") / "spec.jsonl"
    path.write_text("".join(dumps(t, indent=None) + "\n" for t in spec))
    return model, path, plain


def _filled_diff(spec: Path, fixed: Path, plain: list[dict]) -> tuple[float, int]:
    """(max |recovered - unspeculated|, values compared) over the placeholders recover filled, up to
    where each record's tokens part from the unspeculated run's: the real values a multi-slot server
    sent were computed in batches shared with other requests, and are kept as sent."""
    from replay.transcripts.entries import record_entries
    from replay.transcripts.readers import read_text
    worst, n = 0.0, 0
    for s, f, p in zip(read_text(spec.read_text(), "spec"), read_text(fixed.read_text(), "fixed"), plain):
        for a, x, y in zip(record_entries(s), record_entries(f), record_entries(read_text(json.dumps(p), "p")[0])):
            if x.id != y.id:
                break
            if a.is_placeholder:
                n += 1
                worst = max([worst, abs(x.logprob - y.logprob)] + [abs(u[2] - v[2]) for u, v in zip(x.top, y.top)])
    return worst, n


@WIDE
def test_a_default_flag_server_under_concurrent_requests(concurrent_x64, host_variants, b11434, tmp_path):
    """Batches shared with other requests move a first entry as far as other kernels do (0.03 to 0.24
    nats measured here), so the probe tries several records' first entries: one computed alone (here at
    least the last) is reproduced exactly by the server's kernels. On these long prompts sse42 does so
    as exactly as x64, and the two decode later tokens 0.1 to 0.6 nats apart: that is refused in one
    line, not guessed; given the variant (--server-cpu x64) and --shared-batches (a /completion response
    carries no `created` to show which records ran together) the filled values are the x64 server's. A
    file of only the shared records leaves the kernels unknown, and says so, rather than taking the
    nearest."""
    model, src, plain = concurrent_x64
    p, out = _recover(src, model, b11434.bin_dir)
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert p.returncode != 0 and len(errors) == 1 and not out.exists(), p.stderr[-2000:]
    assert "is reproduced exactly by sse42, x64, whose one-token decodes of the tokens after it differ" in errors[0], errors[0]
    assert "--server-cpu" in errors[0]
    # /completion responses carry no `created`, so nothing in the file shows which records ran together:
    # the user who sent them at once says so (--shared-batches), and the report says the option judged
    p, out = _recover(src, model, b11434.bin_dir, "--server-cpu", "x64", "--shared-batches")
    assert p.returncode == 0, p.stderr[-2000:]
    reps = json.loads(p.stdout)["records"]
    assert reps[0]["numerics"]["cpu"]["how"] == "given"
    # records seen to overlap in time are judged by that evidence, the rest by the option; each says which
    assert all((r["numerics"]["cause"] is None) == (r["numerics"]["judged_by"] is None) for r in reps), \
        [r["numerics"] for r in reps]
    assert "option" in {r["numerics"]["judged_by"] for r in reps}, [r["numerics"] for r in reps]
    assert {s["setting"]: s["source"] for s in reps[0]["settings"]}["--top-k"] == "model file"
    assert all(r["summary"]["counts"]["mismatch"] == 0 for r in reps)
    first = [abs(r["tokens"][0]["server_logprob"] - r["tokens"][0]["true_logprob"]) for r in reps]
    alone = [k for k, d in enumerate(first) if d <= 1e-6]
    shared = [k for k, d in enumerate(first) if d > 1e-6]
    assert 5 in alone, first
    worst, n = _filled_diff(src, out, plain)
    assert n >= 20 and worst <= TOL, (worst, n)  # the runs part early: shared batches move the draws
    print(f"\nconcurrent x64: first entries alone {[k + 1 for k in alone]}, shared {[k + 1 for k in shared]} "
          f"(up to {max(first):.3g} off); filled values on x64 max |diff| {worst:.2e} over {n} tokens")
    if not shared:
        pytest.skip("no request's prompt shared a batch this time: the unknown-kernels half proves nothing")
    only = tmp_path / "shared-only.jsonl"  # two of them: each is probed under every variant, on long prompts
    only.write_text("".join(line + "\n" for k, line in enumerate(src.read_text().splitlines()) if k in shared[:2]))
    p, _ = _recover(only, model, b11434.bin_dir, "--shared-batches")
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)["records"][0]
    assert rep["numerics"]["cpu"]["how"] == "unknown", rep["numerics"]["cpu"]
    assert rep["numerics"]["cpu"]["variant"] == host_variants[0]
    assert "kernels are unknown" in rep["numerics"]["kernels"] and rep["numerics"]["cause"] is not None
    print(f"shared only: {rep['numerics']['cpu']['description']}")
