"""Which CPU variant replays a transcript, from the probes of its first real entry (pure).

The rule: a variant whose evaluation of the first entry equals the server's to within EXACT (the
float32 rounding of the values the server printed) computed it; the replay then runs on it and its
values are exact wherever the schedule is the server's. Several variants may be equal on that entry
(a class of kernels); the most capable of them is used and the others are named. When none is equal,
the transcript came from kernels this host cannot run (a GPU, another CPU architecture, a native
build with other flags, a variant beyond this CPU): that is refused in one line unless the user said
so (`--server-backend`): then the nearest variant is used and the report names it and its distance.
A transcript that shows batches shared with other requests (several slots) is probed on several
records' first entries, since one computed alone is exact on the server's kernels; if none is, the
sharing itself may have moved them (measured: `witnesses` below) and the kernels are "unknown": the replay runs on
the host's best and the report says so.
"""
from __future__ import annotations

from typing import Sequence

from replay.comparison.bounds import FIRST_ENTRY_BOUND
from replay.errors import KernelsError
from replay.run.kernels.types import Probe
from replay.runtime.engine import KernelChoice
from replay.runtime.variants import VARIANTS
from replay.transcripts.entries import n_prompt_cached, record_entries
from replay.transcripts.readers import Record

EXACT = 1e-6  # nats: a float32 logprob printed by the server and recomputed by the same kernels agree to this
SEPARATED = 1e-3  # nats: an entry every other class probed is this far from tells classes apart (see needless_slow)
WITNESSES = 8  # first entries probed per variant when batches may have been shared
# nats: how far apart kernel classes' first entries must be for kernels to matter to a model at all: where
# every class here computes a first entry alike (f32 weights), no other CPU kernels or GPU move it by a
# tenth of a nat, so a first entry far off every one of them is not numerics (--server-backend, shared
# batches cannot make it one)
ALIKE = 1e-4


def choose_variant(probes: Sequence[Probe], *, shared: str | None = None, allow_nearest: str | None = None,
                   not_runnable: Sequence[str] = (), witnesses: Sequence[int] = (),
                   tolerance: float = EXACT, crashes: Sequence[str] = ()) -> KernelChoice:
    """The variant whose probe is exact (`probes` best-first: the first exact one, the other exact ones
    named, the witness record that matched kept). Exact ones whose one-token decodes of the tokens after
    it (Probe.decode) differ from the first's by more than `tolerance` (the precision recover promises,
    --tolerance) are a KernelsError: the first entry, computed in a prompt batch, cannot tell them apart,
    and the tokens after it are computed one at a time; within it the choice does not move a judged
    value past the tolerance, and the spread is reported. With none exact:
    - `shared` (the transcript's evidence of batches shared with other requests): the first entries
      cannot tell the kernels (sharing moves them as far as another variant does), so the replay runs on
      the first probed, this host's best, and the choice says the kernels are "unknown" (naming the
      `witnesses` probed);
    - `allow_nearest` (why a stated-precision replay is allowed: --server-backend, --shared-batches):
      the nearest, named with its distance;
    - else KernelsError naming the nearest, its distance, the likely causes, `not_runnable`
      (variants the library has but this CPU cannot run) and `crashes` (runtime/health.py's lines on
      variants whose kernels crash on this host: a server that computed with them needs another host).

    >>> ps = [Probe("haswell", 0.0193, record=0), Probe("sse42", 0.0, record=2), Probe("x64", 0.0, record=2)]
    >>> c = choose_variant(ps); c.variant, c.equal, c.record
    ('sse42', ('x64',), 2)
    >>> choose_variant([Probe("haswell", 0.02, record=0)], allow_nearest="--server-backend").how
    'nearest'
    >>> choose_variant([Probe("haswell", 0.08, record=1), Probe("x64", 0.03, record=3)], shared="a 4-slot server").variant
    'haswell'
    """
    skipped = [p for p in probes if p.skipped]
    probes = [p for p in probes if not p.skipped]
    exact = [p for p in probes if p.diff is not None and p.diff <= EXACT]
    if exact:
        return _among_exact(exact, probes, skipped, tolerance)
    return _none_exact(probes, shared=shared, allow_nearest=allow_nearest, not_runnable=not_runnable,
                       witnesses=witnesses, crashes=crashes)


