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

from replay.commands.kernel_classes import (
    Candidate,
    Witnessed,
    classes,
    file_id,
    learnt,
    lib_files,
    representatives,
    signature_key,
    undecided,
)
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
    repack: bool = True  # with extra buffer types (llama.cpp's default) or without (--no-repack)
    # the other candidates whose kernel signature (runtime/signature.py) is this one's: they compute this
    # model bit for bit alike, so this probe stands for them
    same: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The candidate as reports name it.

        >>> Probe("zen4", 0.0).label, Probe("zen4", 0.0, repack=False).label
        ('zen4', 'zen4 --no-repack')
        """
        return self.variant if self.repack else f"{self.variant} --no-repack"


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


@dataclass(frozen=True)
class Outcome:
    """One witness evaluated by one candidate in a probe's process (what travels back)."""

    record: int
    repack: bool
    diff: float | None = None  # the largest |server - replay| over the first entry's values
    error: str | None = None
    values: tuple[float, ...] | None = None  # the replay's own first-entry values (logprob, alternatives)
    decode: tuple[float, ...] | None = None  # its next DECODES tokens' values, one-token decodes
    twin: bool = False  # repack False computed as repack True: no weight took an extra buffer type


def _child_probe(text: str, source: str, request: dict | None, indices: Sequence[int], model: str, flags: dict,
                 options, variant: str, exact: float | None, repacks: Sequence[bool],
                 decodes: int = DECODES) -> list[Outcome]:  # pragma: no cover - in the child
    """Each of `repacks` in turn (True first: the model loaded with or without extra buffer types): the
    witnesses' first entries (and the `decodes` tokens after each), until one is within `exact`. Without
    repack after a load with it whose weights took no extra buffer type, the same outcomes again, marked
    twins (the same computation)."""
    from replay.commands.recover import Recoverer
    from replay.runtime.binding import loaded_variant
    from replay.transcripts.readers import read_text
    try:
        if loaded_variant() != variant:
            return [Outcome(indices[0], r, error=f"loaded {loaded_variant()} instead of {variant}") for r in repacks]
        records = read_text(text, source, request)
    except SpecReplayError as e:
        return [Outcome(indices[0], r, error=str(e)) for r in repacks]
    out: list[Outcome] = []
    took_extra: bool | None = None
    for repack in repacks:
        if not repack and took_extra is False:
            out += [replace(o, repack=False, twin=True) for o in out if o.repack]
            continue
        try:
            r = Recoverer(model, {**flags, "no_repack": not repack}, replace(options, only_entries=1 + decodes))
        except SpecReplayError as e:
            out.append(Outcome(indices[0], repack, error=str(e)))
            continue
        if repack:
            took_extra = bool(r.model.buffers)
        try:
            for k in indices:
                out.append(_witness(r, records[k], k, repack))
                if exact is not None and out[-1].diff is not None and out[-1].diff <= exact:
                    break
        finally:
            r.close()
    return out


def _witness(r, rec: Record, k: int, repack: bool) -> Outcome:  # pragma: no cover - in the child
    try:
        rep = r.recover(rec).report
    except SpecReplayError as e:
        return Outcome(k, repack, error=str(e))
    first = rep.tokens[0] if rep.tokens else None
    pairs = first.real_pairs if first is not None else ()
    if not pairs:
        return Outcome(k, repack, error=rep.error or "the first entry carries no real value to compare")
    values = tuple(v for v in (first.true_logprob, *(x["logprob"] for x in first.true_top)) if v is not None)
    later = [t for t in rep.tokens[1:] if t.true_logprob is not None]
    decode = tuple(v for t in later for v in (t.true_logprob, *(x["logprob"] for x in t.true_top))) or None
    return Outcome(k, repack, max(abs(a - b) for a, b in pairs), values=values, decode=decode)


def _child_signatures(text: str, source: str, request: dict | None, index: int, model: str, flags: dict,
                      variant: str, repacks: Sequence[bool]) -> list[tuple[bool, str | None]]:  # pragma: no cover
    """The model's kernel signature (runtime/signature.py) with and/or without extra buffer types, on
    the context record `index` is replayed with."""
    from replay.runtime.binding import loaded_variant
    from replay.runtime.llama import Model, model_params
    from replay.runtime.signature import kernel_signature
    from replay.settings import resolve
    from replay.settings.config import thread_count
    from replay.transcripts.readers import read_text
    try:
        if loaded_variant() != variant:
            return [(r, None) for r in repacks]
        rec = read_text(text, source, request)[index]
        cfg = resolve("context", flags=flags, recorded=rec.flags, props=rec.props)
    except SpecReplayError:
        return [(r, None) for r in repacks]
    out: list[tuple[bool, str | None]] = []
    for repack in repacks:
        try:
            with Model(model, **model_params({**flags, "no_repack": not repack})) as m:
                out.append((repack, kernel_signature(m, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                                                     flash_attn=cfg.flash_attn, type_k=cfg.cache_type_k,
                                                     type_v=cfg.cache_type_v, swa_full=cfg.swa_full,
                                                     threads=thread_count(cfg))))
        except SpecReplayError:
            out.append((repack, None))
    return out


