"""The same units on Ray actors (`recover --ray ADDRESS --workers N`), for more than one machine.

Each actor is an Evaluator (worker.py): the model loaded once. A unit goes to one actor as a series
of calls, one per record (an actor runs one caller's calls in order), so the driver hears of every
record as it finishes. An actor that dies (its node lost, its process killed) fails its pending
calls with RayActorError: its unit is given to a new actor from the start, the records already
received counted as finished (evaluated again only as far as later ones depend on them), up to
RETRIES times. The driver writes the output and journal (ordered.py), as with local workers.

Where things come from on the cluster: our package is shipped to the workers (runtime_env
py_modules); llama-cpp-python must be installed there. The model file is used at its path when a node
has it there, else shipped once through the object store and kept in the node's temp directory
under its sha256. A chosen build's own libllama (runtime/binding.py) must exist at the same path.
"""
from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from replay.errors import SpecReplayError, WorkerDied
from replay.paths import sha256_file
from replay.scale.worker import Done, Evaluator, Job
from replay.transcripts.chains import Unit

RETRIES = 3


def _ray():
    try:
        import ray
    except ImportError:
        raise SpecReplayError("--ray needs Ray: pip install 'spec-replay[ray]'") from None
    return ray


def check_cluster(address: str, timeout_s: float = 3.0) -> None:
    """Before any file is touched: Ray is installed, and a HOST:PORT answers (one line now, not
    minutes of Ray retrying)."""
    _ray()
    if address == "auto" or address.startswith("ray://") is False and ":" not in address:
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise SpecReplayError(f"cannot reach the Ray cluster at {address}: {e}") from None


class RayEvaluator:
    """The actor: an Evaluator made once the model file is on this node."""

    def __init__(self, job: Job):
        self.job = job
        self.ev: Evaluator | None = None

    def has(self, path: str, size: int) -> bool:
        return os.path.isfile(path) and os.path.getsize(path) == size

    def receive_model(self, data: bytes, sha: str) -> str:
        """Keep a shipped model file in this node's temp directory; returns its path here."""
        d = Path(tempfile.gettempdir()) / "spec-replay-models"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"{sha}.gguf"
        if not p.is_file():
            tmp = p.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        return str(p)

    def load(self, model: str) -> int:
        self.ev = Evaluator(replace(self.job, model=model))
        return os.getpid()

    def forget(self) -> None:
        self.ev.forget()

    def recover(self, index: int, write: bool) -> Done | None:
        out: list[Done] = []
        self.ev.run(Unit((index,), frozenset() if write else frozenset({index})),
                    lambda kind, what: out.append(what) if kind == "done" else None)
        return out[0] if out else None


def run_ray(job: Job, units: Sequence[Unit], workers: int, address: str,
            on_event: Callable[[str, object], None]) -> None:
    """Run `units` on `workers` Ray actors of the cluster at `address` ('auto': the one this machine
    belongs to, or RAY_ADDRESS)."""
    ray = _ray()
    import replay
    check_cluster(address)
    try:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"py_modules": [replay]})
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SpecReplayError(f"cannot reach the Ray cluster at {address!r}: {str(e).splitlines()[0]}") from None
    threads = job.threads or 1
    job = replace(job, threads=threads)
    Actor = ray.remote(num_cpus=threads, max_restarts=0, max_task_retries=0)(RayEvaluator)
    size = os.path.getsize(job.model)
    shipped: dict[str, object] = {}

    def start_actor():
        a = Actor.remote(job)
        model = job.model
        if not ray.get(a.has.remote(job.model, size)):
            if "ref" not in shipped:
                shipped["sha"] = sha256_file(Path(job.model))
                shipped["ref"] = ray.put(Path(job.model).read_bytes())
            model = ray.get(a.receive_model.remote(shipped["ref"], shipped["sha"]))
        ray.get(a.load.remote(model))
        return a

    queue = list(units)
    tries: dict[int, int] = {}
    running: dict[object, tuple] = {}  # ref -> (actor, unit key, index, write)
    per_actor: dict[object, list] = {}  # actor -> its unit's pending refs
    delivered: dict[int, set[int]] = {}  # unit key -> records received

    def submit(actor, key: int, unit: Unit) -> None:
        actor.forget.remote()
        refs = []
        for k in unit.records:
            ref = actor.recover.remote(k, k not in unit.finished)
            running[ref] = (actor, key, k, k not in unit.finished)
            refs.append(ref)
        per_actor[actor] = refs

    keyed = {i: u for i, u in enumerate(queue)}
    todo = list(keyed)
    try:
        idle = []
        for _ in range(min(workers, len(todo))):
            try:
                idle.append(start_actor())
            except ray.exceptions.RayError as e:
                raise WorkerDied(f"a Ray actor could not start: {str(e).splitlines()[0]}") from None
            except Exception as e:  # the Evaluator's own error (a missing file on the node...)
                raise SpecReplayError(str(e).splitlines()[0]) from None
        while todo or running:
            while idle and todo:
                key = todo.pop(0)
                submit(idle.pop(), key, keyed[key])
            ready, _ = ray.wait(list(running), num_returns=1)
            ref = ready[0]
            actor, key, k, write = running.pop(ref)
            try:
                got = ray.get(ref)
            except ray.exceptions.RayActorError:
                # the actor is gone: its unit again, on a new actor, minus what was received
                for r in per_actor.pop(actor, []):
                    running.pop(r, None)
                tries[key] = tries.get(key, 0) + 1
                if tries[key] > RETRIES:
                    raise WorkerDied(f"Ray actors died {tries[key]} times on {job.source}, record {k + 1}") from None
                unit = keyed[key]
                keyed[key] = Unit(unit.records, unit.finished | frozenset(delivered.get(key, ())))
                on_event("note", f"a Ray actor died while recovering {job.source}, record {k + 1}; its unit "
                                 f"({len(keyed[key].work)} record(s) left) is retried on a new actor")
                if keyed[key].work:
                    todo.insert(0, key)
                idle.append(start_actor())
                continue
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), SpecReplayError) else None
                raise SpecReplayError(str(cause) if cause else str(e).splitlines()[0]) from None
            on_event("start", k)
            if got is not None:
                delivered.setdefault(key, set()).add(k)
                on_event("done", got)
            pending = per_actor.get(actor, [])
            if ref in pending:
                pending.remove(ref)
            if not pending:
                per_actor.pop(actor, None)
                idle.append(actor)
    finally:
        ray.shutdown()