def _among_exact(exact: list[Probe], probes: list[Probe], skipped: list[Probe], tolerance: float) -> KernelChoice:
    """The first exact probe, told apart from the other exact ones by the server's later real entries
    (told_apart) where their one-token decodes differ by more than `tolerance`; a KernelsError where
    nothing tells them apart (the server's log names its variant: --server-cpu)."""
    lead = exact[0]
    apart = [(p, decode_distance(lead, p)) for p in exact[1:]]
    differ = [(p, d) for p, d in apart if d is not None and d > tolerance]
    told = told_apart(exact) if differ else None
    if told:  # the server's own entries after the first say which of them it computed with
        exact, lead = told, told[0]
        apart = [(p, decode_distance(lead, p)) for p in exact[1:]]
        differ = [(p, d) for p, d in apart if d is not None and d > tolerance]
    if differ:
        names = ", ".join(p.label for p in [lead, *(p for p, _ in differ)])
        head = (f"record {lead.record + 1}'s first entry is reproduced exactly by {names}, whose one-token decodes "
                "of the tokens after it differ")
        raise KernelsError(f"{head}: give --server-cpu VARIANT, the one the server loaded").with_detail(
            f"{head} (by up to {max(d for _, d in differ):.3g} nats): the transcript cannot tell which computed "
            "the server's; give --server-cpu with the variant its llama.cpp loaded (the server's log names it: "
            "load_backend: loaded CPU backend from ...libggml-cpu-<variant>.so)")
    spread = max((d for _, d in apart if d is not None), default=None)
    equal = (*lead.same, *(x for p, _ in apart for x in (p.label, *p.same)))
    return KernelChoice(lead.variant, "matched", lead.diff, lead.record, equal,
                        diffs=tuple((p.label, p.diff) for p in probes),
                        spread=spread if spread and spread > EXACT else None, repack=lead.repack,
                        unprobed=tuple(x for p in skipped for x in (p.label, *p.same)),
                        why_unprobed=skipped[0].skipped if skipped else None)


def _none_exact(probes: list[Probe], *, shared: str | None, allow_nearest: str | None, not_runnable: Sequence[str],
                witnesses: Sequence[int], crashes: Sequence[str]) -> KernelChoice:
    """No probe is exact: an error every variant shares is the record's; a first entry no kernels explain
    is the model's or the build's; with shared batches the kernels are "unknown"; with `allow_nearest` the
    nearest; else a KernelsError naming the nearest, its distance and the likely causes."""
    diffs = tuple((p.label, p.diff) for p in probes)
    measured = sorted((p for p in probes if p.diff is not None), key=lambda p: p.diff)
    if not measured:
        raise _unevaluated(probes)
    near = measured[0]
    not_numerics = kernels_cannot_explain(measured)
    if not_numerics and (allow_nearest or not shared):
        raise KernelsError(f"record {near.record + 1}'s {not_numerics}" + (
            f": {allow_nearest} does not explain it" if allow_nearest else "") +
            "; the model file or the build is not the server's")
    if shared:
        seen = sorted(set(witnesses) or {p.record for p in measured if p.record is not None})
        return KernelChoice(probes[0].variant, "unknown", None, None, diffs=diffs, repack=probes[0].repack,
                            why=f"{shared}; no variant reproduces the first entry of {records_named(seen)}, and batches "
                                f"shared with other requests move a first entry as far as other kernels do (nearest "
                                f"{near.label} {near.diff:.3g} nats off)")
    if allow_nearest:
        return KernelChoice(near.variant, "nearest", near.diff, near.record, why=allow_nearest, diffs=diffs,
                            repack=near.repack)
    others = ", ".join(f"{p.label} {p.diff:.3g}" for p in measured[1:4])
    beyond = f" ({', '.join(not_runnable)} are built but this CPU cannot run them)" if not_runnable else ""
    where = f"record {near.record + 1}'s first entry" if near.record is not None else "the first entry"
    head = (f"{where} matches none of this host's CPU kernels (nearest "
            f"{VARIANTS[near.variant].label if near.variant in VARIANTS else near.variant}"
            f"{'' if near.repack else ' --no-repack'} {near.diff:.3g} nats off")
    cannot = f"; {', '.join(not_runnable)} not runnable here" if not_runnable else ""
    crashed = [c.split(":")[0] for c in crashes]
    needs = (f"kernels that crash on this host ({', '.join(crashed)}: recover on a host that runs them), a GPU "
             "or another CPU?" if crashed else "a GPU or another CPU?")
    raise KernelsError(
        f"{head}{cannot}): {needs} "
        "--server-backend NAME recovers at stated precision").with_detail(
        f"{head}{'; ' + others if others else ''}): the server computed on a GPU, another CPU architecture, a native "
        f"build with other flags, or a CPU variant this host cannot run{beyond}"
        + "".join(f"; {c}" for c in crashes) + "; give --server-backend NAME to recover at stated precision on the "
        "nearest")


