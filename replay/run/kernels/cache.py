"""Probe results and a model's kernel classes kept under the cache root, so that a transcript recovered or
traced again, unchanged, with the same model, library and options, is not probed again, and another
transcript of the same model probes one candidate per class (classes.py)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from replay.run.kernels.classes import file_id, lib_files
from replay.run.kernels.types import DECODES, Candidate, Probe, ProbeJob

# the recover options a witness's values depend on (commands/recover.py RecoverOptions): the loop
# shape's build and source, the decode schedule
PROBE_OPTIONS = ("build", "source")
# flags that change no value ggml's CPU kernels compute: batches of two rows or more sum each output in
# one order at any thread count. -t does (a one-token decode over 512 KV cells or more splits the KV
# sum by thread: schedule/rows.py), so it is part of a probe's key.
THREAD_FLAGS = ("threads_batch",)


def probe_key(job: ProbeJob, indices: Sequence[int], candidate: Candidate, *, until_exact: float | None,
              decodes: int = DECODES) -> str:
    """What a probe's result depends on, hashed: the transcript's text and request, the witnesses, the
    model file and the variant's library (by path, size and mtime), the flags, the options that change
    what a witness evaluates to (PROBE_OPTIONS: not the tolerance, the output or the prefix reuse,
    which is exact), the decode count and the repack. recover and trace, and a second run with other
    output options, share their probes."""
    parts = {"text": hashlib.sha256(job.inputs.text.encode()).hexdigest(), "request": job.inputs.request,
             "indices": list(indices), "model": file_id(Path(job.inputs.model)),
             "flags": {k: repr(v) for k, v in sorted(job.flags.items()) if k not in THREAD_FLAGS + ("no_repack",)},
             "options": {f: repr(getattr(job.options, f, None)) for f in PROBE_OPTIONS}, "until": until_exact,
             "decodes": decodes, "lib": lib_files(job.libllama, candidate.variant), "variant": candidate.variant,
             "repack": candidate.repack, "format": 2}  # 2: probes keep `later`
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class ProbeCache:
    """Probe results kept under the cache root (kernels/<key>.json): a transcript recovered or traced
    again, unchanged, with the same model, library and options, is not probed again. A result that
    is not whole (an error) is not kept. Beside them, each candidate's class (classes.py,
    kernels/class-<key>): another transcript of the same model probes one candidate of each class."""

    def __init__(self, root: Path | None):
        self.root = root

    def get(self, key: str) -> Probe | None:
        if self.root is None:
            return None
        try:
            d = json.loads((self.root / f"{key}.json").read_text())
            return Probe(d["variant"], d["diff"], d.get("error"), d.get("record"),
                         tuple(d["decode"]) if d.get("decode") is not None else None, bool(d.get("repack", True)),
                         later=d.get("later"))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, probe: Probe) -> None:
        if self.root is None or probe.diff is None:
            return
        self._write(f"{key}.json", json.dumps({**asdict(probe), "same": []}))

    def klass(self, key: str) -> str | None:
        """A candidate's class signature (classes.py learnt), where it was learnt."""
        return self._read(f"class-{key}")

    def put_class(self, key: str, sig: str) -> None:
        self._put(f"class-{key}", sig)

    def batch(self, key: str) -> str | None:
        """A candidate's batch signature (runtime/signature.py Signature.batches), where it was learnt."""
        return self._read(f"batch-{key}")

    def put_batch(self, key: str, sig: str) -> None:
        self._put(f"batch-{key}", sig)

    def prompt(self, key: str) -> str | None:
        """A candidate's prompt signature (runtime/signature.py Signature.prompt), where it was learnt."""
        return self._read(f"prompt-{key}")

    def put_prompt(self, key: str, sig: str) -> None:
        self._put(f"prompt-{key}", sig)

    def _read(self, name: str) -> str | None:
        if self.root is None:
            return None
        try:
            return (self.root / name).read_text().strip() or None
        except OSError:
            return None

    def _put(self, name: str, text: str) -> None:
        if self.root is not None:
            self._write(name, text)

    def _write(self, name: str, text: str) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{name}.{os.getpid()}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.root / name)
        except OSError:  # a read-only cache is no error: the probe is run again next time
            pass


def default_cache() -> ProbeCache:
    """The probe cache under SPEC_REPLAY_CACHE (or ~/.cache/spec-replay); off with SPEC_REPLAY_PROBE_CACHE=0,
    in a directory of its own with SPEC_REPLAY_PROBE_CACHE=DIR (a model's first transcript, every time)."""
    from replay.paths import cache_root
    chosen = os.environ.get("SPEC_REPLAY_PROBE_CACHE")
    if chosen == "0":
        return ProbeCache(None)
    return ProbeCache(Path(chosen) if chosen else cache_root() / "kernels")
