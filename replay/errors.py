"""What can go wrong, as a tree. Every user-facing failure is one of these.

    SpecReplayError            base: the CLI prints `Error: <message>` and exits non-zero
    ├── BuildError             fetching or building llama.cpp failed
    │   └── PatchError         a tree cannot be patched (not llama.cpp, or code we do not know)
    ├── BindingError           a libllama cannot be loaded under llama-cpp-python's binding
    ├── DecodeError            llama_decode failed (no KV slot for a batch, an invalid batch)
    ├── ModelError             a GGUF is missing, corrupt, not the transcript's model, or its context too small
    ├── SettingsError          a llama-server flag the command cannot reproduce (settings/server_flags.py)
    ├── ServerError            a llama-server is unreachable, not llama.cpp, or answered an error
    ├── TranscriptError        a request/transcript file cannot be read or replayed
    │   └── Unaligned          generated text that no sequence of the model's pieces spells
    ├── KernelsError           no CPU variant here reproduces the server, and nothing says why
    ├── OutputExistsError      refusing to overwrite a file without --force
    ├── UsageError             a bad option or argument found past parsing (exit 2, as click's)
    └── WorkerDied             an evaluator process or Ray actor ended without finishing its work

Messages are one line and name the thing at fault (file and record, URL and
status), so a user can act on them without a traceback.

Exit codes, the same for every command (`Exit`): 0 done, 1 the check failed (placeholders
found, the replay disagrees with the server, not reproduced), 2 a usage error (click's),
3 could not tell or could not run (every SpecReplayError), 70 a bug, 130 interrupted, 141 stdout
closed early.
"""
from __future__ import annotations

import contextlib
import copy
import enum
import json
from typing import Iterator


class Exit(enum.IntEnum):
    """Process exit codes of every spec-replay command (docs/cli.md lists them).

    >>> [int(e) for e in Exit]
    [0, 1, 2, 3, 70, 130, 141]
    """

    OK = 0           # done: every probability real, written, reproduced, verified
    FAILED = 1       # the check failed: placeholders found, replay and server disagree, not reproduced
    USAGE = 2        # a bad option or argument (click.UsageError's own code)
    ERROR = 3        # could not tell / could not run: a SpecReplayError (file, model, server, build)
    INTERNAL = 70    # a bug in spec-replay (EX_SOFTWARE): one line, SPEC_REPLAY_RAISE_ERRORS=1 for the traceback
    INTERRUPTED = 130
    PIPE = 141       # stdout closed before the report was out (`| head`): the shell's code for SIGPIPE


EXIT_MEANINGS = {
    Exit.OK: "done: every probability real (check), written (recover), reproduced (trace), verified (patch --verify)",
    Exit.FAILED: "the check failed: placeholders found (check), the replay disagrees with the server's real values "
                 "or the transcript's text (recover, diff: nothing written; an unaligned token too), not reproduced "
                 "(trace), a verification failed (patch --verify)",
    Exit.USAGE: "a bad option or argument, in one `Error:` line: an unknown option, a value of the wrong kind "
                "(--tolerance must be a finite number of nats >= 0), an output path that is an input",
    Exit.ERROR: "could not tell or could not run: a file, model, server, build or context problem, said in one "
                "`Error:` line (as {\"error\": ...} on stdout under --json)",
    Exit.INTERNAL: "a bug in spec-replay: one line naming where; SPEC_REPLAY_RAISE_ERRORS=1 shows the traceback",
    Exit.INTERRUPTED: "interrupted (Ctrl-C); a multi-record recover keeps its finished records for --resume",
    Exit.PIPE: "stdout was closed before the report was out (piped into head, say), as the shell reports "
               "SIGPIPE; the files were written before the report",
}


