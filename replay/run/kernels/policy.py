"""Choosing the CPU kernels a run replays on (`--server-cpu`, or probed from the transcript).

It runs once the libllama is chosen (run/engine.py) and before anything loads it, says which variant
and why (through the caller's `say`), and returns the choice for the engine and the report. A libllama
that links one ggml-cpu in (a native build, llama-cpp-python's own) has one set of kernels: nothing is
chosen, and the first entry's strict comparison stays the judge.

The candidates are the variants this CPU runs by its flags that also run on this host
(runtime/health.py: a variant whose kernels crash here is never one, and is named), each with extra
buffer types (llama.cpp's default) or without (`--no-repack`), as far as the command line and the
transcript's recorded server flags leave open.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from replay.commands.recover import RecoverOptions
from replay.errors import KernelsError, TranscriptError, UsageError
from replay.run.inputs import Inputs
from replay.run.kernels.cache import default_cache
from replay.run.kernels.choice import EXACT, choose_variant, exact_apart, records_named, told_by_loop, witnesses
from replay.run.kernels.classes import SIGNATURE_CONTEXT
from replay.run.kernels.processes import (
    Settling,
    best_settles,
    classes_known,
    loop_parted,
    probe_variants,
    start_probe_server,
    value_spread,
)
from replay.run.kernels.types import Candidate, Probe, ProbeJob
from replay.runtime import binding, health
from replay.runtime.engine import KernelChoice, Tried
from replay.runtime.server_cpu import server_variant
from replay.runtime.variants import VARIANTS, host_cpu_flags, runnable, variants_in
from replay.settings import resolve
from replay.settings.table import recorded_where
from replay.transcripts.entries import n_prompt_cached
from replay.transcripts.readers import Record, shared_evidence

Say = Callable[..., None]  # one line of what the choice is doing (stderr on the command line); detail=True: -v only


def _detail(say: Say, line: str) -> None:
    """A line of how the choice is made (each candidate's probe, a class ruled out): shown with -v."""
    say(line, detail=True)


def recorded_repack(records: list[Record]) -> bool | None:
    """Whether the server loaded its model with extra buffer types, as the transcript's recorded server
    flags say (`record` writes --no-repack when it was given); None when no record says. Records that
    disagree cannot be one run's: a TranscriptError.

    >>> recorded_repack([]) is None
    True
    """
    said = {bool(r.flags.get("--no-repack")) for r in records if r.flags and "--no-repack" in r.flags}
    if len(said) > 1:
        raise TranscriptError("some records were recorded from a server started with --no-repack and some without: "
                              "recover them separately")
    return (not said.pop()) if said else None


def repack_modes(flags: dict, records: list[Record]) -> tuple[list[bool], str]:
    """The repack modes a transcript may have been computed with, and where that comes from: the command
    line (-nr), the recorded server flags, else both (probed)."""
    if flags.get("no_repack") is not None:
        return [not flags["no_repack"]], "command line"
    recorded = recorded_repack(records)
    if recorded is not None:  # the block it was read from: server.flags, or a legacy file's server.speculative
        return [recorded], next(recorded_where(r.flags) for r in records if r.flags and "--no-repack" in r.flags)
    return [True, False], "probed"


@dataclass(frozen=True)
class Kernels:
    """What the policy chose: the kernels (None: the library has one CPU backend linked in), the
    repack to load with (None: not chosen, the flags' own) and, where the best class is tried on the
    run itself (`guess`), what its first entry decides (runtime/engine.py Tried)."""

    choice: KernelChoice | None
    repack: bool | None
    tried: Tried | None = None


def _verdicts(bin_dir: Path, names: list[str], say: Say) -> dict[str, health.Health]:
    unknown = [n for n in names if health.health(bin_dir, n, probe=False) is None]
    if unknown:
        _detail(say, f"kernels: checking which CPU variants run on this host ({', '.join(unknown)}), once")
    return health.verdicts(bin_dir, names)


@dataclass(frozen=True)
class Candidates:
    """Stage 1, the candidates: the variants `lib_dir` holds (`present`), those this CPU runs by its flags
    (`can`) and their health verdicts here, the repack modes left open and where that comes from, the
    (variant, repack) pairs that run here best first, llama.cpp's default (extra buffer types) first, and
    the lines on those whose kernels crash here."""

    lib_dir: Path
    present: list[str]
    can: list[str]
    verdicts: dict[str, health.Health]
    modes: list[bool]
    modes_from: str
    pairs: list[Candidate]
    crashes: tuple[str, ...]

    @property
    def beyond(self) -> list[str]:
        """Variants built but beyond this CPU."""
        return [n for n in self.present if n not in self.can]


def candidates_in(lib_dir: Path, present: list[str], modes: list[bool], modes_from: str, say: Say) -> Candidates:
    """The candidates of a release-style libllama's variants (stage 1), each variant's health asked once."""
    can = runnable(present, host_cpu_flags())
    verdicts = _verdicts(lib_dir, can, say)
    crashes = tuple(verdicts[v].describe() for v in can if not all(verdicts[v].runs(m) for m in modes))
    pairs = [Candidate(v, m) for m in modes for v in can if verdicts[v].runs(m)]
    for line in crashes:
        _detail(say, f"kernels: {line}: not a candidate")
    return Candidates(lib_dir, present, can, verdicts, modes, modes_from, pairs, crashes)


def given_variant(server_cpu: str, cands: Candidates) -> KernelChoice:
    """Stage 2, the user's answer: --server-cpu names the kernels, so the repack is llama.cpp's default
    (extra buffer types) unless the command line or the transcript says --no-repack; the first entry's
    comparison judges it as it is recovered. One line where the answer cannot be the server's here."""
    if server_cpu not in cands.present:
        raise KernelsError(f"--server-cpu {server_cpu}: {cands.lib_dir} has no libggml-cpu-{server_cpu}.so")
    if server_cpu not in cands.can:
        raise KernelsError(f"--server-cpu {server_cpu}: this CPU cannot run it (it runs {', '.join(cands.can) or 'none'}); "
                           "recover on a machine that can, or give --server-backend to recover at stated "
                           "precision")
    repack = cands.modes[0]
    if not cands.verdicts[server_cpu].runs(repack):
        raise KernelsError(f"--server-cpu {server_cpu}: {cands.verdicts[server_cpu].describe()}; the transcript needs "
                           "a host that runs its kernels")
    return KernelChoice(server_cpu, "given", repack=repack, crashes=cands.crashes)


def choose_kernels(inputs: Inputs, *, lib_dir: Path | None, flags: dict, options: RecoverOptions,
                   server_cpu: str | None, say: Say, guess: bool = False) -> Kernels:
    """The CPU variant (and repack) to replay on from the release-style libllama in `lib_dir`, as one
    pipeline (run/kernels/__init__.py):

        candidates  what `lib_dir` holds that runs here, with the repack modes left open   candidates_in
        answers     --server-cpu (a variant, or the machine as its user knows it)          given_variant
        evidence    the first real entry of the witnesses under each candidate class, the  _probed
                    later real entries, the loop's tokens and draft totals (processes.py)  (_tried, _by_loop)
        decision    the class that computed them, or a one-line refusal (choice.py)        choose_variant
        numerics    the KernelChoice the report's `numerics.cpu` is (runtime/engine.py)

    A transcript that shows batches shared with other requests (several slots, --shared-batches) is
    probed on several records' first entries; with none exact its kernels are "unknown" and the best
    candidate is used. Otherwise nothing exact is a KernelsError, unless --server-backend allows the
    nearest. `guess` (a caller that can start again on other kernels: cli/recover.py, one record): where
    the kernel signatures alone say the best class's probe would settle it (processes.py best_settles),
    the run itself is that probe, confirmed or sent back here by its first entry (`Kernels.tried`)."""
    present = variants_in(lib_dir) if lib_dir else []
    modes, modes_from = repack_modes(flags, inputs.records)
    if not present:  # a libllama that links one ggml-cpu in: nothing to choose
        if server_cpu:
            raise UsageError(f"--server-cpu {server_cpu}: the libllama in use ({lib_dir or 'llama-cpp-python own'}) "
                             "links one CPU backend in; build a release-style one (spec-replay build) or give "
                             "--libllama a build with libggml-cpu-<variant>.so beside it")
        return Kernels(None, modes[0] if len(modes) == 1 else None)
    if server_cpu is not None and server_cpu not in VARIANTS and server_cpu not in present:
        # the machine as its user knows it (a CPU model, a flags line, llama-server's system_info line)
        read = server_variant(server_cpu)
        say(f"kernels: --server-cpu {server_cpu!r}: a release server there loads {read.variant} ({read.how})")
        server_cpu = read.variant
    loaded, have = binding.variant_in_process()
    if loaded:  # in-process reuse (tests, notebooks): what is loaded stays
        if server_cpu and server_cpu != have:
            raise KernelsError(f"--server-cpu {server_cpu}: this process already computes with the {have} kernels")
        return Kernels(KernelChoice(have, "default", why="already loaded in this process"), None)
    cands = candidates_in(lib_dir, present, modes, modes_from, say)
    job = ProbeJob(inputs, flags, options, lib_dir)
    if server_cpu:
        choice = given_variant(server_cpu, cands)
        modes_from = "default" if modes_from == "probed" else modes_from
    elif not cands.pairs:
        raise KernelsError(f"none of the CPU variants in {lib_dir} runs on this host: " + "; ".join(cands.crashes))
    elif guess and (tried := _tried(job, cands.pairs, cands.crashes)) is not None:
        choice, settling = tried
        say(f"kernels: {VARIANTS[choice.variant].label if choice.variant in VARIANTS else choice.variant}"
            f"{'' if choice.repack else ' --no-repack'}, tried first; record {choice.record + 1}'s first entry "
            "decides as it is recovered")
        say(f"  tried first because {settling.why.split(', and ', 1)[1]}", detail=True)
        return Kernels(choice, choice.repack, Tried(settling.key, choice.record, settling.lead.variant,
                                                    settling.lead.repack))
    else:
        choice = _probed(job, cands.pairs, beyond=cands.beyond, crashes=cands.crashes, say=say)
    repack = f" (repack: {modes_from})" if modes_from != "probed" else ""
    brief, whole = choice.brief(), choice.describe()
    say(f"kernels: {brief}{repack}")
    if brief != whole:
        _detail(say, f"kernels, in full: {whole}{repack}")
    return Kernels(choice, choice.repack)


def _tried(job: ProbeJob, candidates: list[Candidate], crashes: tuple[str, ...]
           ) -> tuple[KernelChoice, Settling] | None:
    """The best class as a "tried" choice, where its probe alone would settle the kernels on the one
    witness of a transcript that shows no shared batches (processes.py best_settles); the probes' server
    started before this process loads it (the run may need the others probed after all). None otherwise."""
    records, options = job.inputs.records, job.options
    if shared_evidence(records, job.flags, options.shared_batches):
        return None
    ks = witnesses(records)
    if len(ks) != 1:
        return None
    rec = records[ks[0]]
    ctx = resolve("context", flags=job.flags, recorded=rec.flags, props=rec.props)
    settling = best_settles(candidates, job, ks[0], default_cache(), {a: getattr(ctx, a) for a in SIGNATURE_CONTEXT})
    if settling is None:
        return None
    start_probe_server()
    lead = settling.lead
    return KernelChoice(lead.variant, "tried", record=ks[0], equal=settling.same, repack=lead.repack,
                        crashes=crashes, unprobed=settling.others, why_unprobed=settling.why), settling


def _by_loop(job: ProbeJob, candidates: list[Candidate], *, shared: str | None, crashes: tuple[str, ...],
             say: Say) -> KernelChoice:
    """No record carries a real first entry: the classes are told apart by the emitted tokens and draft
    totals, each class's replay of the server's loop over the records (processes.py loop_parted, choice.py
    told_by_loop), unless batches were shared with requests the transcript does not hold (their loop is not
    the records' own). One class left: it computed them. Several: the values are approximate, bounded by
    how far the classes left compute each record apart (processes.py value_spread), computed, not assumed."""
    records = job.inputs.records
    rec = records[0]
    ctx = resolve("context", flags=job.flags, recorded=rec.flags, props=rec.props)
    cache, context = default_cache(), {a: getattr(ctx, a) for a in SIGNATURE_CONTEXT}
    why = "no record carries a real first entry to tell the kernels by"
    left, parted = candidates, {}
    if shared is None:
        _detail(say, f"kernels: {why}; replaying the server's loop over the records under each class of "
            f"{', '.join(c.label for c in candidates)}: its tokens and draft totals tell them")
        groups, found = loop_parted(candidates, job, cache, context)
        kept, parted = told_by_loop({rep.label: got for rep, got in found.items()})
        members = {rep.label: g for rep, g in zip(found, groups)}
        left = [c for label in kept for c in members[label]]
        for label, reason in parted.items():
            _detail(say, f"  {label:<24} out: {reason}")
        if len(kept) == 1:
            lead, *same = members[kept[0]]
            return KernelChoice(lead.variant, "loop", equal=tuple(c.label for c in same), repack=lead.repack,
                                crashes=crashes, why="; ".join(f"{k} {v}" for k, v in parted.items()))
    _detail(say, f"kernels: {why}; computing each record under every class of {', '.join(c.label for c in left)} for the "
        "bound on its values")
    spread = value_spread(left, job, list(range(len(records))), cache, context)
    ruled = f"; the loop replay ruled out {', '.join(parted)}" if parted else ""
    return KernelChoice(left[0].variant, "default", why=why + ruled, repack=left[0].repack, crashes=crashes,
                        bounds=tuple(sorted(spread.items())))


def _apart_by_loop(job: ProbeJob, probes: list[Probe], *, shared: str | None, say: Say) -> tuple[list[Probe], str]:
    """Kernels exact on the first entry whose one-token decodes differ, which the later real entries do not
    tell apart (choice.py exact_apart): each replays the server's loop over the records, and those whose
    replay parts from the emitted tokens or draft totals are out (choice.py told_by_loop). Returns the probes
    left and which were ruled out, and why ("" none). Not where batches were shared with requests the
    transcript does not hold: its loop is not the records' own."""
    apart = exact_apart(probes, job.options.tolerance) if shared is None else []
    if not apart:
        return probes, ""
    _detail(say, f"kernels: {', '.join(p.label for p in apart)} reproduce the first entry exactly and decode the tokens after "
        "it apart; replaying the server's loop under each: its tokens and draft totals tell them")
    _, found = loop_parted([Candidate(p.variant, p.repack) for p in apart], job, None, None)
    _, parted = told_by_loop({c.label: got for c, got in found.items()})
    for label, reason in parted.items():
        _detail(say, f"  {label:<24} out: {reason}")
    return [p for p in probes if p.label not in parted], "; ".join(f"{k} ({v})" for k, v in parted.items())


def _probed(job: ProbeJob, candidates: list[Candidate], *, beyond: list[str], crashes: tuple[str, ...],
            say: Say) -> KernelChoice:
    """The candidate whose evaluation of the witnesses' first entries is the server's (choice.py)."""
    records, options = job.inputs.records, job.options
    evidence = shared_evidence(records, job.flags, options.shared_batches)
    shared = next(iter(evidence.values()), None)
    ks = witnesses(records, shared=shared is not None)
    best = candidates[0]
    if not ks:
        return _by_loop(job, candidates, shared=shared, crashes=crashes, say=say)
    _detail(say, f"kernels: evaluating the first entry of {records_named(ks)} under each candidate this host runs "
        f"({', '.join(c.label for c in candidates)})")

    def said(label: str, p: Probe) -> None:
        also = f"; stands for {', '.join(p.same)}" if p.same else ""
        _detail(say, f"  {label:<24} " + (f"{p.diff:.3g} nats off (record {p.record + 1}){also}" if p.diff is not None
                                 else f"error: {p.error}"))
    rec = records[ks[0]]
    ctx = resolve("context", flags=job.flags, recorded=rec.flags, props=rec.props)
    cache, context = default_cache(), {a: getattr(ctx, a) for a in SIGNATURE_CONTEXT}
    if not classes_known(candidates, job, ks[0], cache, context):
        _detail(say, f"kernels: first learning which candidates compute alike on this model, from their kernel "
            f"signatures, once per model, library and context settings (kept in {cache.root})")
    probes = probe_variants(candidates, job, ks, progress=said, until_exact=EXACT, cache=cache, context=context)
    probes, ruled = _apart_by_loop(job, probes, shared=shared, say=say)
    try:
        choice = choose_variant(probes, shared=shared, not_runnable=beyond, witnesses=ks, tolerance=options.tolerance,
                                allow_nearest="--server-backend" if options.server_backend else None,
                                crashes=crashes)
        if ruled:
            choice = replace(choice, why=f"the loop replay ruled out {ruled}")
    except KernelsError:
        if not all(n_prompt_cached(records[k].final()) for k in ks):
            raise
        # its prompt came partly from the server's cache (no record here evaluated its prompt in
        # full): a disagreement may be the cache, not the kernels; the record's own judgement says
        choice = KernelChoice(best.variant, "default", record=ks[0], diffs=tuple((p.label, p.diff) for p in probes),
                              repack=best.repack,
                              why=f"record {ks[0] + 1}'s prompt came partly from the server's cache, so its "
                                  "first entry cannot tell the kernels")
    return replace(choice, crashes=crashes)