def _unevaluated(probes: list[Probe]) -> KernelsError:
    """No probe evaluated the first entry: the same failure under every variant is the record's own."""
    errors = "; ".join(f"{p.label}: {p.error}" for p in probes) or "no CPU variant to evaluate"
    which = f"record {probes[0].record + 1}'s first entry" if probes and probes[0].record is not None else \
        "the first entry"
    distinct = list(dict.fromkeys(str(p.error) for p in probes))
    if len(distinct) == 1:  # the same failure under every variant: the record's, not the kernels'
        # an error that names its record is the record's own (a context too small, a wrong model): as it is
        return KernelsError(distinct[0] if ", record " in distinct[0] else
                            f"{which} could not be evaluated: {distinct[0]}").with_detail(
            f"{which} could not be evaluated under any CPU variant ({errors})")
    return KernelsError(f"{which} could not be evaluated under any CPU variant ({distinct[0]}; and "
                        f"{len(distinct) - 1} other error(s))").with_detail(
        f"{which} could not be evaluated under any CPU variant ({errors})")


def kernels_cannot_explain(measured: Sequence[Probe]) -> str | None:
    """Why no kernels explain how far the first entry is from every class probed (`measured`, nearest first),
    or None: every class computes it alike (within ALIKE: the model's values do not depend on kernels, as
    f32 weights do not) while the nearest is more than EXACT off, or the nearest is farther than shared batches
    and other kernels move a first entry (comparison/bounds.py FIRST_ENTRY_BOUND).

    >>> print(kernels_cannot_explain([Probe("zen4", 0.192, record=0), Probe("haswell", 0.192, record=0)]))
    first entry is 0.192 nats off, and every CPU kernel here computes it alike: kernels do not move this model's values
    >>> kernels_cannot_explain([Probe("zen4", 0.02, record=0), Probe("haswell", 0.19, record=0)]) is None
    True
    """
    near = measured[0]
    if near.diff is None or near.diff <= EXACT:
        return None
    if len(measured) > 1 and max(p.diff for p in measured) - near.diff <= ALIKE:
        return (f"first entry is {near.diff:.3g} nats off, and every CPU kernel here computes it alike: kernels do not "
                "move this model's values")
    if near.diff > FIRST_ENTRY_BOUND:
        return (f"first entry is {near.diff:.3g} nats off every CPU kernel here, more than other kernels or shared "
                f"batches move one ({FIRST_ENTRY_BOUND})")
    return None


