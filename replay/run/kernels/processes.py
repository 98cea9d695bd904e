"""Evaluate a transcript's first real entry under each CPU variant this host runs.

The first entry of every response is computed for real, in the prompt batch, by whatever kernels the
server's ggml loaded (tools/server/server-context.cpp: the first token is sampled outside the
speculative loop, its probabilities taken from the prompt's last logits). Evaluating that one prompt
under each variant of a release-style libllama tells which kernels computed it: on quantized weights
the variants fall into a few classes whose values differ by 1e-3 to 0.1 nats, and the server's class
reproduces the entry to the last bit.

A process holds one ggml, so each variant is evaluated in a fresh process that is told its library and
variant when it starts (runtime/binding.py: use_libllama, use_cpu_variant); it recovers only the prompt
and the first 1 + DECODES tokens (RecoverOptions.only_entries): the first to compare with the server's,
the others, each computed in a one-token decode, as the variant's decode signature (Probe). What travels
is one ProbeJob (the run's inputs as their text, the flags, the options, the library) and the witnesses'
positions, as for `recover --workers` (scale/worker.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from replay.errors import SpecReplayError
from replay.run.kernels.cache import ProbeCache, probe_key
from replay.run.kernels.classes import classes, learnt, representatives, signature_key, undecided
from replay.run.kernels.choice import EXACT, batch_alone, needless_slow
from replay.run.kernels.types import DECODES, Candidate, Outcome, Probe, ProbeJob, Witnessed
from replay.runtime.signature import Signature
from replay.runtime.variants import vectorised
from replay.transcripts.readers import Record


def _child_init(libllama: str | None, variant: str, share: int | None = None) -> None:  # pragma: no cover
    """Tell the probe's own process its library and variant before anything loads one, and its share
    of the cores for batches (probes run side by side)."""
    from replay.runtime import binding
    from replay.settings.config import set_batch_threads
    set_batch_threads(share)
    binding.use_libllama(binding.LibChoice(Path(libllama) if libllama else None, "the probe's"))
    binding.use_cpu_variant(variant)


def _child_probe(job: ProbeJob, indices: Sequence[int], variant: str, exact: float | None, repacks: Sequence[bool],
                 decodes: int = DECODES) -> list[Outcome]:  # pragma: no cover - in the child
    """Each of `repacks` in turn (True first: the model loaded with or without extra buffer types): the
    witnesses' first entries (and the `decodes` tokens after each), until one is within `exact`. Without
    repack after a load with it whose weights took no extra buffer type, the same outcomes again, marked
    twins (the same computation)."""
    from replay.commands.recover import Recoverer
    from replay.runtime.binding import loaded_variant
    try:
        if loaded_variant() != variant:
            return [Outcome(indices[0], r, error=f"loaded {loaded_variant()} instead of {variant}") for r in repacks]
        records = job.inputs.records
    except SpecReplayError as e:
        return [Outcome(indices[0], r, error=str(e)) for r in repacks]
    out: list[Outcome] = []
    took_extra: bool | None = None
    for repack in repacks:
        if not repack and took_extra is False:
            out += [replace(o, repack=False, twin=True) for o in out if o.repack]
            continue
        try:
            r = Recoverer(job.inputs.model, {**job.flags, "no_repack": not repack},
                          replace(job.options, only_entries=1 + decodes))
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
    real = [abs(a - b) for t in later for a, b in t.real_pairs]
    return Outcome(k, repack, max(abs(a - b) for a, b in pairs), values=values, decode=decode,
                   later=max(real) if real else None)


def _child_values(job: ProbeJob, indices: Sequence[int], variant: str,
                  repacks: Sequence[bool]) -> list[tuple[bool, dict[int, tuple[float, ...] | None]]]:  # pragma: no cover
    """Every value recover computes for records `indices` (each token's logprob, then its alternatives'),
    whole records, under `variant` with each of `repacks`: what a bound over candidates that no
    evidence tells apart is taken from (value_spread). A record that fails is None."""
    from replay.commands.recover import Recoverer
    from replay.runtime.binding import loaded_variant
    out: list[tuple[bool, dict[int, tuple[float, ...] | None]]] = []
    try:
        if loaded_variant() != variant:
            return [(r, {k: None for k in indices}) for r in repacks]
    except SpecReplayError:
        return [(r, {k: None for k in indices}) for r in repacks]
    records = job.inputs.records
    for repack in repacks:
        got: dict[int, tuple[float, ...] | None] = {k: None for k in indices}
        try:
            r = Recoverer(job.inputs.model, {**job.flags, "no_repack": not repack}, job.options, records=records)
        except SpecReplayError:
            out.append((repack, got))
            continue
        try:
            for k in indices:
                try:
                    rep = r.recover(records[k]).report
                except SpecReplayError:
                    continue
                got[k] = tuple(v for t in rep.tokens for v in (t.true_logprob, *(x["logprob"] for x in t.true_top))
                               if v is not None)
        finally:
            r.close()
        out.append((repack, got))
    return out


def value_spread(candidates: Sequence[Candidate], job: ProbeJob, indices: Sequence[int], cache: ProbeCache | None,
                 context: dict | None) -> dict[int, float | None]:
    """{record: the largest difference, over every value recover computes for it, between the candidates'
    kernel classes} (nats): the bound on a record's values when nothing in it tells the kernels apart
    (no real entry). One representative per class (classes.py, learnt from kernel signatures where not
    known), each in a process of its own; without classes (no cache, no signature), every candidate.
    None for a record some class could not recover, or whose classes computed values of other shapes."""
    cands = list(candidates)
    prober = _Prober(job, indices, until_exact=None, cache=cache, context=context)
    reps = cands
    if cache is not None and cache.root is not None:
        grouped = _grouped(prober, cands, cache)
        if grouped is not None:
            reps = representatives(grouped)
    variants = list(dict.fromkeys(c.variant for c in reps))
    at_once, share = parallel_probes(len(variants))
    values: dict[Candidate, dict[int, tuple[float, ...] | None]] = {}
    with cf.ThreadPoolExecutor(at_once) as pool:
        futures = {v: pool.submit(_in_child, job.libllama, v, share, _child_values,
                                  (job, list(indices), v, [c.repack for c in reps if c.variant == v]),
                                  lambda v=v: [(c.repack, {k: None for k in indices}) for c in reps if c.variant == v])
                   for v in variants}
        for v, f in futures.items():
            for repack, got in f.result():
                values[Candidate(v, repack)] = got
    out: dict[int, float | None] = {}
    for k in indices:
        vs = [values.get(c, {}).get(k) for c in reps]
        if any(x is None for x in vs) or len({len(x) for x in vs}) != 1:
            out[k] = None
            continue
        out[k] = max((max(col) - min(col) for col in zip(*vs)), default=0.0)
    return out


def _child_loops(job: ProbeJob, variant: str, repacks: Sequence[bool]
                 ) -> list[tuple[bool, dict[int, str | None]]]:  # pragma: no cover - in the child
    """Each of `repacks` in turn: the server's loop replayed over every record in file order as requests to
    one server (what `spec-replay trace` runs, commands/trace.py), and per record "" where it emitted the
    transcript's tokens with the server's draft totals, why where it parted, None where nothing was
    compared (the loop could not be replayed). What `loop_parted` reads."""
    from replay.commands.trace import Drafts, trace_record
    from replay.commands.trace_state import ServerState
    from replay.runtime.binding import loaded_variant
    from replay.runtime.llama import Model, model_params
    from replay.transcripts.readers import shared_evidence
    records = job.inputs.records
    nothing = {k: None for k in range(len(records))}
    try:
        if loaded_variant() != variant:
            return [(r, dict(nothing)) for r in repacks]
    except SpecReplayError:
        return [(r, dict(nothing)) for r in repacks]
    out: list[tuple[bool, dict[int, str | None]]] = []
    for repack in repacks:
        flags = {**job.flags, "no_repack": not repack}
        got: dict[int, str | None] = dict(nothing)
        try:
            target = Model(job.inputs.model, **model_params(flags))
        except SpecReplayError:
            out.append((repack, got))
            continue
        drafts = Drafts(model_params(flags))
        shared = shared_evidence(records, flags, job.options.shared_batches, cells=False)
        try:
            with ServerState(flags.get("n_parallel")) as state:
                for k, rec in enumerate(records):
                    try:
                        res = trace_record(rec, target, flags=flags, build=job.options.build, source=job.options.source,
                                           slot_state=state.slot(rec), drafts=drafts, renamed=job.inputs.renamed,
                                           shared=shared.get(rec.index))
                    except SpecReplayError:
                        break  # the state the records after it start from is not the server's
                    got[k] = _parting(res)
                    if got[k]:
                        break
        finally:
            target.close()  # the process ends with the probe: its draft models go with it
        out.append((repack, got))
    return out


def _parting(res) -> str | None:
    """What a record's loop replay (a comparison/trace.py TraceResult) found against the transcript: "" the
    same tokens and draft totals, else how it parted; None where nothing was compared."""
    if res.reproduced is None:
        return None
    if res.first_divergence is not None:
        return f"its loop replay emits another token at token {res.first_divergence}"
    if not res.reproduced:
        return (f"its loop replay drafts {res.draft_n} and accepts {res.draft_n_accepted}, the server "
                f"{res.server_draft_n} and {res.server_draft_n_accepted}")
    return ""


def loop_parted(candidates: Sequence[Candidate], job: ProbeJob, cache: ProbeCache | None, context: dict | None
                ) -> tuple[list[list[Candidate]], dict[Candidate, dict[int, str | None]]]:
    """The candidates' kernel classes (classes.py; learnt from kernel signatures where not known; without a
    cache, a class each) and, per class representative, what its replay of the server's loop over the
    records found (_child_loops): the evidence of the emitted tokens and draft totals (choice.py
    told_by_loop), each class in a process of its own."""
    cands = list(candidates)
    groups = [[c] for c in cands]
    if cache is not None and cache.root is not None:
        prober = _Prober(job, [0], until_exact=None, cache=cache, context=context)
        groups = _grouped(prober, cands, cache) or groups
    reps = representatives(groups)
    variants = list(dict.fromkeys(c.variant for c in reps))
    at_once, share = parallel_probes(len(variants))
    n = len(job.inputs.records)
    found: dict[Candidate, dict[int, str | None]] = {}
    with cf.ThreadPoolExecutor(at_once) as pool:
        futures = {v: pool.submit(_in_child, job.libllama, v, share, _child_loops,
                                  (job, v, [c.repack for c in reps if c.variant == v]),
                                  lambda v=v: [(c.repack, {k: None for k in range(n)}) for c in reps if c.variant == v])
                   for v in variants}
        for v, f in futures.items():
            for repack, got in f.result():
                found[Candidate(v, repack)] = got
    return groups, {rep: found.get(rep, {}) for rep in reps}


def _child_signatures(job: ProbeJob, index: int, variant: str, repacks: Sequence[bool],
                      upto: str = "whole") -> list[tuple[bool, Signature | None]]:  # pragma: no cover
    """The model's kernel signature (runtime/signature.py) with and/or without extra buffer types, on
    the context record `index` is replayed with, on this probe's share of the cores: the signature's
    context is too short for the thread-split path (fewer than 512 KV cells), so no thread count changes
    it, and more threads than cores (probes run side by side) make ggml's threads wait on each other.
    Without repack after a load with it whose weights took no extra buffer type, the same signature
    (the same computation, as _child_probe's twins). `upto="prompt"`: the prompt batch's alone."""
    from replay.runtime.binding import loaded_variant
    from replay.runtime.llama import Model, model_params
    from replay.runtime.signature import kernel_signature
    from replay.settings import resolve
    from replay.settings.config import host_cores
    try:
        if loaded_variant() != variant:
            return [(r, None) for r in repacks]
        rec = job.inputs.records[index]
        cfg = resolve("context", flags=job.flags, recorded=rec.flags, props=rec.props)
    except SpecReplayError:
        return [(r, None) for r in repacks]
    out: list[tuple[bool, Signature | None]] = []
    took_extra: bool | None = None
    for repack in sorted(repacks, reverse=True):  # with repack first: its load says whether it changed anything
        if not repack and took_extra is False and out and out[0][1]:
            out.append((False, out[0][1]))  # no weight took an extra buffer type: the same buffers, the same kernels
            continue
        try:
            with Model(job.inputs.model, **model_params({**job.flags, "no_repack": not repack})) as m:
                out.append((repack, kernel_signature(m, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                                                     flash_attn=cfg.flash_attn, type_k=cfg.cache_type_k,
                                                     type_v=cfg.cache_type_v, swa_full=cfg.swa_full,
                                                     threads=host_cores(), upto=upto)))
                if repack:
                    took_extra = bool(m.buffers)
        except SpecReplayError:
            out.append((repack, None))
    return out


_SERVER_START = threading.Lock()


def _context():
    """Fresh processes forked from a server process that has imported the probe's modules but loaded no
    libllama (a process holds one ggml: each probe needs its own): a probe starts in milliseconds, not
    the half second a spawned interpreter takes. The server imports this process's own package: it is
    started here with that package's directory first on its path and no working directory on it
    (PYTHONSAFEPATH), as `python -c` would otherwise put one there first, and a run started in a
    directory holding another `replay` (a clone at another commit) would probe with that code."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["replay.commands.recover", "replay.run.kernels.processes"])
    with _SERVER_START:
        from multiprocessing import forkserver
        root = str(Path(__file__).resolve().parents[3])
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [saved["PYTHONPATH"]])])
        os.environ["PYTHONSAFEPATH"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx


def start_probe_server() -> None:
    """Start the probes' server now, while this process has loaded no libllama (what it forks from holds
    no ggml), for a run that loads one before it may need probes (policy.py: the best class tried)."""
    _context()


def _in_child(libllama: Path | None, variant: str, share: int | None, fn: Callable, args: tuple,
              failed: Callable[[], list]):
    """`fn(*args)` in a process of its own that loads `variant`, its batches on `share` cores (None: all;
    its one-token decodes keep the server's -t); `failed()` when that process dies."""
    try:
        with cf.ProcessPoolExecutor(1, mp_context=_context(), initializer=_child_init,
                                    initargs=(str(libllama) if libllama else None, variant, share)) as pool:
            return pool.submit(fn, *args).result()
    except cf.process.BrokenProcessPool:
        return failed()


def parallel_probes(n_tasks: int) -> tuple[int, int | None]:
    """(probes run at once, threads each): one per core (at most 4), each with its share of the cores
    (the speed of its batches; its one-token decodes keep the server's -t); one probe on every core
    when there is one to run or one core.

    >>> parallel_probes(1), parallel_probes(0)
    ((1, None), (1, None))
    """
    cores = os.cpu_count() or 1
    at_once = max(1, min(n_tasks, cores, 4))
    return at_once, (None if at_once == 1 else max(1, cores // at_once))


class _Prober:
    """One transcript's probing: its job and witnesses, run in processes of their own."""

    def __init__(self, job: ProbeJob, indices: Sequence[int], *, until_exact: float | None,
                 cache: ProbeCache | None, context: dict | None):
        self.job, self.indices = job, list(indices)
        self.until_exact, self.cache, self.context = until_exact, cache, context or {}

    def class_key(self, c: Candidate) -> str:
        return signature_key(model=self.job.inputs.model, libllama=self.job.libllama, candidate=c, context=self.context)

    def witness(self, cands: Sequence[Candidate], same: dict[Candidate, tuple[str, ...]],
                progress: Callable[[str, Probe], None] | None,
                decodes: int = DECODES) -> tuple[list[Probe], list[Witnessed]]:
        """Probe every candidate of `cands` on the witnesses and the `decodes` tokens after each, a process
        per variant, parallel_probes of them at a time. With several witnesses, in waves: once a candidate
        matched one within until_exact, the waves after it evaluate that one only."""
        variants = list(dict.fromkeys(c.variant for c in cands))
        job = self.job
        at_once, share = parallel_probes(len(variants))
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
                    keys = {c: probe_key(self.job, indices, c, until_exact=self.until_exact, decodes=decodes) for c in mine}
                    kept = {c: self.cache.get(keys[c]) for c in mine} if self.cache is not None else {}
                    todo = [c for c in mine if kept.get(c) is None]
                    args = (job, list(indices), v, self.until_exact, [c.repack for c in todo], decodes)
                    fail = (lambda todo=todo, indices=indices: [Outcome(indices[0], c.repack,
                                                                        error="the worker process died") for c in todo])
                    jobs[v] = (mine, keys, kept, pool.submit(_in_child, self.job.libllama, v, share, _child_probe,
                                                             args, fail) if todo else None)
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

    def signatures(self, groups: Sequence[Sequence[Candidate]], upto: str = "whole") -> dict[Candidate, Signature | None]:
        """The kernel signatures of the members of `groups` (a process per variant, in waves); `upto="prompt"`
        the prompt batch's alone (runtime/signature.py)."""
        members = [c for g in groups for c in g]
        variants = list(dict.fromkeys(c.variant for c in members))
        job = self.job
        at_once, share = parallel_probes(len(variants))
        out: dict[Candidate, str | None] = {}
        with cf.ThreadPoolExecutor(at_once) as pool:
            futures = {v: pool.submit(_in_child, self.job.libllama, v, share, _child_signatures,
                                      (job, self.indices[0], v, [c.repack for c in members if c.variant == v], upto),
                                      lambda v=v: [(c.repack, None) for c in members if c.variant == v])
                       for v in variants}
            for v, f in futures.items():
                for repack, sig in f.result():
                    out[Candidate(v, repack)] = sig
        return out


def probe_variants(candidates: Sequence[Candidate | str], job: ProbeJob, indices: Sequence[int], *,
                   progress: Callable[[str, Probe], None] | None = None, until_exact: float | None = None,
                   cache: ProbeCache | None = None, context: dict | None = None) -> list[Probe]:
    """Evaluate the first entries of records `indices` (witnesses, best first) under each candidate
    (a CPU variant, with or without extra buffer types), one process per variant, one per core at a
    time (parallel_probes), its repack modes in turn. With `until_exact`, a candidate's witnesses are
    evaluated until one is within it, and once one has such a witness the candidates probed after it
    evaluate that witness only: every class is probed, since the ones that equal the server's on it
    must also be told apart by their one-token decodes (Probe.decode).

    With a `cache`, only the first candidate of each class (classes.py, kept per host, model, library
    and the kernel-choosing `context` settings) is probed and its Probe names the others (`same`);
    classes not known yet are learnt first, from the vector candidates' kernel signatures (`_learn_classes`:
    a short fixed run, whatever the prompt's length); the classes without vector kernels are learnt and
    probed only where the others leave the entry open (`_probe_classes`). Without one (SPEC_REPLAY_PROBE_CACHE=0), or when
    no signature could be computed, every candidate is probed, and with a cache the classes are
    learnt from the probes: kernel signatures for the candidates whose witness values came out alike.
    A worker that dies is that candidate's error."""
    cands = [c if isinstance(c, Candidate) else Candidate(c) for c in candidates]
    if cache is not None and cache.root is None:  # SPEC_REPLAY_PROBE_CACHE=0: nothing kept, so nothing learnt
        cache = None
    prober = _Prober(job, indices, until_exact=until_exact, cache=cache, context=context)
    if cache is not None:
        probes = _probe_classes(prober, cands, cache, progress, until_exact)
        if probes is not None:
            return probes
    probes, seen = prober.witness(cands, {}, progress)
    if cache is not None and len(indices) == 1:  # every candidate computed the same witness: comparable
        alike = undecided(seen)
        sigs = prober.signatures(alike) if alike else {}
        for c, sig in learnt(seen, {c: s.whole if s else None for c, s in sigs.items()}).items():
            cache.put_class(prober.class_key(c), sig)
    return fold_twins(probes, seen)


def _by_speed(cands: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(the candidates with vector kernels, the baseline ones: x64, sse42), each in the given order.

    >>> [[c.label for c in g] for g in _by_speed([Candidate("x64"), Candidate("zen4"), Candidate("sse42")])]
    [['zen4'], ['x64', 'sse42']]
    """
    return [c for c in cands if vectorised(c.variant)], [c for c in cands if not vectorised(c.variant)]


def _probe_classes(prober: _Prober, cands: Sequence[Candidate], cache: ProbeCache,
                   progress: Callable[[str, Probe], None] | None, until_exact: float | None) -> list[Probe] | None:
    """One probe per class, on the first entry alone, best first; the one-token decodes after it only
    where two classes reproduce it exactly and must be told apart (choice.py).

    The best class is probed first, alone, on every core: where it reproduces the entry exactly and no
    other class computes batches as it does (choice.py batch_alone, from the kernel signatures of every
    candidate), nothing else is probed, and the others stand as one skipped Probe naming them all.
    Otherwise the other classes with vector kernels are probed; those without (x64, sse42: a tenth of
    the speed) only where the others leave the entry open (choice.py needless_slow). The classes are
    learnt from the vector candidates' signatures; the slow ones' (ten times a vector one's: most of a
    model's first probe) only where batch_alone needs them, once the best class reproduced the entry
    and no other vector class computes batches as it does. None where no signature of the vector
    candidates could be computed (the caller probes every candidate)."""
    fast, slow = _by_speed(cands)
    got: dict[Candidate, Probe] = {}
    if fast:
        grouped = _grouped(prober, fast, cache)
        if grouped is None:
            return None
        reps = representatives(grouped)
        same = {r: tuple(c.label for c in g if c != r) for r, g in zip(reps, grouped)}
        got[reps[0]] = prober.witness(reps[:1], same, progress, decodes=0)[0][0]
        rest = reps[1:] + slow
        lead = cache.batch(prober.class_key(reps[0]))
        others = [c for c in fast if c != reps[0] and c.label not in same[reps[0]]]
        batches = [cache.batch(prober.class_key(c)) for c in others]
        why = batch_alone(got[reps[0]], lead, batches, until_exact) if rest and until_exact is not None else None
        if why and slow:
            why = _slow_apart(prober, reps[0], got[reps[0]], slow, cache, until_exact)
        if why:
            names = [x for c in rest for x in (c.label, *same.get(c, ()))]
            got[rest[0]] = Probe(rest[0].variant, None, record=got[reps[0]].record, repack=rest[0].repack,
                                 same=tuple(dict.fromkeys(n for n in names if n != rest[0].label)), skipped=why)
            return list(got.values())
        if reps[1:]:
            got.update(zip(reps[1:], prober.witness(reps[1:], same, progress, decodes=0)[0]))
    why = needless_slow(list(got.values()), until_exact) if until_exact is not None and fast and slow else None
    if why:  # unless a slow variant is known to compute batches as the exact class does: its entry is that one too
        hit = next(prober.class_key(c) for c, p in got.items() if p.diff is not None and p.diff <= until_exact)
        for known in (cache.batch, cache.prompt):
            if known(hit) is not None and any(known(prober.class_key(c)) == known(hit) for c in slow):
                why = None
    if why:
        first = next(p.record for p in got.values() if p.diff is not None and p.diff <= until_exact)
        got[slow[0]] = Probe(slow[0].variant, None, record=first, repack=slow[0].repack,
                             same=tuple(c.label for c in slow[1:]), skipped=why)
    elif slow:
        part = _by_class(prober, slow, cache, progress)
        got.update(part if part is not None else zip(slow, prober.witness(slow, {}, progress, decodes=0)[0]))
    exact = [c for c, p in got.items() if until_exact is not None and p.diff is not None and p.diff <= until_exact]
    if len(exact) > 1:
        again, _ = prober.witness(exact, {c: got[c].same for c in exact}, None)
        got.update(zip(exact, again))
    return list(got.values())


@dataclass(frozen=True)
class Settling:
    """The best class, where the kernel signatures alone say its probe would settle the first entry:
    `lead` (its probe's `key` in the cache), the members of its class (`same`), every other candidate
    (`others`) and why they need no probe if it reproduces the entry (choice.py batch_alone)."""

    lead: Candidate
    key: str
    same: tuple[str, ...]
    others: tuple[str, ...]
    why: str


def best_settles(candidates: Sequence[Candidate], job: ProbeJob, index: int, cache: ProbeCache,
                 context: dict) -> Settling | None:
    """The best class's Settling, where record `index`'s first entry alone would settle the kernels on it:
    every vector candidate's class and batch signature known (cache) and every baseline one's prompt
    signature, the best's batch signature its class's own and its prompt signature none of the baseline
    ones', and no probe of it on this transcript kept (a kept one settles it at no cost). None otherwise."""
    fast, slow = _by_speed(candidates)
    if cache.root is None or not fast:
        return None
    prober = _Prober(job, [index], until_exact=EXACT, cache=cache, context=context)
    grouped = classes(fast, lambda c: cache.klass(prober.class_key(c)))
    if grouped is None:
        return None
    lead = representatives(grouped)[0]
    same = tuple(c.label for c in grouped[0] if c != lead)
    rest = [c for g in grouped[1:] for c in g]
    exact = Probe(lead.variant, 0.0, record=index, repack=lead.repack)
    why = batch_alone(exact, cache.batch(prober.class_key(lead)), [cache.batch(prober.class_key(c)) for c in rest])
    if why and slow and batch_alone(exact, cache.prompt(prober.class_key(lead)),
                                    [cache.prompt(prober.class_key(c)) for c in slow]) is None:
        why = None
    rest += slow
    key = probe_key(job, [index], lead, until_exact=EXACT, decodes=0)
    if why is None or cache.get(key) is not None:
        return None
    return Settling(lead, key, same, tuple(c.label for c in rest), why)


def classes_known(candidates: Sequence[Candidate], job: ProbeJob, index: int, cache: ProbeCache,
                  context: dict) -> bool:
    """Are the vector candidates' kernel classes known (cache), so that probing need not learn them first
    from every candidate's kernel signature (a process per variant: tens of seconds on a 262k
    vocabulary, once per model, library and kernel-choosing context settings)?"""
    fast, _ = _by_speed(candidates)
    if cache.root is None or not fast:
        return True  # nothing is learnt: with the cache off every candidate is probed
    prober = _Prober(job, [index], until_exact=EXACT, cache=cache, context=context)
    return classes(fast, lambda c: cache.klass(prober.class_key(c))) is not None


def _slow_apart(prober: _Prober, lead: Candidate, probe: Probe, slow: Sequence[Candidate], cache: ProbeCache,
                exact: float) -> str | None:
    """batch_alone over the baseline variants (`slow`), by their prompt signatures (learnt now where not
    known: only this rule needs them, and a prompt batch is what a first entry is computed in): why
    `lead`'s exact `probe` leaves them unprobed, or None."""
    if any(cache.prompt(prober.class_key(c)) is None for c in slow):
        for c, sig in prober.signatures([slow], upto="prompt").items():
            if sig is not None:
                cache.put_prompt(prober.class_key(c), sig.prompt)
    return batch_alone(probe, cache.prompt(prober.class_key(lead)), [cache.prompt(prober.class_key(c)) for c in slow],
                       exact)


def _grouped(prober: _Prober, cands: Sequence[Candidate], cache: ProbeCache) -> list[list[Candidate]] | None:
    """`cands`' classes, known, else learnt from their kernel signatures (their batch signatures kept for
    batch_alone); None where no signature of `cands` could be computed."""
    known = classes(cands, lambda c: cache.klass(prober.class_key(c)))
    if known is not None:
        return known
    return _learn_classes(prober, list(cands), cache)


def _by_class(prober: _Prober, cands: Sequence[Candidate], cache: ProbeCache,
              progress: Callable[[str, Probe], None] | None) -> dict[Candidate, Probe] | None:
    """{class representative: its probe of the first entry alone} over `cands`' classes (known, else learnt
    from their kernel signatures first); None where no signature could be computed."""
    grouped = _grouped(prober, cands, cache)
    if grouped is None:
        return None
    reps = representatives(grouped)
    same = {r: tuple(c.label for c in g if c != r) for r, g in zip(reps, grouped)}
    return dict(zip(reps, prober.witness(reps, same, progress, decodes=0)[0]))


def _learn_classes(prober: _Prober, cands: Sequence[Candidate], cache: ProbeCache) -> list[list[Candidate]] | None:
    """This model's classes, learnt before any witness: every candidate's kernel signature (a fixed run of
    170 tokens, runtime/signature.py), kept in `cache` with its batch signature, so that a transcript's
    prompt, however long, is evaluated once per class instead of once per candidate. A candidate whose
    signature could not be computed (its process died, its variant did not load) is a class of its own,
    not kept: its probe says why. None when no signature could be computed."""
    sigs = prober.signatures([cands])
    known = [c for c in cands if sigs.get(c)]
    if not known:
        return None
    for c in known:
        cache.put_class(prober.class_key(c), f"signature:{sigs[c].whole}")
        cache.put_batch(prober.class_key(c), sigs[c].batches)
        cache.put_prompt(prober.class_key(c), sigs[c].prompt)
    groups = classes(known, lambda c: sigs[c].whole) + [[c] for c in cands if not sigs.get(c)]
    return sorted(groups, key=lambda g: cands.index(g[0]))


def fold_twins(probes: Sequence[Probe], seen: Sequence[Witnessed]) -> list[Probe]:
    """The probes with each twin by construction (a variant without repack whose weights took no extra
    buffer type with it: the same computation) named in its twin's `same` instead of standing alone.

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
    return (Probe(c.variant, best.diff, record=best.record, decode=best.decode, repack=c.repack, same=same,
                  later=best.later),
            Witnessed(c, best.record, best.values, best.decode, twin))
