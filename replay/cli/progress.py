"""One progress bar for every long multi-item operation (on stderr, so stdout stays clean JSON)."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import click


@contextmanager
def progress_bar(total: int, label: str, done: int = 0) -> Iterator[Callable[[int], None]]:
    """Yield `advance_to(n)`: the bar shows n of `total` items done. Nothing is drawn for a
    single item (its own output is the progress) or when stderr is not a terminal (logs and
    pipes get no bar text); `done` items finished earlier (--resume) start the bar there."""
    if total < 2 or not sys.stderr.isatty():
        yield lambda n: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        bar.update(done)
        yield lambda n: bar.update(n - bar.pos)
