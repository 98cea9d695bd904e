"""What a run reads and where it writes, each checked once, in one line each, before anything loads.

    Inputs.read(transcript, model, ...)    the transcript file (or an object, or none for trace
                                           --prompt), its --request, the target GGUF: missing files,
                                           directories, a file that is no GGUF, and a -m whose name is not
                                           the model the transcript says its server loaded
    Outputs.check(...)                     a repaired file, report or page that is an input, or two
                                           outputs that are one file (usage errors), or a file that
                                           exists without --force

An `Inputs` travels to worker processes and Ray actors as its text (pickled without its records, which
each reads again from the text): what travels is the text, once, not Python objects.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.errors import ModelError, TranscriptError, UsageError
from replay.reading.identity import file_name, model_names
from replay.runtime.gguf import check_gguf
from replay.transcripts.files import check_writable, read_request, refuse_existing
from replay.transcripts.readers import Record, read_source, read_text


def input_file(path: str | Path, what: str, error: type) -> None:
    """A file the command reads: one line (exit 3) if it is missing or not a file."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{path} is a directory, not {what}")
    if not p.is_file():
        raise error(f"{what} not found: {path}")


def draft_file(flags: dict) -> None:
    """-md, where given, is a file here (recover, diff, trace, tune and proxy load it): one line (exit 3)
    naming it missing, before any model loads. (`record` and `check` pass -md on as the server's path.)"""
    if flags.get("draft_model"):
        input_file(flags["draft_model"], "a draft model file", ModelError)


@dataclass(frozen=True)
class Inputs:
    """The transcript's text, its name in messages (`source`: the path as given, "<object>", "" for
    none), the --request body for a bare response, and the target GGUF (resolved); `renamed`: the user
    says -m is the server's file under another name, so its name is not compared (reading/identity.py).
    `records` are read from the text (at the front door, which so checks them; again after travel)."""

    text: str
    source: str
    request: dict | None
    model: str
    renamed: bool = False

    @staticmethod
    def read(transcript: str | Path | None, model: str | Path, *, request_file: str | Path | None = None,
             request: dict | None = None, renamed: bool = False) -> "Inputs":
        """The files of a run, checked in order: the transcript, the model (a whole GGUF), the request,
        the transcript's records, and the model's name against what they say the server loaded."""
        if transcript is not None:
            input_file(transcript, "a transcript file", TranscriptError)
        input_file(model, "a model file", ModelError)
        check_gguf(model)
        if request_file is not None:
            request = read_request(request_file)
        text = read_source(transcript) if transcript is not None else ""
        return Inputs(text, str(transcript) if transcript is not None else "", request, str(Path(model).resolve()),
                      renamed).checked(Path(model).name)

    @staticmethod
    def of_object(obj: dict | list, model: str | Path, *, request: dict | None = None,
                  renamed: bool = False) -> "Inputs":
        """An already-parsed transcript (a transcript, a {"request", "response"} pair, a bare response with
        `request`), as the Python API takes one."""
        input_file(model, "a model file", ModelError)
        check_gguf(model)
        return Inputs(json.dumps(obj), "<object>", request, str(Path(model).resolve()), renamed).checked(
            Path(model).name)

    def checked(self, given_name: str) -> "Inputs":
        """These inputs once their records read and the model's name is the one each record names (its
        response's "model", /props model_path...), unless `renamed`."""
        for rec in self.records if not self.renamed else ():
            for where, name in model_names(rec):
                if file_name(name) not in (None, given_name):
                    raise ModelError(f"{rec.where}: the server loaded {file_name(name)} ({where}), -m is "
                                     f"{given_name}: give the file the server loaded (--renamed-model if it is "
                                     "that file renamed)")
        return self

    @functools.cached_property
    def records(self) -> list[Record]:
        return read_text(self.text, self.source, self.request) if self.source else []

    def __getstate__(self) -> dict[str, Any]:  # the records are read again where they arrive
        return {k: v for k, v in self.__dict__.items() if k != "records"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _not_an_input(out: Path, inputs: tuple[str | Path | None, ...], what: str) -> None:
    """The output must never be an input: -o equal to the transcript would overwrite it (--in-place says
    that on purpose)."""
    for src in filter(None, inputs):
        s = Path(src)
        if out.resolve() == s.resolve() or (out.exists() and s.exists() and out.samefile(s)):
            raise UsageError(f"{what} {out} is the input {src}: write elsewhere" +
                             (", or give --in-place to replace the transcript on purpose" if what == "-o" else ""))


@dataclass(frozen=True)
class Outputs:
    """Where a run writes: the repaired file (None for diff, trace and tune; `in_place` replaces the
    transcript), the --report and --html files; `force` overwrites, `resume` continues OUT.partial."""

    out: Path | None = None
    report_file: str | None = None
    html_file: str | None = None
    force: bool = False
    in_place: bool = False
    resume: bool = False

    def check(self, *inputs: str | Path | None) -> "Outputs":
        """No output is one of `inputs` or another output, and none exists unless --force (the repaired
        file may, with --resume), and each can be written (transcripts/files.py check_writable). Usage
        errors (exit 2) but for an existing file or one that cannot be written (exit 3)."""
        if self.out is not None and not self.in_place:
            _not_an_input(self.out, inputs, "-o")
            if not self.resume:
                refuse_existing(self.out, self.force)
            check_writable(self.out)
        elif self.in_place and inputs and inputs[0] is not None:
            check_writable(inputs[0])  # replaced by a file written beside it
        for name, extra in (("--report", self.report_file), ("--html", self.html_file)):
            if extra:
                _not_an_input(Path(extra), inputs, name)
                if self.out is not None and Path(extra).resolve() == self.out.resolve():
                    raise UsageError(f"{name} must not be the output file")
                refuse_existing(extra, self.force)
                check_writable(extra)
        if self.report_file and self.html_file and Path(self.report_file).resolve() == Path(self.html_file).resolve():
            raise UsageError("--report and --html must be different files")
        return self
