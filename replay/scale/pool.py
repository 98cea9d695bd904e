"""Where a run's units are evaluated, as the driver sees it: in this process, on N worker processes on
this machine (`--workers N`), or on Ray actors (`--ray ADDRESS`: ray_pool.py); each finished item goes
back to the caller as it finishes (journaled.py puts recover's back in file order).

Local workers. Each worker is a fresh (spawned) process that loads the model once and takes units from
one queue until it is empty; the driver hears "start" and "done" for every record, so that when a
worker dies it can say which record it was on. Each worker answers on a pipe of its own: one killed
while it was writing a message leaves that pipe, not a shared queue, with half a message, and the
driver reads the end of it as the worker's death instead of waiting for the rest forever. A record
that fails with a known error stops the run with that error; a worker that dies (killed, out of
memory, a crash in libllama) stops it with a WorkerDied naming the worker and its record. Either way
the other workers are stopped and what finished is kept by the driver.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import traceback
from multiprocessing.connection import wait
from typing import Callable, Sequence

from replay.errors import SpecReplayError, WorkerDied
from replay.run.task import Done
from replay.scale.worker import Evaluator, Job
from replay.settings.config import core_share, set_batch_threads
from replay.transcripts.chains import Unit

POLL_S = 0.5  # how often the driver looks for a worker that died without a word


class Stop(Exception):
    """A record could not be recovered: stop handing out work (the driver reports it)."""


def run_in_process(job: Job, units: Sequence[Unit], on_event: Callable[[str, object], None]) -> None:
    """The units one after another in this process, in file order."""
    ev = Evaluator(job)
    try:
        for unit in sorted(units, key=lambda u: u.records[0]):
            ev.forget()
            ev.run(unit, on_event)
    finally:
        ev.close()


def run_units(job: Job, units: Sequence[Unit], *, workers: int = 1, ray_address: str | None = None,
              on_done: Callable[[Done], bool | None], on_note: Callable[[str], None] | None = None,
              on_progress: Callable[[int], None] | None = None) -> None:
    """Run `units` in this process, on `workers` local processes, or on Ray (`ray_address`);
    `on_done(done)` for every finished item, in the order they finish; it returns False to stop
    the run (a record that could not be repaired). Errors: the failing item's SpecReplayError,
    errors.WorkerDied."""
    def on_event(kind: str, what) -> None:
        if kind == "done" and on_done(what) is False:
            raise Stop()
        elif kind == "note" and on_note is not None:
            on_note(what)
        elif kind == "progress" and on_progress is not None:
            on_progress(what)

    try:
        if ray_address is not None:
            from replay.scale.ray_pool import run_ray
            run_ray(job, units, workers, ray_address, on_event)
        elif workers > 1 and len(units) > 1:
            run_local(job, units, workers, on_event)
        else:
            run_in_process(job, units, on_event)
    except Stop:
        return


def _die_with_parent() -> None:
    """Linux: be killed when the driver dies (even by SIGKILL), not left computing for nobody."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _main(wid: int, job: Job, tasks, results, parent: int, share: int) -> None:  # pragma: no cover - runs in the child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us; no KeyboardInterrupt tracebacks
    _die_with_parent()
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)
    # this worker's share of the cores for its batches, whose values do not depend on their threads (the
    # one-token decodes keep the server's -t, which does change values: settings/config.py thread_count)
    set_batch_threads(share)
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
                results.send((kind, wid, what))

            ev.forget()
            ev.run(unit, emit)
        ev.close()
        results.send(("exit", wid, None))
    except SpecReplayError as e:
        results.send(("error", wid, (current, str(e))))
    except BaseException as e:  # a bug: report it as this worker's death, with its record
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        results.send(("crash", wid, (current, last)))


def run_local(job: Job, units: Sequence[Unit], workers: int, on_event: Callable[[str, object], None]) -> None:
    """Run `units` on `workers` processes; on_event("start", index), on_event("done", Done) and the
    session's other events as they happen. Raises the first item's error, or WorkerDied."""
    ctx = mp.get_context("spawn")
    tasks = ctx.Queue()
    for u in units:
        tasks.put(u)
    n = max(1, min(workers, len(units)))
    for _ in range(n):
        tasks.put(None)
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]  # (the driver's end, the worker's)
    share = core_share(n)
    procs = [ctx.Process(target=_main, args=(wid, job, tasks, pipes[wid][1], os.getpid(), share), daemon=True,
                         name=f"spec-replay-worker-{wid}") for wid in range(n)]
    for p in procs:
        p.start()
    for _, end in pipes:
        end.close()  # the worker holds its end: when it is gone, ours reads EOF
    current: dict[int, int | None] = {wid: None for wid in range(n)}
    exited: set[int] = set()
    live = {pipes[wid][0]: wid for wid in range(n)}

    def handle(msg) -> None:
        kind, wid, what = msg
        if kind == "start":
            current[wid] = what
            on_event("start", what)
        elif kind in ("done", "progress"):
            on_event(kind, what)
        elif kind == "exit":
            exited.add(wid)
        elif kind == "error":
            raise SpecReplayError(what[1])
        elif kind == "crash":
            raise WorkerDied(f"worker {wid} failed on {job.item_name(what[0])}: {what[1]}")

    def died(wid: int) -> WorkerDied:
        procs[wid].join(timeout=10)
        code = procs[wid].exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return WorkerDied(f"worker {wid} died ({how}) while {job.verb} {job.item_name(current[wid])}")

    try:
        while len(exited) < n:
            for conn in wait(list(live), timeout=POLL_S):
                wid = live[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # its end closed: it exited, or died (maybe mid-message)
                    del live[conn]
                    if wid not in exited:
                        raise died(wid) from None
                    continue
                handle(msg)
            for conn, wid in list(live.items()):  # a worker gone without closing its end (a zombie holder)
                if wid not in exited and not procs[wid].is_alive() and not conn.poll():
                    raise died(wid)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        for conn in live:
            conn.close()
        # units nobody will take are still buffered for the tasks pipe (more than it holds on a big
        # file): without this the driver's exit would wait for them forever after an error or ^C
        tasks.cancel_join_thread()
