"""recover and diff from the front door: the Python API, and the task the commands and workers run.

    recover(source, model, ...) -> RecoverResult     inputs checked, engine chosen (libllama, kernels
                                                     probed: run/engine.py) and applied, every record
                                                     recovered in order (commands/recover.py Recoverer)

The command line (cli/recover.py) and the API start the same way and give the same report; a JSONL of
many records on the command line goes through the journal on one process or many (scale/journaled.py),
each running this task.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from replay.commands.recover import Recovered, Recoverer, RecoverOptions, result_of
from replay.errors import KernelsRetry
from replay.report.recovery import RecoverResult
from replay.run.engine import Say, choose_engine
from replay.run.inputs import Inputs
from replay.run.kernels.cache import default_cache
from replay.run.kernels.choice import EXACT
from replay.run.kernels.types import Probe
from replay.run.task import Done, Emit, run_all
from replay.runtime.engine import EngineChoice
from replay.settings.server_flags import from_mapping
from replay.transcripts.chains import Unit


@dataclass(frozen=True)
class RecoverTask:
    """Recover records with the server flags given here (settings attrs) and the options."""

    flags: dict = field(default_factory=dict)
    options: RecoverOptions = field(default_factory=RecoverOptions)
    verb = "recovering"

    def open(self, inputs: Inputs, engine: EngineChoice) -> "RecoverSession":
        return RecoverSession(self, inputs, engine)

    def item_name(self, index: int) -> str:
        return f"record {index + 1}"


def open_recoverer(inputs: Inputs, engine: EngineChoice, flags: Mapping[str, Any], options: RecoverOptions) -> Recoverer:
    """The Recoverer a transcript's records are recovered on: the engine applied first (its libllama and
    CPU variant, before the models load), the target loaded with the server's flags and the engine's
    repack and threads over them, and the build the engine chose where none was given."""
    engine.apply()
    return Recoverer(inputs.model, engine.flags(flags), engine.options(options), records=inputs.records,
                     kernels=engine.kernels)


class RecoverSession:
    """The target loaded once (with the engine applied first), records recovered by their position; a
    record served from the server's cache follows the record that filled it within a unit."""

    def __init__(self, task: RecoverTask, inputs: Inputs, engine: EngineChoice):
        self.tried = engine.tried
        self._pending: list[Recovered] = []  # recovered on the kernels tried, before the witness decided
        self.records = inputs.records
        self.recoverer = open_recoverer(inputs, engine, task.flags, task.options)

    def run(self, unit: Unit, emit: Emit) -> None:
        for k in unit.records:
            emit("start", k)
            got = self.recoverer.recover(self.records[k])
            if self.tried is not None:
                self._pending.append(got)
                if k == self.tried.record:
                    self._decide()
            if k not in unit.finished:
                emit("done", Done(k, got))

    def _decide(self) -> None:
        """The kernels tried first, judged by the record's first entry as the probe would (within EXACT):
        confirmed, they are the run's "matched" kernels from here on (and in the reports of the records
        recovered so far); else KernelsRetry. Either outcome is kept as the probe's, so that no later run
        computes it again."""
        tried, choice, got = self.tried, self.recoverer.kernels, self._pending[-1]
        self.tried = None
        first = got.report.tokens[0] if got.report.tokens else None
        diff = max((abs(a - b) for a, b in first.real_pairs), default=None) if first is not None else None
        if diff is not None:
            default_cache().put(tried.key, Probe(tried.variant, diff, record=tried.record, repack=tried.repack))
        if diff is None or diff > EXACT:
            off = f"{diff:.3g} nats off" if diff is not None else "not compared"
            raise KernelsRetry(f"the {choice.variant} kernels tried first do not reproduce record {tried.record + 1}'s "
                               f"first entry ({off}): probing the others")
        label = Probe(tried.variant, diff, repack=tried.repack).label
        confirmed = replace(choice, how="matched", diff=diff, diffs=((label, diff),))
        self.recoverer.kernels = confirmed
        for done in self._pending:
            done.report.cpu = confirmed.to_json()
        self._pending = []

    def forget(self) -> None:
        self.recoverer.forget()

    def close(self) -> None:
        self.recoverer.close()


def recover_records(inputs: Inputs, engine: EngineChoice, task: RecoverTask,
                    on_done: Callable[[Done], None] | None = None) -> list[Recovered]:
    """Every record of `inputs` in this process, in order, as one unit: each one's Recovered outcome."""
    session = task.open(inputs, engine)
    try:
        return [d.result for d in run_all(session, len(inputs.records), on_done)]
    finally:
        session.close()


def recover_inputs(inputs: Inputs, engine: EngineChoice, task: RecoverTask,
                   progress: Callable[[int, int], None] | None = None) -> RecoverResult:
    """The report of every record of `inputs`, with the repaired text in the source's own shape (empty
    when a record could not be recovered or the transcript is judged wrong as a whole)."""
    n = len(inputs.records)
    done = recover_records(inputs, engine, task, None if progress is None else lambda d: progress(d.index + 1, n))
    return result_of(inputs.records, done, inputs.text)


def _warn(line: str, warning: bool = False, detail: bool = False) -> None:
    if warning:
        warnings.warn(line.removeprefix("warning: "), stacklevel=3)


def recover(source: str | Path | dict | list, model: str | Path, *, request: dict | None = None,
            flags: dict | None = None, options: RecoverOptions | None = None, libllama: str | None = None,
            server_cpu: str | None = None, progress: Callable[[int, int], None] | None = None,
            say: Say | None = None) -> RecoverResult:
    """Recover true probabilities for every record of a transcript, as `spec-replay recover` does.

    `source` is a path, or an already-parsed object (a transcript, a {"request", "response"} pair, or
    a bare response with `request`). `flags` are the server's flags as llama-server spells them
    ({"--ctx-size": 4096, "-fa": "on"}; settings attrs like "n_ctx" too): a flag that changes nothing
    recover computes is set aside with a warning, one it cannot reproduce or llama-server does not have
    raises SettingsError (settings/server_flags.py). The libllama and CPU kernels are chosen as the
    command line chooses them (`libllama`, `server_cpu` as --libllama, --server-cpu; the kernels probed
    on the transcript's first entry where the library has variants), what the choice says goes to `say`
    (line, is_warning) and its warnings are Python warnings. Returns the per-token report and the
    repaired text in the source's own shape (empty when a record could not be recovered).

        >>> from replay.paths import FIXTURES
        >>> res = recover(FIXTURES / "transcripts" / "tiny-draft-simple.json", model=FIXTURES / "tiny-target.gguf")
        >>> res.records[0].summary()["counts"]
        {'ok': 1, 'placeholder': 19, 'missing': 0, 'mismatch': 0, 'unaligned': 0}
    """
    attrs, notes = from_mapping(flags, "recover")
    for note in notes:
        warnings.warn(note, stacklevel=2)
    options = options or RecoverOptions()
    inputs = Inputs.of_object(source, model, request=request, renamed=options.renamed_model) \
        if isinstance(source, (dict, list)) else Inputs.read(source, model, request=request,
                                                              renamed=options.renamed_model)
    engine = choose_engine(inputs, flags=attrs, options=options, libllama=libllama, server_cpu=server_cpu,
                           say=say or _warn)
    return recover_inputs(inputs, engine, RecoverTask(attrs, options), progress)
