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


@dataclass(frozen=True)
class Candidate:
    """Kernels a transcript may have been computed with: a CPU variant, with or without extra buffer
    types (llama-server's --no-repack)."""

    variant: str
    repack: bool = True

    @property
    def label(self) -> str:
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


Outcome = tuple  # (record, diff | None, error | None, decode signature | None, repack, kernel signature | None)


def _child_probe(text: str, source: str, request: dict | None, indices: Sequence[int], model: str, flags: dict,
                 options, variant: str, exact: float | None, repacks: Sequence[bool],
                 signatures: Sequence[bool]) -> list[Outcome]:  # pragma: no cover - in the child
    """Each of `repacks` in turn (the model loaded with or without extra buffer types): the witnesses'
    first entries (until one is within `exact`) and, where `signatures` asks, the model's kernel
    signature on the first witness's context."""
    from replay.commands.recover import Recoverer
    from replay.runtime.binding import loaded_variant
    from replay.transcripts.readers import read_text
    try:
        if loaded_variant() != variant:
            return [(indices[0], None, f"loaded {loaded_variant()} instead of {variant}", None, r, None) for r in repacks]
        records = read_text(text, source, request)
    except SpecReplayError as e:
        return [(indices[0], None, str(e), None, r, None) for r in repacks]
    out: list[Outcome] = []
    for repack, want_sig in zip(repacks, signatures):
        try:
            r = Recoverer(model, {**flags, "no_repack": not repack}, replace(options, only_entries=1 + DECODES))
        except SpecReplayError as e:
            out.append((indices[0], None, str(e), None, repack, None))
            continue
        try:
            sig = _signature(r, records[indices[0]]) if want_sig else None
            for k in indices:
                try:
                    rep = r.recover(records[k]).report
                except SpecReplayError as e:
                    out.append((k, None, str(e), None, repack, sig))
                    continue
                pairs = rep.tokens[0].real_pairs if rep.tokens else ()
                if not pairs:
                    out.append((k, None, rep.error or "the first entry carries no real value to compare", None,
                                repack, sig))
                    continue
                later = [t for t in rep.tokens[1:] if t.true_logprob is not None]
                decode = tuple(v for t in later for v in (t.true_logprob, *(x["logprob"] for x in t.true_top))) or None
                out.append((k, max(abs(a - b) for a, b in pairs), None, decode, repack, sig))
                if exact is not None and out[-1][1] <= exact:
                    break
        finally:
            r.close()
    return out


def _signature(r, rec: Record) -> str | None:  # pragma: no cover - in the child
    """The model's kernel signature on the context `rec` is replayed with (runtime/signature.py)."""
    from replay.runtime.signature import kernel_signature
    from replay.settings import resolve
    from replay.settings.config import thread_count
    cfg = resolve("context", flags=r.flags, recorded=rec.flags, props=rec.props)
    try:
        return kernel_signature(r.model, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch, flash_attn=cfg.flash_attn,
                                type_k=cfg.cache_type_k, type_v=cfg.cache_type_v, swa_full=cfg.swa_full,
                                threads=thread_count(cfg))
    except SpecReplayError:
        return None


