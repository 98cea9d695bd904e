"""Resumable output for multi-record (JSONL) runs.

Finished records are appended, one complete line per write, fsynced, to `OUT.partial`;
`OUT.partial.json` says which input, model and options the lines belong to. When the run
completes, the partial file is linked into place as OUT (never over an existing file
without --force) and both are removed. A run killed or interrupted at any point leaves
only whole lines of finished records (a torn last line is cut off when resuming) and no
OUT; `--resume` checks the fingerprint, skips the finished records and appends the rest,
so the result is byte-identical to an uninterrupted run.

With several evaluators (scale/), records finish out of order: one that finishes before an earlier
one is appended to `OUT.partial.ahead` as {"record": k, "line": ...} (0-based k) and moves into
OUT.partial when the records before it are done. `--resume` skips those too, whatever the number of
evaluators either run had.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from replay.errors import OutputExistsError, SpecReplayError


class Journal:
    def __init__(self, out: Path, fingerprint: dict):
        self.out = Path(out)
        self.path = self.out.with_name(self.out.name + ".partial")
        self.meta = self.out.with_name(self.out.name + ".partial.json")
        self.ahead_path = self.out.with_name(self.out.name + ".partial.ahead")
        self.fingerprint = fingerprint
        self._fd: int | None = None
        self._ahead_fd: int | None = None
        self.ahead: dict[int, str] = {}  # finished out of order, by 0-based record (read on --resume)

    def open(self, *, resume: bool, force: bool) -> int:
        """Start (or continue) the journal; returns how many records are already finished."""
        exists = self.path.exists() or self.meta.exists()
        if exists and not resume and not force:
            raise OutputExistsError(f"{self.path} holds an interrupted run: pass --resume to continue it, "
                                    "or --force to start over")
        done = 0
        if exists and resume:
            try:
                fp = json.loads(self.meta.read_text())
            except (OSError, ValueError):
                raise SpecReplayError(f"{self.meta} is missing or unreadable: cannot tell what {self.path} holds; "
                                      "start over with --force") from None
            if fp != self.fingerprint:
                diff = sorted(k for k in set(fp) | set(self.fingerprint) if fp.get(k) != self.fingerprint.get(k))
                raise SpecReplayError(f"{self.path} was made with another {', '.join(diff)}; "
                                      "start over with --force")
            data = self.path.read_bytes() if self.path.exists() else b""
            keep = data[:data.rfind(b"\n") + 1]  # whole lines only
            if len(keep) != len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(len(keep))
            done = keep.count(b"\n")
            self.ahead = {k: v for k, v in _read_ahead(self.ahead_path).items() if k >= done}
        else:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            _write_small(self.meta, json.dumps(self.fingerprint, indent=2) + "\n")
            self.path.write_bytes(b"")
            self.ahead_path.unlink(missing_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return done

    def append_ahead(self, index: int, line: str) -> None:
        """A record finished before those in front of it (0-based `index`): kept aside, fsynced."""
        if self._ahead_fd is None:
            self._ahead_fd = os.open(self.ahead_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._ahead_fd, (json.dumps({"record": index, "line": line}) + "\n").encode("utf-8"))
        os.fsync(self._ahead_fd)

    def append(self, line: str) -> None:
        """One finished record: a single write of the whole line, then fsync."""
        data = line.encode("utf-8")
        if not data.endswith(b"\n"):
            data += b"\n"
        os.write(self._fd, data)
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._ahead_fd is not None:
            os.close(self._ahead_fd)
            self._ahead_fd = None

    def discard_if_empty(self) -> bool:
        """Remove a journal that holds no finished record (a run that failed before its first one):
        nothing to resume, nothing to keep."""
        self.close()
        if self.path.exists() and self.path.stat().st_size == 0 and not self.ahead_path.exists():
            self.path.unlink()
            self.meta.unlink(missing_ok=True)
            return True
        return False

    def finish(self, *, force: bool) -> None:
        """Move the complete result into place and remove the journal."""
        self.close()
        try:
            if force:
                os.replace(self.path, self.out)
            else:
                os.link(self.path, self.out)
                os.unlink(self.path)
        except FileExistsError:
            raise OutputExistsError(f"{self.out} exists; use --force to overwrite it "
                                    f"(the finished result is kept in {self.path})") from None
        self.meta.unlink(missing_ok=True)
        self.ahead_path.unlink(missing_ok=True)


def _read_ahead(path: Path) -> dict[int, str]:
    """The out-of-order records kept by an interrupted run; a torn last line is ignored."""
    out: dict[int, str] = {}
    try:
        data = path.read_text(encoding="utf-8")
    except OSError:
        return out
    for line in data.splitlines():
        try:
            d = json.loads(line)
            out[int(d["record"])] = str(d["line"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _write_small(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
