"""N evaluator processes on this machine (`recover --workers N`).

Each worker is a fresh (spawned) process that loads the model once and takes units from one queue
until it is empty; the driver hears "start" and "done" for every record, so that when a worker dies
it can say which record it was on. A record that fails with a known error stops the run with that
error; a worker that dies (killed, out of memory, a crash in libllama) stops it with a WorkerDied
naming the worker and its record. Either way the other workers are stopped and what finished is
kept by the driver (ordered.py).
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import traceback
from typing import Callable, Sequence

from replay.errors import SpecReplayError, WorkerDied
from replay.scale.worker import Evaluator, Job
from replay.transcripts.chains import Unit

POLL_S = 0.5


def _die_with_parent() -> None:
    """Linux: be killed when the driver dies (even by SIGKILL), not left computing for nobody."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _main(wid: int, job: Job, tasks, results, parent: int) -> None:  # pragma: no cover - runs in the child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us; no KeyboardInterrupt tracebacks
    _die_with_parent()
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)
    current = None
    try:
        ev = Evaluator(job)
        while True:
            unit = tasks.get()
            if unit is None:
                break

            def emit(kind: str, what) -> None:
                nonlocal current
                if kind == "start":
                    current = what
                results.put((kind, wid, what))

            ev.forget()
            ev.run(unit, emit)
        ev.close()
        results.put(("exit", wid, None))
    except SpecReplayError as e:
        results.put(("error", wid, (current, str(e))))
    except BaseException as e:  # a bug: report it as this worker's death, with its record
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        results.put(("crash", wid, (current, last)))


def record_name(job: Job, index: int | None) -> str:
    if index is None:
        return f"{job.source} (loading the model)"
    return f"{job.source}, setting {index + 1} of the sweep" if job.tune is not None else f"{job.source}, record {index + 1}"


def run_local(job: Job, units: Sequence[Unit], workers: int, on_event: Callable[[str, object], None]) -> None:
    """Run `units` on `workers` processes; on_event("start", index) and on_event("done", Done) as they
    happen. Raises the first record's error, or WorkerDied."""
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for u in units:
        tasks.put(u)
    n = max(1, min(workers, len(units)))
    for _ in range(n):
        tasks.put(None)
    procs = [ctx.Process(target=_main, args=(wid, job, tasks, results, os.getpid()), daemon=True, name=f"spec-replay-worker-{wid}")
             for wid in range(n)]
    for p in procs:
        p.start()
    current: dict[int, int | None] = {wid: None for wid in range(n)}
    exited: set[int] = set()

    def handle(msg) -> None:
        kind, wid, what = msg
        if kind == "start":
            current[wid] = what
            on_event("start", what)
        elif kind == "done":
            on_event("done", what)
        elif kind == "exit":
            exited.add(wid)
        elif kind == "error":
            raise SpecReplayError(what[1])
        elif kind == "crash":
            raise WorkerDied(f"worker {wid} failed on {record_name(job, what[0])}: {what[1]}")

    try:
        while len(exited) < n:
            try:
                handle(results.get(timeout=POLL_S))
                continue
            except queue.Empty:
                pass
            for wid, p in enumerate(procs):
                if wid not in exited and not p.is_alive():
                    while True:  # what it said before it died
                        try:
                            handle(results.get(timeout=POLL_S))
                        except queue.Empty:
                            break
                    if wid not in exited:
                        code = p.exitcode
                        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                        raise WorkerDied(f"worker {wid} died ({how}) while {job.verb} "
                                         f"{record_name(job, current[wid])}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        # units nobody will take are still buffered for the tasks pipe (more than it holds on a big
        # file): without this the driver's exit would wait for them forever after an error or ^C
        tasks.cancel_join_thread()
        results.cancel_join_thread()