def probe_key(*, text: str, request: dict | None, indices: Sequence[int], model: str | Path, flags: dict, options,
              libllama: Path | None, variant: str, until_exact: float | None, repack: bool = True,
              decodes: int = DECODES) -> str:
    """What a probe's result depends on, hashed: the transcript's text and request, the witnesses, the
    model file and the variant's library (by path, size and mtime), the flags, the options that change
    what a witness evaluates to (PROBE_OPTIONS: not the tolerance, the output or the prefix reuse,
    which is exact), the decode count and the repack. recover and trace, and a second run with other
    output options, share their probes."""
    parts = {"text": hashlib.sha256(text.encode()).hexdigest(), "request": request, "indices": list(indices),
             "model": file_id(Path(model)),
             "flags": {k: repr(v) for k, v in sorted(flags.items()) if k not in THREAD_FLAGS + ("no_repack",)},
             "options": {f: repr(getattr(options, f, None)) for f in PROBE_OPTIONS}, "until": until_exact,
             "decodes": decodes, "lib": lib_files(libllama, variant), "variant": variant, "repack": repack}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class ProbeCache:
    """Probe results kept under the cache root (kernels/<key>.json): a transcript recovered or traced
    again, unchanged, with the same model, library and options, is not probed again. A result that
    is not whole (an error) is not kept. Beside them, each candidate's class (commands/kernel_classes.py,
    kernels/class-<key>): another transcript of the same model probes one candidate of each class."""

    def __init__(self, root: Path | None):
        self.root = root

    def get(self, key: str) -> Probe | None:
        if self.root is None:
            return None
        try:
            d = json.loads((self.root / f"{key}.json").read_text())
            return Probe(d["variant"], d["diff"], d.get("error"), d.get("record"),
                         tuple(d["decode"]) if d.get("decode") is not None else None, bool(d.get("repack", True)))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, probe: Probe) -> None:
        if self.root is None or probe.diff is None:
            return
        self._write(f"{key}.json", json.dumps({**asdict(probe), "same": []}))

    def klass(self, key: str) -> str | None:
        if self.root is None:
            return None
        try:
            return (self.root / f"class-{key}").read_text().strip() or None
        except OSError:
            return None

    def put_class(self, key: str, sig: str) -> None:
        if self.root is not None:
            self._write(f"class-{key}", sig)

    def _write(self, name: str, text: str) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{name}.{os.getpid()}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.root / name)
        except OSError:  # a read-only cache is no error: the probe is run again next time
            pass


def default_cache() -> ProbeCache:
    """The probe cache under SPEC_REPLAY_CACHE (or ~/.cache/spec-replay); off with SPEC_REPLAY_PROBE_CACHE=0."""
    from replay.paths import cache_root
    return ProbeCache(None if os.environ.get("SPEC_REPLAY_PROBE_CACHE") == "0" else cache_root() / "kernels")


