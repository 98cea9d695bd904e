"""recover over a JSONL of many records, through its journal, on one process or many (`recover
--workers N`, `--ray`, `--resume`).

The journal. Finished records are appended, one complete line per write, fsynced, to `OUT.partial`;
`OUT.partial.json` says which input, model and options the lines belong to (`fingerprint`). When the
run completes, the partial file is linked into place as OUT (never over an existing file without
--force) and both are removed. A run killed or interrupted at any point leaves only whole lines of
finished records (a torn last line is cut off when resuming) and no OUT; `--resume` checks the
fingerprint, skips the finished records and appends the rest, so the result is byte-identical to an
uninterrupted run.

File order. With several evaluators (pool.py), records finish out of order: one that finishes
before an earlier one is appended to `OUT.partial.ahead` as {"record": k, "line": ...} (0-based k) and
moves into OUT.partial when the records before it are done (`InOrder`). `--resume` skips those too,
whatever the number of evaluators either run had, so the output is the same bytes as one process's.

The report and page are written before the caller shows anything (a reader that stops early loses
nothing); OUT is written only when every record was repaired and the transcript as a whole agrees with
the replay.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from replay.commands.trace_state import keeps_state
from replay.errors import Exit, OutputExistsError, SpecReplayError, UsageError
from replay.report.pages import write_page
from replay.report.recovery import RecoverResult, write_report
from replay.report.repair import jsonl_line
from replay.run.inputs import Inputs, Outputs
from replay.run.recover import RecoverTask
from replay.run.task import Done
from replay.runtime.engine import EngineChoice
from replay.scale.pool import run_units
from replay.scale.worker import Job
from replay.transcripts.chains import plan_units


class Journal:
    """The files of one journaled run beside OUT (OUT.partial, OUT.partial.json, OUT.partial.ahead): see
    the module docstring."""

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
            held = ", ".join(str(p) for p in (self.path, self.meta) if p.exists())  # the files that are there
            raise OutputExistsError(f"{held} hold{'s' if ',' not in held else ''} an interrupted run: pass --resume "
                                    "to continue it, or --force to start over")
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


class InOrder:
    """Lines into `journal` in file order, starting at record `done` (0-based), with the records an
    earlier run finished ahead already known."""

    def __init__(self, journal: Journal, done: int):
        self.journal = journal
        self.next = done
        self.pending = dict(journal.ahead)
        self._flush()

    def add(self, index: int, line: str) -> None:
        if index == self.next:
            self.journal.append(line)
            self.next += 1
            self._flush()
        else:
            self.pending[index] = line
            self.journal.append_ahead(index, line)

    def _flush(self) -> None:
        while self.next in self.pending:
            self.journal.append(self.pending.pop(self.next))
            self.next += 1


@dataclass(frozen=True)
class Journaled:
    """How a journaled run ended: its report, the records an earlier run finished, and its failure (the
    one line, its detail and the exit code) or None when OUT was written."""

    result: RecoverResult
    earlier: int
    failure: tuple[str, str | None, int] | None = None


def fingerprint(inputs: Inputs, engine: EngineChoice, task: RecoverTask) -> dict:
    """What a journal's records depend on: an interrupted run resumes only with the same ones."""
    flags = engine.flags(task.flags)
    return {"input": str(Path(inputs.source).resolve()),
            "input_sha256": hashlib.sha256(inputs.text.encode("utf-8")).hexdigest(),
            "model": inputs.model, "tolerance": task.options.tolerance, "libllama": engine.library,
            **({"cpu": engine.kernels.variant} if engine.kernels is not None else {}),
            "flags": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(flags.items())}}


def recover_journaled(inputs: Inputs, engine: EngineChoice, task: RecoverTask, outputs: Outputs, *,
                      workers: int = 1, ray_address: str | None = None,
                      say: Callable[[str], None] = lambda line: None,
                      progress: Callable[[int], None] = lambda n: None) -> Journaled:
    """The records of `inputs` into outputs.out through its journal; `say` hears the notes (units fewer
    than workers, a Ray actor that died, the files written), `progress` the records done so far."""
    out, force = outputs.out, outputs.force or outputs.in_place
    if outputs.resume and out.exists() and not force and not Path(str(out) + ".partial").exists():
        raise UsageError(f"{out} exists and there is no interrupted run to resume")
    if ray_address is not None:
        from replay.scale.ray_pool import check_cluster
        check_cluster(ray_address)
    journal = Journal(out, fingerprint(inputs, engine, task))
    done = journal.open(resume=outputs.resume, force=force)
    records = inputs.records
    if done > len(records):
        raise UsageError(f"{journal.path} has {done} records but the input only {len(records)}")
    finished = set(range(done)) | set(journal.ahead)
    units = plan_units(records, finished, keeps_state(records, engine.flags(task.flags)))
    parallel = workers > 1 or ray_address is not None
    job = Job(inputs, engine, task)  # the server's -t is a value setting, not a worker's share of the cores
    writer = InOrder(journal, done)
    results: list[Done] = []
    failed: list[Done] = []
    if parallel and len(units) < workers:
        say(f"note: {len(records) - len(finished)} records form {len(units)} unit(s) of work (records that continue "
            "what the server kept from the one before, its cache or drafter, stay together): fewer than --workers")
    try:
        def on_done(d: Done) -> bool:
            results.append(d)
            progress(len(finished) + len(results))
            if d.result.container is None or not d.result.report.recovered:
                failed.append(d)
                return False
            writer.add(d.index, jsonl_line(d.result.container))
            return True
        run_units(job, units, workers=workers, ray_address=ray_address, on_done=on_done,
                  on_note=lambda text: say(f"note: {text}"))
    except SpecReplayError:
        if not outputs.resume:
            journal.discard_if_empty()
        raise
    finally:
        journal.close()
    res = RecoverResult([d.result.report for d in sorted(results, key=lambda d: d.index)], "")
    write_report(outputs.report_file, res, force)
    if write_page(outputs.html_file, res, force):
        say(f"wrote {outputs.html_file}")
    wrong = None if failed else res.failure()  # the transcript judged as a whole (comparison/values.py)
    if not failed and not wrong:
        journal.finish(force=force)
    earlier = len(finished)
    if wrong:
        return Journaled(res, earlier, (f"{wrong}; {out} not written (the records are kept in {journal.path})",
                                        res.failure_detail(), res.failure_code()))
    if failed:
        kept = f"the {writer.next} records before it are kept in {journal.path}"
        if journal.ahead_path.exists():
            kept += f" (and those finished after it in {journal.ahead_path.name})"
        return Journaled(res, earlier, (f"{res.failure() or failed[0].result.report.source + ': record could not be repaired'}; "
                                        f"{out} not written ({kept})", res.failure_detail(),
                                        res.failure_code() if res.failure() else Exit.ERROR))
    return Journaled(res, earlier)
