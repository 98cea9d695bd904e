"""One evaluator: the target model loaded once, records recovered by their position in the file.

The same object serves a local worker process (local.py) and a Ray actor (ray_pool.py). It parses the
transcript text itself (what travels is the text, once, not Python objects), chooses the driver's
libllama before loading anything, and recovers each unit's records in order in one context, so that
a record served from the server's cache follows the record that filled it (shards.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..recovery.recover import Recoverer, RecoverOptions
from ..recovery.repair import jsonl_line
from ..recovery.report import RecordReport
from .shards import Unit


@dataclass(frozen=True)
class Job:
    """What every evaluator of one run needs (picklable)."""

    text: str  # the transcript file's text
    source: str  # its name, for messages
    request: dict | None  # --request, for a bare response
    model: str  # the target GGUF path (as seen by the evaluator)
    flags: dict = field(default_factory=dict)  # our server flags (settings table attrs)
    options: RecoverOptions = field(default_factory=RecoverOptions)
    threads: int | None = None  # -t per evaluator (values do not depend on it)
    libllama: str | None = None  # the driver's libllama file (None: the binding's own)


@dataclass(frozen=True)
class Done:
    """One recovered record: its 0-based position, its repaired JSONL line (None when it could not be
    repaired: its report says why) and its report."""

    index: int
    line: str | None
    report: RecordReport


class Evaluator:
    def __init__(self, job: Job):
        from ..runtime.binding import LibChoice, use_libllama
        from ..transcripts.readers import read_text
        use_libllama(LibChoice(None if job.libllama is None else Path(job.libllama), "the driver's choice"))
        self.records = read_text(job.text, job.source, job.request)
        flags = dict(job.flags)
        if job.threads:
            flags["threads"] = job.threads
        self.recoverer = Recoverer(job.model, flags, job.options)

    def run(self, unit: Unit, emit: Callable[[str, object], None]) -> None:
        """Recover `unit`'s records in order: emit("start", index) before each, emit("done", Done)
        after each one not already finished."""
        for k in unit.records:
            emit("start", k)
            got = self.recoverer.recover(self.records[k])
            if k not in unit.finished:
                line = jsonl_line(got.container) if got.container is not None else None
                emit("done", Done(k, line, got.report))

    def close(self) -> None:
        self.recoverer.close()


def default_threads(workers: int) -> int:
    """Threads per evaluator when -t is not given: this machine's cores shared out."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))
