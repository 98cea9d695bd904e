"""Evaluate a transcript's first real entry under each CPU variant this host runs.

The first entry of every response is computed for real, in the prompt batch, by whatever kernels the
server's ggml loaded (tools/server/server-context.cpp: the first token is sampled outside the
speculative loop, its probabilities taken from the prompt's last logits). Evaluating that one prompt
under each variant of a release-style libllama tells which kernels computed it: on quantized weights
the variants fall into a few classes whose values differ by 1e-3 to 0.1 nats, and the server's class
reproduces the entry to the last bit.

A process holds one ggml, so each variant is evaluated in a fresh (spawned) worker process with the
variant named in its environment (runtime/binding.py: use_cpu_variant); the worker recovers only the
prompt and the first 1 + DECODES tokens (RecoverOptions.only_entries): the first to compare with the
server's, the others, each computed in a one-token decode, as the variant's decode signature (Probe). What travels is the transcript text
and the record's position, as for `recover --workers` (scale/worker.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from replay.errors import SpecReplayError
from replay.transcripts.entries import n_prompt_cached, record_entries
from replay.transcripts.readers import Record

WITNESSES = 8  # first entries probed per variant when batches may have been shared
DECODES = 16  # tokens after the first, decoded one at a time, that make a variant's decode signature
# the recover options a witness's values depend on (commands/recover.py RecoverOptions): the loop
# shape's build and source, the decode schedule
PROBE_OPTIONS = ("build", "source")
# flags that change no value ggml's CPU kernels compute (each output row is one thread's, summed in one
# order: tests/test_workers.py, values do not depend on the thread count)
THREAD_FLAGS = ("threads", "threads_batch")


@dataclass(frozen=True)
class Probe:
    """One variant's evaluation of the witnesses' first entries: `diff` is the smallest, over the
    witnesses evaluated, of the largest |server - replay| over an entry's logprob and its alternatives
    (nats), and `record` the witness it came from; None with `error` when none could be evaluated."""

    variant: str
    diff: float | None
    error: str | None = None
    record: int | None = None
    # the replay's own values (logprob, then its alternatives', token by token) of that record's next
    # DECODES tokens, each computed in a one-token decode: variants equal on a prompt batch may decode
    # differently (measured: sse42 and x64 equal on long prompts' first entries, then 0.05 to 0.6 nats
    # apart from the second, third or fourth token on)
    decode: tuple[float, ...] | None = None


def witnesses(records: Sequence[Record], *, shared: bool = False, limit: int = WITNESSES) -> list[int]:
    """The records whose first entries may identify the kernels, best first: those with a real first
    entry (a logprob and alternatives, or a nonzero logprob) whose prompt the server evaluated in full,
    then those served partly from its prompt cache (their prompt's KV was computed by an earlier request
    that may not be in the file: a weaker witness); within each, those sent while the /slots snapshot
    taken before them showed no slot busy first. One witness suffices on a server that decodes one
    request at a time. `shared`: the transcript shows batches shared with other requests, which change
    a first entry themselves (measured: 0.03 to 0.24 nats on SmolLM2 Q4_1 from a 4-slot server under
    concurrent requests, enough to make another variant the nearest); then up to `limit`, in the hope
    that one was computed alone.

    >>> witnesses([])
    []
    """
    keys = []
    for k, rec in enumerate(records):
        entries = record_entries(rec)
        if entries and (entries[0].top or entries[0].logprob != 0.0):
            busy = any(isinstance(s, dict) and s.get("is_processing") for s in (rec.snapshot_slots or []))
            keys.append((bool(n_prompt_cached(rec.final())), busy, k))
    return [k for *_, k in sorted(keys)][:limit if shared else 1]


def _child_init(libllama: str | None, variant: str) -> None:  # pragma: no cover - runs in the child
    from replay.runtime import binding
    if libllama:
        os.environ[binding.ENV] = libllama
    os.environ[binding.VARIANT_ENV] = variant


def _child_probe(text: str, source: str, request: dict | None, indices: Sequence[int], model: str, flags: dict,
                 options, variant: str, exact: float | None
                 ) -> list[tuple[int, float | None, str | None, tuple | None]]:  # pragma: no cover - in the child
    from replay.commands.recover import Recoverer
    from replay.runtime.binding import loaded_variant
    from replay.transcripts.readers import read_text
    try:
        if loaded_variant() != variant:
            return [(indices[0], None, f"loaded {loaded_variant()} instead of {variant}", None)]
        records = read_text(text, source, request)
        r = Recoverer(model, flags, replace(options, only_entries=1 + DECODES))
    except SpecReplayError as e:
        return [(indices[0], None, str(e), None)]
    out: list[tuple[int, float | None, str | None, tuple | None]] = []
    try:
        for k in indices:
            try:
                rep = r.recover(records[k]).report
            except SpecReplayError as e:
                out.append((k, None, str(e), None))
                continue
            pairs = rep.tokens[0].real_pairs if rep.tokens else ()
            if not pairs:
                out.append((k, None, rep.error or "the first entry carries no real value to compare", None))
                continue
            later = [t for t in rep.tokens[1:] if t.true_logprob is not None]
            decode = tuple(v for t in later for v in (t.true_logprob, *(x["logprob"] for x in t.true_top))) or None
            out.append((k, max(abs(a - b) for a, b in pairs), None, decode))
            if exact is not None and out[-1][1] <= exact:
                break
    finally:
        r.close()
    return out


def _file_id(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def probe_key(*, text: str, request: dict | None, indices: Sequence[int], model: str | Path, flags: dict, options,
              libllama: Path | None, variant: str, until_exact: float | None) -> str:
    """What a probe's result depends on, hashed: the transcript's text and request, the witnesses, the
    model file and the variant's library (by path, size and mtime), the flags, the options that change
    what a witness evaluates to (PROBE_OPTIONS: not the tolerance, the output or the prefix reuse,
    which is exact), and the decode count. recover and trace, and a second run with other output
    options, share their probes."""
    lib = Path(libllama) if libllama else None
    parts = {"text": hashlib.sha256(text.encode()).hexdigest(), "request": request, "indices": list(indices),
             "model": _file_id(Path(model)),
             "flags": {k: repr(v) for k, v in sorted(flags.items()) if k not in THREAD_FLAGS},
             "options": {f: repr(getattr(options, f, None)) for f in PROBE_OPTIONS}, "until": until_exact,
             "decodes": DECODES,
             "lib": None if lib is None else [_file_id(f) for f in sorted(lib.glob("lib*.so*")) if f.is_file()],
             "variant": variant}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class ProbeCache:
    """Probe results kept under the cache root (kernels/<key>.json): a transcript recovered or traced
    again, unchanged, with the same model, library and options, is not probed again. A result that
    is not whole (an error) is not kept."""

    def __init__(self, root: Path | None):
        self.root = root

    def get(self, key: str) -> Probe | None:
        if self.root is None:
            return None
        try:
            d = json.loads((self.root / f"{key}.json").read_text())
            return Probe(d["variant"], d["diff"], d.get("error"), d.get("record"),
                         tuple(d["decode"]) if d.get("decode") is not None else None)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, probe: Probe) -> None:
        if self.root is None or probe.diff is None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(asdict(probe)))
            os.replace(tmp, self.root / f"{key}.json")
        except OSError:  # a read-only cache is no error: the probe is run again next time
            pass


def default_cache() -> ProbeCache:
    """The probe cache under SPEC_REPLAY_CACHE (or ~/.cache/spec-replay); off with SPEC_REPLAY_PROBE_CACHE=0."""
    from replay.paths import cache_root
    return ProbeCache(None if os.environ.get("SPEC_REPLAY_PROBE_CACHE") == "0" else cache_root() / "kernels")


def probe_variants(variants: Sequence[str], *, text: str, source: str, request: dict | None,
                   indices: Sequence[int], model: str | Path, flags: dict, options, libllama: Path | None,
                   progress: Callable[[str, Probe], None] | None = None, until_exact: float | None = None,
                   cache: ProbeCache | None = None) -> list[Probe]:
    """Evaluate the first entries of records `indices` (witnesses, best first) under each of `variants`
    (one spawned process each, one after another: each uses the machine's cores). With `until_exact`, a
    variant's witnesses are evaluated until one is within it, and once a variant has such a witness the
    variants after it evaluate that witness only: every variant is probed, since the ones that equal the
    server's on it must also be told apart by their one-token decodes (Probe.decode). A worker that dies
    is that variant's error. `cache` keeps and returns results (probe_key)."""
    out: list[Probe] = []
    ctx = mp.get_context("spawn")
    for v in variants:
        if until_exact is not None and any(p.diff is not None and p.diff <= until_exact for p in out):
            indices = [next(p.record for p in out if p.diff is not None and p.diff <= until_exact)]
        key = probe_key(text=text, request=request, indices=indices, model=model, flags=flags, options=options,
                        libllama=libllama, variant=v, until_exact=until_exact) if cache is not None else ""
        kept = cache.get(key) if cache is not None else None
        if kept is not None:
            out.append(kept)
            if progress is not None:
                progress(v, kept)
            continue
        try:
            with cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_child_init,
                                        initargs=(str(libllama) if libllama else None, v)) as pool:
                got = pool.submit(_child_probe, text, source, request, list(indices), str(model), dict(flags),
                                  options, v, until_exact).result()
        except cf.process.BrokenProcessPool:
            got = [(indices[0], None, "the worker process died", None)]
        measured = [(d, k, sig) for k, d, _, sig in got if d is not None]
        if measured:
            diff, k, sig = min(measured, key=lambda m: (m[0], m[1]))
            probe = Probe(v, diff, record=k, decode=sig)
        else:
            probe = Probe(v, None, "; ".join(dict.fromkeys(e for _, _, e, _ in got if e)), record=got[0][0])
        if cache is not None:
            cache.put(key, probe)
        out.append(probe)
        if progress is not None:
            progress(v, probe)
    return out
