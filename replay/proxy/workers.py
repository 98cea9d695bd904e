"""The replay workers' side of pebble (asyncio): which of them are alive, and the gate that keeps a replay
out of the pool while a cancelled one's worker is being stopped.

pebble stops a cancelled replay's worker from its manager thread some time after the cancel (on a loaded
machine, seconds). A replay sent to the pool in between can be taken by that worker once it ends the
cancelled one; the stop then kills it mid-replay, and pebble never answers that replay
(noxdafox/pebble#153, open in pebble 5.2.3): its request would wait forever.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time


def worker_pids() -> set[int]:
    """The pids of this process's live pebble workers, found as pebble finds them (pebble/pool/process.py:
    by the name it gives their processes)."""
    return {p.pid for p in multiprocessing.active_children() if p.name == "pebble_pool_worker" and p.pid}


class StopGate:
    """Open, but from a cancel until one of the workers alive at the cancel has exited (at most
    `longest` seconds: the worker's SIGTERM, then pebble's SIGKILL)."""

    def __init__(self, longest: float = 30.0):
        self.longest = longest
        self._open = asyncio.Event()
        self._open.set()
        self._waits: set[asyncio.Task] = set()

    async def passed(self) -> None:
        """Return once the gate is open: before a replay is sent to the pool."""
        await self._open.wait()

    def close_until_one_exits(self, workers: set[int]) -> None:
        """Closed until one of `workers` (the pool's, when a replay was cancelled) is no longer alive."""
        if not workers:
            return
        self._open.clear()

        async def wait() -> None:
            try:
                deadline = time.monotonic() + self.longest
                while workers <= worker_pids() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            finally:
                self._open.set()
        task = asyncio.ensure_future(wait())
        self._waits.add(task)
        task.add_done_callback(self._waits.discard)
