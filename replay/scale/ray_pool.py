"""The same units on Ray actors (`recover --ray ADDRESS --workers N`), for more than one machine.

Each actor is an Evaluator (worker.py): the model loaded once. A unit goes to one actor as a series
of calls, one per record (an actor runs one caller's calls in order), so the driver hears of every
record as it finishes. An actor that dies (its node lost, its process killed) fails its pending
calls with RayActorError: its unit is given to a new actor from the start, the records already
received counted as finished (evaluated again only as far as later ones depend on them), up to
RETRIES times. The driver writes the output and journal (journaled.py), as with local workers.

Where things come from on the cluster: our package is shipped to the workers (runtime_env
py_modules); llama-cpp-python must be installed there. The model file is used at its path when a node
has it there, else shipped once through the object store and kept in the node's temp directory
under its sha256 and file name. A chosen build's own libllama (runtime/binding.py) must exist at the same path.
"""
from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from replay.errors import SpecReplayError, WorkerDied
from replay.paths import sha256_file
from replay.run.task import Done
from replay.scale.worker import Evaluator, Job
from replay.transcripts.chains import Unit

RETRIES = 3


def _ray():
    try:
        import ray
    except ImportError:
        raise SpecReplayError("--ray needs Ray: pip install -e '.[ray]' in the spec-replay checkout") from None
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
        """Keep a shipped model file in this node's temp directory, under its sha256 and its own file name
        (the name the transcript's is compared with: reading/identity.py); returns its path here."""
        d = Path(tempfile.gettempdir()) / "spec-replay-models" / sha
        d.mkdir(parents=True, exist_ok=True)
        p = d / Path(self.job.inputs.model).name
        if not p.is_file():
            tmp = p.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        return str(p)

    def load(self, model: str) -> int:
        self.ev = Evaluator(self.job.on_node(model))
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
    try:
        _Scheduler(ray, job, units, on_event).run(workers)
    finally:
        ray.shutdown()


@dataclass
class _Call:
    """One record's call on an actor: which unit it belongs to, and whether its output is written."""

    actor: object
    unit: int
    record: int
    write: bool


class _Scheduler:
    """The driver's state, in one place: units waiting (`todo`, by key into `units`), calls in flight
    (`running`, by Ray ref), each actor's pending calls, the records each unit delivered, and how
    often each unit's actor died."""

    def __init__(self, ray, job: Job, units: Sequence[Unit], on_event: Callable[[str, object], None]):
        self.ray, self.job, self.on_event = ray, job, on_event
        self.Actor = ray.remote(num_cpus=job.engine.flags(job.task.flags).get("threads") or 1, max_restarts=0, max_task_retries=0)(RayEvaluator)
        self.units = dict(enumerate(units))
        self.todo = list(self.units)
        self.running: dict[object, _Call] = {}
        self.pending: dict[object, list] = {}  # actor -> refs of its unit's calls not yet returned
        self.delivered: dict[int, set[int]] = {}
        self.tries: dict[int, int] = {}
        self.shipped: dict[str, object] = {}  # the model file in the object store, once an actor lacks it

    def run(self, workers: int) -> None:
        idle = [self.start_actor() for _ in range(min(workers, len(self.todo)))]
        while self.todo or self.running:
            while idle and self.todo:
                self.submit(idle.pop(), self.todo.pop(0))
            ready, _ = self.ray.wait(list(self.running), num_returns=1)
            actor = self.finish(ready[0])
            if actor is not None:
                idle.append(actor)

    def start_actor(self):
        """A new actor with the model loaded: from its path where the node has it, else shipped."""
        ray, job = self.ray, self.job
        try:
            a = self.Actor.remote(job)
            model = job.inputs.model
            if not ray.get(a.has.remote(model, os.path.getsize(model))):
                if "ref" not in self.shipped:
                    self.shipped["sha"] = sha256_file(Path(model))
                    self.shipped["ref"] = ray.put(Path(model).read_bytes())
                model = ray.get(a.receive_model.remote(self.shipped["ref"], self.shipped["sha"]))
            ray.get(a.load.remote(model))
            return a
        except ray.exceptions.RayError as e:
            raise WorkerDied(f"a Ray actor could not start: {str(e).splitlines()[0]}") from None
        except SpecReplayError:
            raise
        except Exception as e:  # the Evaluator's own error (a missing file on the node...)
            raise SpecReplayError(str(e).splitlines()[0]) from None

    def submit(self, actor, key: int) -> None:
        """A unit's records as calls on one actor, in order, after it forgets its KV."""
        unit = self.units[key]
        actor.forget.remote()
        refs = []
        for k in unit.records:
            ref = actor.recover.remote(k, k not in unit.finished)
            self.running[ref] = _Call(actor, key, k, k not in unit.finished)
            refs.append(ref)
        self.pending[actor] = refs

    def finish(self, ref):
        """One call returned: report it; returns the actor when its unit is done (it is idle then)."""
        call = self.running.pop(ref)
        try:
            got = self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            return self.retry(call)
        except self.ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), SpecReplayError) else None
            raise SpecReplayError(str(cause) if cause else str(e).splitlines()[0]) from None
        self.on_event("start", call.record)
        if got is not None:
            self.delivered.setdefault(call.unit, set()).add(call.record)
            self.on_event("done", got)
        refs = self.pending.get(call.actor, [])
        if ref in refs:
            refs.remove(ref)
        if refs:
            return None
        self.pending.pop(call.actor, None)
        return call.actor

    def retry(self, call: _Call):
        """The actor is gone: its unit again, on a new actor, minus what was received (up to RETRIES
        times); returns the new actor, idle."""
        for r in self.pending.pop(call.actor, []):
            self.running.pop(r, None)
        key = call.unit
        self.tries[key] = self.tries.get(key, 0) + 1
        if self.tries[key] > RETRIES:
            raise WorkerDied(f"Ray actors died {self.tries[key]} times on {self.job.item_name(call.record)}") from None
        unit = self.units[key]
        self.units[key] = Unit(unit.records, unit.finished | frozenset(self.delivered.get(key, ())))
        self.on_event("note", f"a Ray actor died while recovering {self.job.item_name(call.record)}; its "
                              f"unit ({len(self.units[key].work)} record(s) left) is retried on a new actor")
        if self.units[key].work:
            self.todo.insert(0, key)
        return self.start_actor()
