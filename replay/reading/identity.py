"""Is the model file given (-m, -md) the one the server loaded? The names and facts a transcript carries,
compared with the file's. Pure: the transcript side is a Record's fields, the file side a ModelFacts.

What a b11434 server tells of its model:

    response "model"          model_name: the first --alias, else the -m path as typed (-hf: the repo
                              name) (tools/server/server-context.cpp:1505-1514, server.cpp:189-192);
                              every completion endpoint's final object carries it (server-task.cpp:347,
                              396, 444); the request's own "model" is ignored
    /props model_path         the -m path as typed (server-context.cpp:4544, 4971)
    /props model_alias        model_name again
    /props model_ftype        llama_ftype_name of the file type: "Q4_1", "Q4_K - Medium"
                              (server-context.cpp:4537); libllama's llama_model_desc ends with it
    /v1/models meta           size (llama_model_size, bytes) and n_params (server-context.cpp:4571-4573)
    server.flags              --spec-draft-model as `record` was told it (no endpoint shows the draft:
                              the draft path appears in no response, server-context.cpp:1253 logs it only)

The file's GGUF `general.name` is not among them: no b11434 endpoint exposes it (libllama reads it,
src/llama-model.cpp:1315, and only logs it), so it cannot be compared.

A name that is a path to a GGUF file is compared by its file name; another name (an --alias, an -hf
repo) is listed as not comparable. File type, size and parameter count are facts a renamed copy keeps,
so they are compared whatever the names; a file the user renamed on purpose is said with
--renamed-model, which sets the names aside and nothing else.

Whatever the names say, the tokens must be the file's: every generated id within its vocabulary, and
the pieces of the top lists the server sent equal to its own (check_vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable

from replay.errors import ModelError
from replay.transcripts.plan import Known, Plan, entry_at
from replay.transcripts.readers import Record


@dataclass(frozen=True)
class ModelFacts:
    """What identifies a loaded model file (runtime/llama.py Model: desc, size_bytes, n_params)."""

    file: str  # its file name
    desc: str  # llama_model_desc: "<arch> <size> <file type>"
    size: int | None = None
    n_params: int | None = None

    @classmethod
    def of(cls, model: Any) -> "ModelFacts":
        return cls(model.path.name, model.desc(), model.size_bytes(), model.n_params())

    def has_ftype(self, ftype: str) -> bool:
        """Is `ftype` (/props model_ftype) this file's type?

        >>> ModelFacts("a.gguf", "gemma3 270M Q4_K - Medium").has_ftype("Q4_K - Medium")
        True
        >>> ModelFacts("a.gguf", "gemma3 270M Q8_0").has_ftype("Q4_K - Medium")
        False
        """
        return self.desc == ftype or self.desc.endswith(" " + ftype)


@dataclass(frozen=True)
class Compared:
    """One piece of evidence: where the transcript says it, what it says, the file's own, and the verdict
    ("same", "differs", or "not compared" with why)."""

    what: str
    recorded: Any
    ours: Any
    verdict: str

    def to_json(self) -> dict:
        return {"what": self.what, "recorded": self.recorded, "ours": self.ours, "verdict": self.verdict}


def file_name(name: str) -> str | None:
    """The file name of a recorded model name when it names a GGUF file (a path as typed, either
    separator), else None (an --alias, an -hf repo).

    >>> file_name("/root/models/SmolLM2-135M-Instruct.Q4_1.gguf"), file_name("fixtures\\\\tiny.gguf")
    ('SmolLM2-135M-Instruct.Q4_1.gguf', 'tiny.gguf')
    >>> file_name("ggml-org/gemma-3-270m-GGUF:Q4_K_M") is None, file_name("my-model") is None
    (True, True)
    """
    if not isinstance(name, str) or not name.lower().endswith(".gguf"):
        return None
    return PureWindowsPath(PurePosixPath(name).name).name


def model_names(rec: Record) -> list[tuple[str, str]]:
    """Every name the record carries for its target model: (where, name), in the order above."""
    out: list[tuple[str, str]] = []
    for obj in [rec.final(), rec.response, *rec.chunks()[::-1]]:
        if isinstance(obj, dict) and isinstance(obj.get("model"), str):
            out.append(('the response\'s "model"', obj["model"]))
            break
    props = rec.props or {}
    for key in ("model_path", "model_alias"):
        if isinstance(props.get(key), str):
            out.append((f"/props {key}", props[key]))
    return out


def compare_model(rec: Record, facts: ModelFacts, *, renamed: bool = False) -> list[Compared]:
    """The evidence on the target model, each piece compared (see the module docstring)."""
    out = []
    for where, name in model_names(rec):
        fname = file_name(name)
        if fname is None:
            out.append(Compared(where, name, facts.file, "not compared: not a file name (an --alias or a repo)"))
        elif renamed:
            out.append(Compared(where, name, facts.file, "not compared: --renamed-model"))
        else:
            out.append(Compared(where, name, facts.file, "same" if fname == facts.file else "differs"))
    props = rec.props or {}
    if isinstance(props.get("model_ftype"), str):
        ftype = props["model_ftype"]
        out.append(Compared("/props model_ftype", ftype, facts.desc, "same" if facts.has_ftype(ftype) else "differs"))
    meta = rec.models_meta or {}
    for key, ours in (("size", facts.size), ("n_params", facts.n_params)):
        v = meta.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and ours is not None:
            out.append(Compared(f"/v1/models meta.{key}", v, ours, "same" if v == ours else "differs"))
    return out


def compare_draft(rec: Record, draft_file: str, *, renamed: bool = False) -> list[Compared]:
    """The evidence on the draft model: the --spec-draft-model `record` wrote (server.flags)."""
    name = (rec.flags or {}).get("--spec-draft-model")
    if not isinstance(name, str):
        return []
    fname = file_name(name)
    if fname is None or renamed:
        return [Compared("server.flags --spec-draft-model", name, draft_file,
                         "not compared: " + ("--renamed-model" if renamed else "not a file name"))]
    return [Compared("server.flags --spec-draft-model", name, draft_file, "same" if fname == draft_file else "differs")]


def located_draft(recorded: str, transcript: str, model: str | Path,
                  is_file: Callable[[Path], bool] = Path.is_file) -> tuple[str, str] | None:
    """Where the draft the transcript names (its --spec-draft-model: a path on the server's machine, as the
    server was given it) is here, when that path is not a file here: (path, where it was found), or None
    (the path is a file as it stands, or it is found nowhere). Looked for, in order: the path taken from
    the transcript's folder, then its file name next to the transcript, then next to -m; the first file
    wins (a draft given with -md is never looked for).

    >>> here = {Path("/data/run/fixtures/tiny-draft.gguf"), Path("/models/tiny-draft.gguf")}
    >>> located_draft("fixtures/tiny-draft.gguf", "/data/run/t.json", "/models/t.gguf", here.__contains__)
    ('/data/run/fixtures/tiny-draft.gguf', "from the transcript's folder")
    >>> located_draft("/srv/models/tiny-draft.gguf", "/tmp/t.json", "/models/t.gguf", here.__contains__)
    ('/models/tiny-draft.gguf', 'next to -m')
    >>> located_draft("/srv/x.gguf", "/tmp/t.json", "/models/t.gguf", here.__contains__) is None
    True
    """
    if is_file(Path(recorded)):
        return None
    name = file_name(recorded)
    folder = Path(transcript).parent if transcript and not transcript.startswith("<") else None
    candidates = []
    if folder is not None and not Path(recorded).is_absolute():
        candidates.append((folder / recorded, "from the transcript's folder"))
    if name is not None:
        if folder is not None:
            candidates.append((folder / name, "next to the transcript"))
        candidates.append((Path(model).parent / name, "next to -m"))
    return next(((str(p), where) for p, where in candidates if is_file(p)), None)


def mismatch(evidence: list[Compared], option: str) -> str | None:
    """One line naming both sides of the first piece of evidence that differs, or None.

    >>> ev = [Compared('the response\\'s "model"', "/m/SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_0.gguf", "differs")]
    >>> print(mismatch(ev, "-m"))
    the server loaded SmolLM2-135M-Instruct.Q4_1.gguf (the response's "model"), -m is Q4_0.gguf: give the file the server loaded (--renamed-model if it is that file renamed)
    >>> mismatch([Compared("/props model_ftype", "Q4_1", "llama 135M Q4_0", "differs")], "-m").split(":")[0]
    'the server loaded a Q4_1 model (/props model_ftype), -m is llama 135M Q4_0'
    """
    for c in evidence:
        if c.verdict != "differs":
            continue
        if c.what.endswith("model_ftype"):
            return (f"the server loaded a {c.recorded} model ({c.what}), {option} is {c.ours}: give the file the "
                    "server loaded")
        if "meta." in c.what:
            return (f"the server's model has {c.what.split('.')[-1]} {c.recorded} ({c.what}), {option} has "
                    f"{c.ours}: give the file the server loaded")
        return (f"the server loaded {file_name(c.recorded)} ({c.what}), {option} is {c.ours}: give the file the "
                "server loaded (--renamed-model if it is that file renamed)")
    return None


def check_vocabulary(rec: Record, plan: Plan, *, n_vocab: int, file: str, piece: Callable[[int], bytes],
                     plain: Callable[[int], bytes]) -> None:
    """Refuse a transcript from another model in one line (libllama would abort on an id outside its
    vocabulary): every generated id must lie within the file's `n_vocab`, and the first 64 pieces of the
    real entries' top lists must be its pieces (`piece`: with control tokens rendered; `plain`: without,
    as the server renders them unless started with --special)."""
    bad = next((i.id for i in plan if isinstance(i, Known) and not 0 <= i.id < n_vocab), None)
    if bad is not None:
        raise ModelError(f"generated token id {bad} is outside {file}'s vocabulary ({n_vocab} tokens): the "
                         "transcript comes from another model")
    checked = 0
    for item in plan:
        e = entry_at(rec, item.place)
        if not e:
            continue
        for t in (e.get("top_logprobs") or e.get("top_probs") or []):
            tid, b = t.get("id"), t.get("bytes")
            if isinstance(tid, int) and isinstance(b, list):
                if not 0 <= tid < n_vocab:
                    raise ModelError(f"token id {tid} is outside {file}'s vocabulary ({n_vocab} tokens): the "
                                     "transcript comes from another model")
                if bytes(b) != piece(tid) and not (not b and not plain(tid)):
                    raise ModelError(f"token {tid} is {bytes(b)!r} in the transcript but {piece(tid)!r} in {file}: "
                                     "the transcript comes from another model")
                checked += 1
            if checked >= 64:
                return