class SpecReplayError(Exception):
    """Base class: caught at the CLI edge and shown as a one-line error (exit 3, Exit.ERROR)."""

    exit_code = 3
    detail: str | None = None  # a longer explanation: `-v` and `--json` show it

    def with_detail(self, detail: str) -> "SpecReplayError":
        """This error with a longer explanation behind its one short line (`-v`, `--json`)."""
        self.detail = detail
        return self

    def located(self, source: str, record: int | None = None) -> "SpecReplayError":
        """This error with the file (and record) in front of its message, unless it already names
        them. Same class and attributes, so callers can still tell errors apart."""
        where = source if record is None else f"{source}, record {record}"
        if str(self).startswith(where):
            return self
        err = copy.copy(self)
        err.args = (f"{where}: {self}",)
        return err


class BuildError(SpecReplayError):
    """Fetching, patching or building llama.cpp failed."""


class PatchError(BuildError):
    """The tree cannot be patched (not llama.cpp, or code we do not recognise)."""


class BindingError(SpecReplayError):
    """A libllama cannot be loaded under llama-cpp-python's binding."""


class DecodeError(SpecReplayError):
    """llama_decode failed; `code` is its return value."""

    MEANING = {1: "no KV cache slot for the batch (context too small)", 2: "aborted",
               -1: "invalid batch"}

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message or f"llama_decode returned {code}: {self.MEANING.get(code, 'fatal error')}")
        self.code = code


class ModelError(SpecReplayError):
    """A model file is missing, not a GGUF, or does not match the transcript."""


class SettingsError(SpecReplayError):
    """A llama-server flag or request field the command cannot reproduce (settings/server_flags.py)."""


class ServerError(SpecReplayError):
    """A llama-server could not be reached or answered with an error."""

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status


class TranscriptError(SpecReplayError):
    """A request or transcript cannot be read or replayed; names the file and record."""

    def __init__(self, message: str, *, source: str | None = None, record: int | None = None):
        where = ""
        if source is not None:
            where = source if record is None else f"{source}, record {record}"
            where += ": "
        super().__init__(where + message)
        self.source = source
        self.record = record
        self.bare = message

    def located(self, source: str, record: int | None = None) -> "TranscriptError":
        if self.source is not None:
            return self
        err = TranscriptError(self.bare, source=source, record=record)
        err.detail = self.detail
        return err


class Unaligned(TranscriptError):
    """Generated text that no sequence of the model's pieces continues: not this model's transcript."""

    def __init__(self, index: int, rest: bytes):
        super().__init__(f"generated token {index}: no vocabulary piece continues the text {rest[:24]!r}; "
                         "the transcript does not match this model")
        self.index = index


class KernelsError(SpecReplayError):
    """No CPU variant here reproduces the server's first entry, and nothing said why."""


class KernelsRetry(KernelsError):
    """The kernels tried first (run/kernels/policy.py) do not reproduce the record's first entry: the run
    starts again with the kernels probed (cli/recover.py); a caller that cannot shows this line."""


class OutputExistsError(SpecReplayError):
    """The output file exists and --force was not given."""


class UsageError(SpecReplayError):
    """A bad option or argument that only the run's inputs show (an output that is an input, --server-cpu
    with a library that has no variants): exit 2, as a usage error click finds while parsing."""

    exit_code = 2


class WorkerDied(SpecReplayError):
    """An evaluator process (or Ray actor) ended without finishing its work; names it and its record."""


@contextlib.contextmanager
def located(source: str, record: int | None = None) -> Iterator[None]:
    """A SpecReplayError raised inside names the file and record (SpecReplayError.located), chained
    to the original."""
    try:
        yield
    except SpecReplayError as e:
        err = e.located(source, record)
        if err is e:
            raise
        raise err from e


def json_error(e: ValueError) -> str:
    """Why a JSON text does not parse, where: one phrase for every reader's message.

    >>> json_error(json.JSONDecodeError("Expecting value", "x", 0))
    'Expecting value at line 1 column 1'
    >>> json_error(json.JSONDecodeError("Unterminated string starting at", '{"a', 1))   # not "at at"
    'Unterminated string starting at line 1 column 2'
    """
    if not isinstance(e, json.JSONDecodeError):
        return str(e)
    msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg
    return f"{msg} at line {e.lineno} column {e.colno}"