def _context():
    """Fresh processes forked from a server process that has imported the probe's modules but loaded no
    libllama (a process holds one ggml: each probe needs its own): a probe starts in milliseconds, not
    the half second a spawned interpreter takes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["replay.commands.recover", "replay.commands.probe"])
    return ctx


def _in_child(libllama: Path | None, variant: str, fn: Callable, args: tuple, failed: Callable[[], list]):
    """`fn(*args)` in a process of its own that loads `variant`; `failed()` when that process dies."""
    try:
        with cf.ProcessPoolExecutor(1, mp_context=_context(), initializer=_child_init,
                                    initargs=(str(libllama) if libllama else None, variant)) as pool:
            return pool.submit(fn, *args).result()
    except cf.process.BrokenProcessPool:
        return failed()


def parallel_probes(n_tasks: int) -> tuple[int, int | None]:
    """(probes run at once, threads each): one per core (at most 4), each on one thread, since a CPU
    backend's values do not depend on its thread count (tests/test_workers.py); one probe on every core
    when there is one to run or one core.

    >>> parallel_probes(1), parallel_probes(0)
    ((1, None), (1, None))
    """
    cores = os.cpu_count() or 1
    at_once = max(1, min(n_tasks, cores, 4))
    return at_once, (None if at_once == 1 else max(1, cores // at_once))


class _Prober:
    """One transcript's probing: its text, witnesses, model and library, run in processes of their own."""

    def __init__(self, *, text: str, source: str, request: dict | None, indices: Sequence[int], model: str | Path,
                 flags: dict, options, libllama: Path | None, until_exact: float | None, cache: ProbeCache | None,
                 context: dict | None):
        self.text, self.source, self.request, self.indices = text, source, request, list(indices)
        self.model, self.flags, self.options, self.libllama = str(model), flags, options, libllama
        self.until_exact, self.cache, self.context = until_exact, cache, context or {}

    def class_key(self, c: Candidate) -> str:
        return signature_key(model=self.model, libllama=self.libllama, candidate=c, context=self.context)

    def witness(self, cands: Sequence[Candidate], same: dict[Candidate, tuple[str, ...]],
                progress: Callable[[str, Probe], None] | None,
                decodes: int = DECODES) -> tuple[list[Probe], list[Witnessed]]:
        """Probe every candidate of `cands` on the witnesses and the `decodes` tokens after each, a process
        per variant, parallel_probes of them at a time. With several witnesses, in waves: once a candidate
        matched one within until_exact, the waves after it evaluate that one only."""
        variants = list(dict.fromkeys(c.variant for c in cands))
        at_once, threads = parallel_probes(len(variants))
        flags = dict(self.flags) if threads is None else {**self.flags, "threads": threads}
        probes: dict[Candidate, Probe] = {}
        seen: list[Witnessed] = []
        indices = self.indices
        waves = [variants[k:k + at_once] for k in range(0, len(variants), at_once)] if len(indices) > 1 \
            else [variants]  # one witness: nothing to narrow, so no process waits for another's wave
        with cf.ThreadPoolExecutor(at_once) as pool:
            for wave in waves:
                exact = [p for p in probes.values() if self.until_exact is not None and p.diff is not None
                         and p.diff <= self.until_exact]
                if exact:
                    indices = [exact[0].record]
                jobs = {}
                for v in wave:
                    mine = [c for c in cands if c.variant == v]
                    keys = {c: self._key(indices, c, decodes) for c in mine}
                    kept = {c: self.cache.get(keys[c]) for c in mine} if self.cache is not None else {}
                    todo = [c for c in mine if kept.get(c) is None]
                    args = (self.text, self.source, self.request, list(indices), self.model, flags, self.options, v,
                            self.until_exact, [c.repack for c in todo], decodes)
                    fail = (lambda todo=todo, indices=indices: [Outcome(indices[0], c.repack,
                                                                        error="the worker process died") for c in todo])
                    jobs[v] = (mine, keys, kept, pool.submit(_in_child, self.libllama, v, _child_probe, args, fail)
                               if todo else None)
                for v in wave:
                    mine, keys, kept, future = jobs[v]
                    got: list[Outcome] = future.result() if future is not None else []
                    for c in mine:
                        probe, w = _probe_of(c, [g for g in got if g.repack == c.repack], kept.get(c),
                                             same.get(c, ()), indices)
                        probes[c] = probe
                        seen.append(w)
                        if kept.get(c) is None and self.cache is not None:
                            self.cache.put(keys[c], probe)
                        if progress is not None:
                            progress(c.label, probe)
        return [probes[c] for c in cands], seen

    def signatures(self, groups: Sequence[Sequence[Candidate]]) -> dict[Candidate, str | None]:
        """The kernel signatures of the members of `groups` (a process per variant, in waves)."""
        members = [c for g in groups for c in g]
        variants = list(dict.fromkeys(c.variant for c in members))
        at_once, threads = parallel_probes(len(variants))
        flags = dict(self.flags) if threads is None else {**self.flags, "threads": threads}
        out: dict[Candidate, str | None] = {}
        with cf.ThreadPoolExecutor(at_once) as pool:
            futures = {v: pool.submit(_in_child, self.libllama, v, _child_signatures,
                                      (self.text, self.source, self.request, self.indices[0], self.model, flags, v,
                                       [c.repack for c in members if c.variant == v]),
                                      lambda v=v: [(c.repack, None) for c in members if c.variant == v])
                       for v in variants}
            for v, f in futures.items():
                for repack, sig in f.result():
                    out[Candidate(v, repack)] = sig
        return out

    def _key(self, indices: Sequence[int], c: Candidate, decodes: int) -> str:
        return probe_key(text=self.text, request=self.request, indices=indices, model=self.model, flags=self.flags,
                         options=self.options, libllama=self.libllama, variant=c.variant,
                         until_exact=self.until_exact, repack=c.repack, decodes=decodes)


