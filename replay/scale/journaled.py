"""recover over a JSONL of many records, through its journal, on one process or many (`recover
--workers N`, `--ray`, `--resume`).

Records are written one by one to OUT.partial in file order (ordered.py InOrder) and moved to OUT at
the end, so an interrupted run keeps what it finished and `--resume` continues after it, with any
number of workers, to the same bytes. The report and page are written before the caller shows
anything (a reader that stops early loses nothing); OUT is written only when every record was
repaired and the transcript as a whole agrees with the replay.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from replay.errors import Exit, SpecReplayError, UsageError
from replay.report.outputs import write_page, write_report
from replay.report.recovery import RecoverResult
from replay.report.repair import jsonl_line
from replay.run.inputs import Inputs, Outputs
from replay.run.recover import RecoverTask
from replay.run.task import Done
from replay.runtime.engine import EngineChoice
from replay.scale.ordered import InOrder, run_units
from replay.scale.worker import Job
from replay.transcripts.chains import plan_units
from replay.transcripts.journal import Journal


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
    units = plan_units(records, finished)
    parallel = workers > 1 or ray_address is not None
    job = Job(inputs, engine, task)  # the server's -t is a value setting, not a worker's share of the cores
    writer = InOrder(journal, done)
    results: list[Done] = []
    failed: list[Done] = []
    if parallel and len(units) < workers:
        say(f"note: {len(records) - len(finished)} records form {len(units)} unit(s) of work (records the server "
            "served from the previous one's cache stay together): fewer than --workers")
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