def told_apart(exact: Sequence[Probe]) -> list[Probe] | None:
    """Of variants equal on the first entry, those whose one-token decodes of the tokens after it also
    reproduce the server's real entries among them (Probe.later within EXACT), best first; None when
    those entries cannot tell (some variant has none to compare, or none reproduces them).

    >>> told_apart([Probe("icelake", 0.0, later=0.11), Probe("haswell", 0.0, later=0.0)])[0].variant
    'haswell'
    >>> told_apart([Probe("icelake", 0.0, later=None), Probe("haswell", 0.0, later=0.0)]) is None
    True
    """
    if any(p.later is None for p in exact):
        return None
    agree = [p for p in exact if p.later <= EXACT]
    return agree or None


def decode_distance(a: Probe, b: Probe) -> float | None:
    """The largest |difference| between two probes' one-token decode values (Probe.decode), None when
    either has none or they are not of one shape (nothing to tell them apart by).

    >>> decode_distance(Probe("sse42", 0.0, decode=(-0.5, -0.5, -1.25)), Probe("x64", 0.0, decode=(-0.25, -0.25, -1.5)))
    0.25
    >>> decode_distance(Probe("sse42", 0.0), Probe("x64", 0.0, decode=(-0.5,))) is None
    True
    """
    if a.decode is None or b.decode is None or len(a.decode) != len(b.decode):
        return None
    return max((abs(x - y) for x, y in zip(a.decode, b.decode)), default=0.0)


def records_named(ks: Sequence[int]) -> str:
    """Records named by their 1-based numbers, as reports do.

    >>> records_named([0]), records_named([0, 2, 3])
    ('record 1', 'records 1, 3, 4')
    """
    return f"record {ks[0] + 1}" if len(ks) == 1 else "records " + ", ".join(str(k + 1) for k in ks)


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
            keys.append((bool(n_prompt_cached(rec.final())), rec.other_slot_busy(), k))
    return [k for *_, k in sorted(keys)][:limit if shared else 1]


def needless_slow(probes: Sequence[Probe], exact: float = EXACT) -> str | None:
    """Why the classes without vector kernels (x64, sse42: runtime/variants.py vectorised) need not be
    probed after the others, or None where they must. The rule: exactly one class probed reproduces the
    first entry (within `exact`), and every other class probed is SEPARATED or more from it. Classes
    differ by 1e-3 to 0.1 nats on a long prompt's first entry; an entry that far from every other class
    is one a further class would match to the last bit only by coincidence, and a wrong choice would
    still be caught, as every real entry after it is held to the full tolerance on the kernels chosen.
    Two exact classes (sse42 and x64 were measured equal on first entries) need their decodes told
    apart, so everything is probed then.

    >>> ps = [Probe("zen4", 0.0, record=0), Probe("haswell", 0.135, record=0), Probe("piledriver", 0.0341, record=0)]
    >>> needless_slow(ps)
    "zen4 reproduced record 1's first entry exactly, and every other class probed is 0.034 nats or more off it"
    >>> needless_slow(ps[:1]) is None, needless_slow([ps[0], Probe("haswell", 2e-4, record=0)]) is None
    (True, True)
    """
    hit = [p for p in probes if p.diff is not None and p.diff <= exact]
    rest = [p for p in probes if not (p.diff is not None and p.diff <= exact)]
    if len(hit) != 1 or not rest or any(p.diff is None or p.diff < SEPARATED for p in rest):
        return None
    return (f"{hit[0].label} reproduced record {hit[0].record + 1}'s first entry exactly, and every other class "
            f"probed is {min(p.diff for p in rest):.2g} nats or more off it")


