"""`recover --workers N`: a JSONL's records on N processes, the same bytes as one.

* the output of 2 workers is byte for byte the output of 1, and so is a run interrupted with 2
  workers and resumed with 1 (or the other way round): the journal takes records in file order, and
  keeps the ones that finished early aside (OUT.partial.ahead);
* a worker that dies is reported with the record it was on, in one line; the run stops, keeps what
  finished, and --resume completes it to the same bytes;
* values do not depend on the thread count (-t 1 and -t 2 give the same bytes);
* records the server served from the previous record's cache stay with it (transcripts/chains.py), and a
  unit resumed in the middle is warmed up from its start; a server whose drafter keeps state across
  requests (ngram-mod) makes the file one unit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import cli_command, recover_in_subprocess, tiny_jsonl

from replay.commands.trace_state import keeps_state
from replay.errors import Exit
from replay.llamacpp.models import tiny_target
from replay.transcripts.chains import SHARED_CHARS, Unit, chains, plan_units
from replay.transcripts.readers import Record

pytestmark = pytest.mark.processes

N_RECORDS = 48


def recover(src: Path, out: Path, *extra) -> subprocess.CompletedProcess:
    return recover_in_subprocess(src, tiny_target(), out, *extra)


def test_two_workers_write_the_bytes_of_one(tiny_evals, tiny_evals_one_worker, tmp_path):
    r = recover(tiny_evals, tmp_path / "out.jsonl", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == tiny_evals_one_worker
    assert f"recovered in {N_RECORDS} record(s)" in r.stderr
    assert not list(tmp_path.glob("out.jsonl.partial*"))


def test_values_do_not_depend_on_the_thread_count_short_of_256_positions(tiny_evals, tmp_path):
    """The tiny eval records stay under 256 positions, where no decode splits the KV by thread; past them
    -t is the server's and changes values (tests/test_schedule_live.py)."""
    outs = []
    for t in ("1", "2"):
        r = recover(tiny_evals, tmp_path / f"t{t}.jsonl", "-t", t, "--workers", "2")
        assert r.returncode == 0, r.stderr
        outs.append((tmp_path / f"t{t}.jsonl").read_bytes())
    assert outs[0] == outs[1]


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _lines(p: Path) -> int:
    return p.read_bytes().count(b"\n") if p.exists() else 0


