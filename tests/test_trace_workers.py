"""`trace --workers N`: a JSONL's records traced on N processes, what one process prints.

* records that share no server state go to any worker; the JSON (and the verdicts) of 2 workers
  are those of 1, byte for byte, and the exit status too;
* records that do share state across requests stay together, in order (commands/trace_state.py): every
  record of a server running ngram-mod (its table is the server's); a slot's records with its own
  n-gram map; a temperature-0 draft-simple record once an earlier one on its slot may have retuned
  the slot's draft sampler, and a temperature > 0 one that drafted nothing.
"""
from __future__ import annotations

import copy
import json
import subprocess

import pytest
from cli_helpers import cli_command

from replay.commands.trace_state import ServerState, trace_units
from replay.errors import Exit
from replay.llamacpp.models import tiny_target
from replay.paths import FIXTURES
from replay.runtime.llama import Model
from replay.transcripts.readers import read_text

pytestmark = pytest.mark.processes

N_RECORDS = 24


def trace(src, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command("trace", src, "-m", tiny_target(), "--json", *extra),
                          capture_output=True, text=True, timeout=600)


def test_two_workers_print_what_one_prints(tiny_evals, tmp_path):
    one, two = trace(tiny_evals), trace(tiny_evals, "--workers", "2")
    assert one.returncode == two.returncode == 0, (one.stderr, two.stderr)
    assert two.stdout == one.stdout
    got = json.loads(two.stdout)["records"]
    assert [r["record"] for r in got] == list(range(1, N_RECORDS + 1))
    assert all(r["reproduced"] for r in got)


def test_a_divergence_still_fails_the_run_on_workers(tiny_evals, tmp_path):
    lines = tiny_evals.read_text().splitlines()
    bad = json.loads(lines[5])
    bad["request"]["seed"] += 1  # the loop samples other tokens than the server did
    lines[5] = json.dumps(bad)
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    one, two = trace(src), trace(src, "--workers", "2")
    assert one.returncode == two.returncode == Exit.FAILED
    assert two.stdout == one.stdout
    assert [r["reproduced"] for r in json.loads(two.stdout)["records"]].count(False) == 1


def _records(specs: list[tuple], draft_sampling: str = "probabilistic"):
    """Tiny-fixture records with these (spec types, temperature, recorded draft_n[, id_slot]), as
    from a 4-slot server."""
    base = json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text())
    out = []
    for types, temp, draft_n, *slot in specs:
        d = copy.deepcopy(base)
        d["server"]["flags"].update({"--spec-type": types, "--spec-draft-sampling": draft_sampling, "--parallel": 4})
        d["server"]["props"]["total_slots"] = 4
        d["request"]["temperature"] = d["response"]["generation_settings"]["temperature"] = temp
        d["response"]["timings"]["draft_n"] = draft_n
        d["response"]["id_slot"] = slot[0] if slot else 0
        out.append(json.dumps(d))
    return read_text("\n".join(out) + "\n", "spec.jsonl")


@pytest.fixture(scope="module")
def meta():
    m = Model(tiny_target())
    yield m.meta
    m.close()


def units(recs, meta) -> list[tuple[int, ...]]:
    return sorted(u.records for u in trace_units(recs, {}, meta))


def test_independent_requests_share_nothing(meta):
    recs = _records([(["draft-simple"], 1.0, 9)] * 3 + [(["ngram-simple"], 0.0, 0)] * 3)
    assert units(recs, meta) == [(k,) for k in range(6)]


def test_ngram_mods_table_is_the_servers_so_the_file_is_one_chain(meta):
    recs = _records([(["draft-simple"], 1.0, 9, 1), (["ngram-mod"], 0.0, 0, 2), (["draft-simple"], 0.0, 4, 3)])
    assert units(recs, meta) == [(0, 1, 2)]


def test_a_slots_ngram_map_continues_on_that_slot_only(meta):
    recs = _records([(["ngram-map-k"], 0.0, 3, 0), (["ngram-map-k"], 0.0, 3, 1), (["ngram-map-k"], 0.0, 3, 0),
                     (["ngram-map-k"], 0.0, 3, 1), (["ngram-cache"], 0.0, 3, 2)])
    assert units(recs, meta) == [(0, 2), (1, 3), (4,)]


def test_greedy_draft_simple_follows_its_slots_last_retune(meta):
    recs = _records([(["draft-simple"], 0.0, 5),   # nothing retuned yet: independent
                     (["draft-simple"], 0.0, 5),
                     (["draft-simple"], 0.7, 5),   # retunes at its first draft
                     (["draft-simple"], 0.0, 5),   # drafts with 0.7's retune
                     (["draft-simple"], 0.9, 5),
                     (["draft-simple"], 0.9, 0),   # drafted nothing: the retune may be the one before
                     (["draft-simple"], 0.0, 5),
                     (["draft-simple"], 0.0, 5, 1)])  # another slot, never retuned
    assert units(recs, meta) == [(0,), (1,), (2, 3), (4, 5, 6), (7,)]
    # greedy draft sampling never retunes: nothing carries over
    assert units(_records([(["draft-simple"], t, 5) for t in (0.7, 0.0, 0.0)], "greedy"), meta) == [(0,), (1,), (2,)]


def test_each_slot_keeps_its_own_state_and_ngram_mod_is_shared():
    recs = _records([(["draft-simple"], 0.0, 5, 0), (["draft-simple"], 0.0, 5, 1), (["draft-simple"], 0.0, 5, 0)])
    state = ServerState()
    a, b, a2 = (state.slot(r) for r in recs)
    assert a is a2 and a is not b
    table = a.drafter("ngram-mod", "server", lambda: "table")
    a.retune = (0.7, 1)
    assert b.drafter("ngram-mod", "server", lambda: "another") is table  # one table for the server
    assert b.drafter("ngram-map-k", "slot", lambda: "b's map") == "b's map"
    assert a.drafter("ngram-map-k", "slot", lambda: "a's map") == "a's map"  # each slot its own map
    assert b.retune is None