def _file_id(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _lib_files(lib: Path | None, variant: str) -> list | None:
    """The library's files a variant computes with (its own CPU backend, not the other variants')."""
    from replay.runtime.variants import PREFIX
    if lib is None:
        return None
    return [_file_id(f) for f in sorted(Path(lib).glob("lib*.so*"))
            if f.is_file() and (not f.name.startswith(PREFIX) or f.name.startswith(f"{PREFIX}{variant}."))]


def probe_key(*, text: str, request: dict | None, indices: Sequence[int], model: str | Path, flags: dict, options,
              libllama: Path | None, variant: str, until_exact: float | None, repack: bool = True) -> str:
    """What a probe's result depends on, hashed: the transcript's text and request, the witnesses, the
    model file and the variant's library (by path, size and mtime), the flags, the options that change
    what a witness evaluates to (PROBE_OPTIONS: not the tolerance, the output or the prefix reuse,
    which is exact), the decode count and the repack. recover and trace, and a second run with other
    output options, share their probes."""
    parts = {"text": hashlib.sha256(text.encode()).hexdigest(), "request": request, "indices": list(indices),
             "model": _file_id(Path(model)),
             "flags": {k: repr(v) for k, v in sorted(flags.items()) if k not in THREAD_FLAGS + ("no_repack",)},
             "options": {f: repr(getattr(options, f, None)) for f in PROBE_OPTIONS}, "until": until_exact,
             "decodes": DECODES, "lib": _lib_files(libllama, variant), "variant": variant, "repack": repack}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def signature_key(*, model: str | Path, libllama: Path | None, variant: str, repack: bool, context: dict) -> str:
    """What a model's kernel signature depends on: this host, the model file, the variant's library
    files, the repack, and the context settings that choose kernels (`context`); not the transcript."""
    from replay.runtime.health import host_identity
    from replay.runtime.signature import VERSION
    parts = {"host": host_identity(), "model": _file_id(Path(model)), "lib": _lib_files(libllama, variant),
             "variant": variant, "repack": repack, "context": context, "version": VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# the context settings that choose kernels, by attr (runtime/signature.py)
SIGNATURE_CONTEXT = ("n_batch", "n_ubatch", "flash_attn", "cache_type_k", "cache_type_v", "swa_full")


class ProbeCache:
    """Probe results kept under the cache root (kernels/<key>.json): a transcript recovered or traced
    again, unchanged, with the same model, library and options, is not probed again. A result that
    is not whole (an error) is not kept. Kernel signatures are kept beside them (kernels/sig-<key>),
    per host, model, library, variant and repack: another transcript of the same model probes one
    candidate of each class of equal signatures."""

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

    def signature(self, key: str) -> str | None:
        if self.root is None:
            return None
        try:
            return (self.root / f"sig-{key}").read_text().strip() or None
        except OSError:
            return None

    def put_signature(self, key: str, sig: str | None) -> None:
        if self.root is not None and sig:
            self._write(f"sig-{key}", sig)

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


def classes(candidates: Sequence[Candidate], signature: Callable[[Candidate], str | None]
            ) -> list[list[Candidate]] | None:
    """The candidates grouped by equal kernel signature, best first within and between groups, or None
    when one's signature is not known (then every candidate is probed).

    >>> cs = [Candidate("zen4"), Candidate("zen4", False), Candidate("icelake"), Candidate("icelake", False)]
    >>> sig = {"zen4": "a", "zen4 --no-repack": "b", "icelake": "a", "icelake --no-repack": "b"}
    >>> [[c.label for c in g] for g in classes(cs, lambda c: sig[c.label])]
    [['zen4', 'icelake'], ['zen4 --no-repack', 'icelake --no-repack']]
    >>> classes(cs, lambda c: None) is None
    True
    """
    groups: dict[str, list[Candidate]] = {}
    for c in candidates:
        sig = signature(c)
        if sig is None:
            return None
        groups.setdefault(sig, []).append(c)
    return list(groups.values())


def probe_variants(candidates: Sequence[Candidate | str], *, text: str, source: str, request: dict | None,
                   indices: Sequence[int], model: str | Path, flags: dict, options, libllama: Path | None,
                   progress: Callable[[str, Probe], None] | None = None, until_exact: float | None = None,
                   cache: ProbeCache | None = None, context: dict | None = None) -> list[Probe]:
    """Evaluate the first entries of records `indices` (witnesses, best first) under each candidate
    (a CPU variant, with or without extra buffer types), one spawned process per variant, one after
    another (each uses the machine's cores), its repack modes in turn. With `until_exact`, a
    candidate's witnesses are evaluated until one is within it, and once one has such a witness the
    candidates after it evaluate that witness only: every class is probed, since the ones that equal
    the server's on it must also be told apart by their one-token decodes (Probe.decode).

    Candidates whose kernel signatures (runtime/signature.py, on `context`: the settings that choose
    kernels) are known and equal compute this model bit for bit alike: only the first of each class is
    probed, and its Probe names the others (`same`). Signatures not known yet are computed by the
    probes that run (and kept in `cache`). A worker that dies is that candidate's error."""
    cands = [c if isinstance(c, Candidate) else Candidate(c) for c in candidates]
    sig_keys = {c: signature_key(model=model, libllama=libllama, variant=c.variant, repack=c.repack,
                                 context=context or {}) for c in cands} if cache is not None else {}
    grouped = classes(cands, lambda c: cache.signature(sig_keys[c]) if cache is not None else None)
    reps = [g[0] for g in grouped] if grouped is not None else cands
    same = {g[0]: tuple(c.label for c in g[1:]) for g in grouped} if grouped is not None else {}
    out: list[Probe] = []
    ctx = mp.get_context("spawn")
    by_variant = list(dict.fromkeys(c.variant for c in reps))
    for v in by_variant:
        mine = [c for c in reps if c.variant == v]
        if until_exact is not None and any(p.diff is not None and p.diff <= until_exact for p in out):
            indices = [next(p.record for p in out if p.diff is not None and p.diff <= until_exact)]
        keys = {c: probe_key(text=text, request=request, indices=indices, model=model, flags=flags, options=options,
                             libllama=libllama, variant=v, until_exact=until_exact, repack=c.repack)
                for c in mine} if cache is not None else {}
        kept = {c: cache.get(keys[c]) for c in mine} if cache is not None else {}
        todo = [c for c in mine if kept.get(c) is None or (cache is not None and cache.signature(sig_keys[c]) is None)]
        got: list[Outcome] = []
        if todo:
            try:
                with cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_child_init,
                                            initargs=(str(libllama) if libllama else None, v)) as pool:
                    got = pool.submit(_child_probe, text, source, request, list(indices), str(model), dict(flags),
                                      options, v, until_exact, [c.repack for c in todo],
                                      [cache is not None and cache.signature(sig_keys[c]) is None for c in todo]
                                      ).result()
            except cf.process.BrokenProcessPool:
                got = [(indices[0], None, "the worker process died", None, c.repack, None) for c in todo]
        for c in mine:
            if c not in todo:
                probe = replace(kept[c], same=same.get(c, ()))
            else:
                mine_got = [g for g in got if g[4] == c.repack]
                sig = next((g[5] for g in mine_got if g[5]), None)
                if cache is not None:
                    cache.put_signature(sig_keys[c], sig)
                measured = [(d, k, dsig) for k, d, _, dsig, _, _ in mine_got if d is not None]
                if measured:
                    diff, k, dsig = min(measured, key=lambda m: (m[0], m[1]))
                    probe = Probe(v, diff, record=k, decode=dsig, repack=c.repack, same=same.get(c, ()))
                else:
                    errors = "; ".join(dict.fromkeys(e for _, _, e, _, _, _ in mine_got if e)) or "no result"
                    probe = Probe(v, None, errors, record=(mine_got or [(indices[0],)])[0][0], repack=c.repack)
                if cache is not None:
                    cache.put(keys[c], probe)
            out.append(probe)
            if progress is not None:
                progress(c.label, probe)
    return out