def _mapped(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` mapped (libllama mmaps a model's file as it loads it)."""
    try:
        return str(Path(path).resolve()) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _workers_of(driver: subprocess.Popen) -> list[int]:
    """The driver's worker processes (spawned python children, not multiprocessing's resource tracker)."""
    return [c for c in _children(driver.pid)
            if "spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")
            and "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]


@pytest.fixture(scope="module")
def long_evals(tiny_evals_one_worker, tmp_path_factory) -> tuple[Path, bytes]:
    """20 times the 48 records, and the bytes one worker writes for them (record k is record k mod 48:
    the same pattern), so that a run stopped after a few records still has work whatever the
    machine's speed (the 48 tiny records alone take about a second on 2 workers)."""
    src = tiny_jsonl(tmp_path_factory.mktemp("long") / "long.jsonl", 20 * N_RECORDS)
    return src, b"".join(tiny_evals_one_worker.splitlines(keepends=True) * 20)


@pytest.mark.parametrize("first,then", [("2", "1"), ("1", "2")])
def test_an_interrupted_run_resumes_with_another_worker_count(long_evals, tmp_path, first, then):
    src, want = long_evals
    out = tmp_path / "out.jsonl"
    # a background job (CI's shell) inherits SIGINT ignored: give the child the default, as a terminal would
    p = subprocess.Popen(cli_command("recover", src, "-m", tiny_target(), "-o", out, "--workers", first),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while _lines(tmp_path / "out.jsonl.partial") < 6 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    assert p.returncode != 0 and not out.exists()
    assert b"Traceback" not in p.stderr.read()
    time.sleep(0.5)
    assert not _workers_of(p)  # none left computing for nobody
    r = recover(src, out, "--resume", "--workers", then)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == want
    assert "finished earlier" in r.stderr


def test_a_worker_that_dies_is_named_with_its_record_and_the_run_resumes(long_evals, tmp_path):
    src, want = long_evals
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(cli_command("recover", src, "-m", tiny_target(), "-o", out, "--workers", "2"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # both workers past loading the model (its file mapped), and a record written after that: each is then
    # on a record (on a loaded host one worker can write several before the other has loaded the model)
    while not (len(ws := _workers_of(p)) == 2 and all(_mapped(w, tiny_target()) for w in ws)) and p.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = _lines(tmp_path / "out.jsonl.partial")
    while _lines(tmp_path / "out.jsonl.partial") < max(4, seen + 1) and p.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _workers_of(p)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == Exit.ERROR, err
    errors = [x for x in err.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "died (signal 9) while recovering" in errors[0] and f"{src}, record " in errors[0]
    assert not out.exists() and _lines(tmp_path / "out.jsonl.partial") >= 4
    r = recover(src, out, "--resume", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == want


class _Huge:
    """300 MB that, once pickling begins, end their process 0.2 s later: while they are being pickled or
    written, before the message is whole (a second was too long on a faster host: pickled and written
    whole in under one, 2026-12-05)."""

    def __reduce__(self):
        import threading
        threading.Timer(0.2, lambda: os._exit(9)).start()
        return bytes, (b"x" * 300_000_000,)


class _DiesMidMessage:
    """A task whose worker exits while it is sending a result far larger than a pipe holds."""

    verb = "recovering"

    def open(self, inputs, engine):
        return self

    def item_name(self, index: int) -> str:
        return f"record {index + 1}"

    def run(self, unit, emit) -> None:
        from replay.run.task import Done
        emit("start", unit.records[0])
        emit("done", Done(unit.records[0], _Huge()))

    def forget(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_worker_that_dies_in_the_middle_of_a_message_is_named_not_waited_for():
    """Half a message on the driver's pipe: a worker killed while writing one (found by the test above,
    once in a few runs, as a driver waiting forever). Each worker writes to a pipe of its own, so the rest
    never comes and the end of the pipe says the worker is gone."""
    import threading

    from replay.errors import WorkerDied
    from replay.run.inputs import Inputs
    from replay.runtime.binding import LibChoice
    from replay.runtime.engine import EngineChoice
    from replay.scale.pool import run_local
    from replay.scale.worker import Job
    job = Job(Inputs("{}", "f.jsonl", None, str(tiny_target())), EngineChoice(LibChoice(None, "test")),
              _DiesMidMessage())
    raised: list[BaseException] = []

    def go() -> None:
        try:
            run_local(job, [Unit((0,))], 1, lambda kind, what: None)
        except BaseException as e:  # noqa: BLE001 - what the driver raised, to assert on
            raised.append(e)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the driver waits for the rest of a message from a worker that is gone"
    assert len(raised) == 1 and isinstance(raised[0], WorkerDied), raised
    assert str(raised[0]) == "worker 0 died (exit code 9) while recovering f.jsonl, record 1"


# --- which records travel together (pure) -----------------------------------------------------------

def rec(k: int, prompt: str, cache_n: int = 0) -> Record:
    body = {"content": "x", "timings": {"prompt_n": 5, "cache_n": cache_n, "predicted_n": 1}}
    return Record("f.jsonl", k + 1, "/completion", {"prompt": prompt}, False, response=body)


def test_a_record_served_from_the_previous_ones_cache_stays_with_it():
    rs = [rec(0, "a"), rec(1, "a b", cache_n=1), rec(2, "c"), rec(3, "c d", cache_n=1), rec(4, "c d e", cache_n=2),
          rec(5, "f")]
    assert chains(rs) == [(0, 2), (2, 5), (5, 6)]
    assert [u.records for u in plan_units(rs)] == [(2, 3, 4), (0, 1), (5,)]  # largest first


def test_records_sharing_a_long_prompt_prefix_stay_together_though_independent():
    system = "s" * SHARED_CHARS
    rs = [rec(0, system + "1"), rec(1, system + "2"), rec(2, "other")]
    assert chains(rs) == [(0, 2), (2, 3)]


def test_resuming_inside_a_chain_warms_up_from_where_its_dependency_starts():
    rs = [rec(0, "a"), rec(1, "a b", cache_n=1), rec(2, "a b c", cache_n=2), rec(3, "z")]
    units = plan_units(rs, finished={0, 1})
    assert units == [Unit((0, 1, 2), frozenset({0, 1})), Unit((3,))]
    assert units[0].work == (2,)
    # a finished record nothing later depends on is not evaluated again
    assert plan_units(rs, finished={3}) == [Unit((0, 1, 2))]


def test_a_server_whose_drafter_keeps_state_across_requests_makes_the_file_one_unit():
    """ngram-mod's table (the server's), a slot's n-gram map, a probabilistic draft sampler: every record
    continues what the ones before it left, so the loop is replayed over the file in order, and a resumed
    run rebuilds that state from the file's start (commands/trace_state.py keeps_state)."""
    rs = [rec(0, "a"), rec(1, "b"), rec(2, "c")]
    assert keeps_state(rs, {"spec_types": ("ngram-mod",)}) and keeps_state(rs, {"spec_types": ("ngram-map-k",)})
    assert keeps_state(rs, {"spec_types": ("draft-simple",), "draft_sampling": "probabilistic"})
    assert not keeps_state(rs, {"spec_types": ("draft-simple",)}) and not keeps_state(rs, {})
    assert plan_units(rs) == [Unit((0,)), Unit((1,)), Unit((2,))]
    assert plan_units(rs, keeps_state=True) == [Unit((0, 1, 2))]
    assert plan_units(rs, finished={0, 1}, keeps_state=True) == [Unit((0, 1, 2), frozenset({0, 1}))]