def probe_variants(candidates: Sequence[Candidate | str], *, text: str, source: str, request: dict | None,
                   indices: Sequence[int], model: str | Path, flags: dict, options, libllama: Path | None,
                   progress: Callable[[str, Probe], None] | None = None, until_exact: float | None = None,
                   cache: ProbeCache | None = None, context: dict | None = None) -> list[Probe]:
    """Evaluate the first entries of records `indices` (witnesses, best first) under each candidate
    (a CPU variant, with or without extra buffer types), one process per variant, one per core at a
    time (parallel_probes), its repack modes in turn. With `until_exact`, a candidate's witnesses are
    evaluated until one is within it, and once one has such a witness the candidates probed after it
    evaluate that witness only: every class is probed, since the ones that equal the server's on it
    must also be told apart by their one-token decodes (Probe.decode).

    When this model's classes are known (commands/kernel_classes.py, kept in `cache` per host, model,
    library and the kernel-choosing `context` settings), only the first candidate of each class is
    probed and its Probe names the others (`same`). Otherwise every candidate is, and the classes are
    learnt from the probes: kernel signatures are computed for the candidates whose witness values
    came out alike. A worker that dies is that candidate's error."""
    cands = [c if isinstance(c, Candidate) else Candidate(c) for c in candidates]
    if cache is not None and cache.root is None:  # SPEC_REPLAY_PROBE_CACHE=0: nothing kept, so nothing learnt
        cache = None
    prober = _Prober(text=text, source=source, request=request, indices=indices, model=model, flags=flags,
                     options=options, libllama=libllama, until_exact=until_exact, cache=cache, context=context)
    grouped = classes(cands, lambda c: cache.klass(prober.class_key(c))) if cache is not None else None
    if grouped is not None:
        # one candidate per class, on the first entry alone; the one-token decodes after it only where two
        # classes reproduce it exactly and must be told apart (commands/kernel_choice.py)
        reps = representatives(grouped)
        same = {r: tuple(c.label for c in g if c != r) for r, g in zip(reps, grouped)}
        probes, _ = prober.witness(reps, same, progress, decodes=0)
        exact = [c for c, p in zip(reps, probes) if until_exact is not None and p.diff is not None
                 and p.diff <= until_exact]
        if len(exact) > 1:
            again, _ = prober.witness(exact, same, None)
            told = dict(zip(exact, again))
            probes = [told.get(c, p) for c, p in zip(reps, probes)]
        return probes
    probes, seen = prober.witness(cands, {}, progress)
    if cache is not None and len(indices) == 1:  # every candidate computed the same witness: comparable
        alike = undecided(seen)
        for c, sig in learnt(seen, prober.signatures(alike) if alike else {}).items():
            cache.put_class(prober.class_key(c), sig)
    return fold_twins(probes, seen)


def fold_twins(probes: Sequence[Probe], seen: Sequence[Witnessed]) -> list[Probe]:
    """The probes with each twin by construction (a variant without repack whose weights took no extra
    buffer type with it: the same computation) named in its twin's `same` instead of standing alone.

    >>> from replay.commands.kernel_classes import Candidate
    >>> ps = [Probe("x64", 0.0, record=0), Probe("x64", 0.0, record=0, repack=False)]
    >>> w = [Witnessed(Candidate("x64"), 0, (-1.0,), ()), Witnessed(Candidate("x64", False), 0, (-1.0,), (), "x64")]
    >>> [(p.label, p.same) for p in fold_twins(ps, w)]
    [('x64', ('x64 --no-repack',))]
    """
    twins: dict[str, list[str]] = {}
    for w in seen:
        if w.twin_of is not None:
            twins.setdefault(w.twin_of, []).append(w.candidate.label)
    folded = {x for xs in twins.values() for x in xs}
    return [replace(p, same=(*p.same, *twins.get(p.label, ()))) for p in probes if p.label not in folded]


def _probe_of(c: Candidate, got: list[Outcome], kept: Probe | None, same: tuple[str, ...],
              indices: Sequence[int]) -> tuple[Probe, Witnessed]:
    """A candidate's Probe (the one kept, else the best of its outcomes: the smallest distance over the
    witnesses evaluated, else its errors) and what it computed, for learning classes."""
    if kept is not None:
        return replace(kept, same=same), Witnessed(c, None, None, None)
    measured = [o for o in got if o.diff is not None]
    if not measured:
        errors = "; ".join(dict.fromkeys(o.error for o in got if o.error)) or "no result"
        return (Probe(c.variant, None, errors, record=got[0].record if got else indices[0], repack=c.repack),
                Witnessed(c, None, None, None))
    best = min(measured, key=lambda o: (o.diff, o.record))
    twin = Candidate(c.variant, True).label if best.twin else None
    return (Probe(c.variant, best.diff, record=best.record, decode=best.decode, repack=c.repack, same=same),
            Witnessed(c, best.record, best.values, best.decode, twin))