def batch_alone(lead: Probe, batches: str | None, others: Sequence[str | None], exact: float = EXACT) -> str | None:
    """Why no class after `lead` (the best, probed first) need be probed, or None where they must. The
    rule: `lead` reproduces the first entry (within `exact`), and its batch signature (`batches`:
    runtime/signature.py, the logits of batches of 2 to 80 rows) differs from every other candidate's
    (`others`, all known). A first entry is computed in the prompt's batches; a class that computes
    batches otherwise computes that entry otherwise, and reproduces it to the last bit only by
    coincidence. Classes alike on batches and apart on single-token decodes (sse42 and x64 were measured
    equal on first entries) share a batch signature, so then they are probed and told apart by their
    decodes. A wrong choice would still be caught: every real entry after the first is held to the full
    tolerance on the kernels chosen.

    >>> batch_alone(Probe("zen4", 0.0, record=0), "a", ["b", "c"])
    "zen4 reproduced record 1's first entry exactly, and no other class computes batches as it does (kernel signatures)"
    >>> batch_alone(Probe("zen4", 0.0, record=0), "a", ["b", "a"]) is None  # another computes batches alike
    True
    >>> batch_alone(Probe("zen4", 0.0, record=0), "a", ["b", None]) is None  # one not known
    True
    >>> batch_alone(Probe("zen4", 0.012, record=0), "a", ["b"]) is None  # not exact: the others are probed
    True
    """
    if lead.diff is None or lead.diff > exact or batches is None or any(b is None or b == batches for b in others):
        return None
    return (f"{lead.label} reproduced record {lead.record + 1}'s first entry exactly, and no other class computes "
            "batches as it does (kernel signatures)")


def told_by_loop(verdicts: dict[str, dict[int, str | None]]) -> tuple[list[str], dict[str, str]]:
    """Which kernel classes the emitted tokens and draft totals leave open, as (kept, {parted: why}).

    `verdicts` holds, per class (its label, best first), what its replay of the server's loop over each
    record (0-based) found: "" it emitted the transcript's tokens with the server's draft totals (what
    `spec-replay trace` calls reproduced), a reason where it parted from them, None where nothing was
    compared. Under the server's kernels the loop replay is the server's own computation, so at t = 0
    every emitted token is its argmax and at t > 0 the seeded draw picks it, and the draft model drafts
    as the server's did (tools/server/server-context.cpp's loop, replayed by loop/loop.py): a class whose
    replay parts from a record did not compute it. Where every class parts, the parting is not the
    kernels' (the loop, the flags, the server's state), and none is ruled out.

    >>> told_by_loop({"zen4": {0: "the draft totals differ", 1: ""}, "haswell": {0: "", 1: ""}})
    (['haswell'], {'zen4': 'record 1: the draft totals differ'})
    >>> told_by_loop({"zen4": {0: "parts at token 3"}, "haswell": {0: "parts at token 5"}})
    (['zen4', 'haswell'], {})
    >>> told_by_loop({"zen4": {0: None}, "haswell": {0: None}})
    (['zen4', 'haswell'], {})
    """
    parted: dict[str, str] = {}
    for label, by_record in verdicts.items():
        first = next(((k, why) for k, why in sorted(by_record.items()) if why), None)
        if first is not None:
            parted[label] = f"record {first[0] + 1}: {first[1]}"
    if len(parted) == len(verdicts):
        return list(verdicts), {}
    return [label for label in verdicts if label not in parted], parted


def exact_apart(probes: Sequence[Probe], tolerance: float = EXACT) -> list[Probe]:
    """The probes choose_variant cannot choose between (it refuses them): exact on the first entry, best
    first, the lead and those whose one-token decodes differ from its by more than `tolerance`, where the
    server's later real entries do not tell them apart (told_apart); [] where it chooses.

    >>> [p.variant for p in exact_apart([Probe("zen4", 0.0, decode=(-0.5,)), Probe("haswell", 0.0, decode=(-0.75,))])]
    ['zen4', 'haswell']
    >>> exact_apart([Probe("zen4", 0.0, decode=(-0.5,)), Probe("haswell", 0.0, decode=(-0.5,))])
    []
    """
    exact = [p for p in probes if not p.skipped and p.diff is not None and p.diff <= EXACT]
    if len(exact) < 2:
        return []
    differ = [p for p in exact[1:] if (d := decode_distance(exact[0], p)) is not None and d > tolerance]
    told = told_apart(exact) if differ else None
    if told:
        exact = told
        differ = [p for p in exact[1:] if (d := decode_distance(exact[0], p)) is not None and d > tolerance]
    return [exact[0], *differ] if differ else []
