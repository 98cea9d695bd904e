"""Which candidate kernels compute a model bit for bit alike on this host (pure, but for the keys).

A transcript's kernels are found by evaluating its first real entry under every candidate (a CPU
variant, with or without extra buffer types: processes.py). Most candidates fall into a few
classes that compute a given model identically; once those are known, a new transcript of the model
needs one probe per class. Classes are learnt from the probes themselves:

- two candidates whose witness values differ (the first entry, or the one-token decodes after it)
  compute differently: different classes, shown;
- a variant whose weights took no extra buffer type computes with repack exactly as without
  (--no-repack): one class, by construction (the same buffers, the same kernels);
- candidates whose witness values are all equal are one class only when their kernel signatures
  (runtime/signature.py: every logit over batches of every shape a replay decodes) are equal too;
  equal witnesses alone are no proof (docs/recover.md: two variants can agree on a first entry and
  differ after it).

What is learnt is kept per host, model file, library files, variant, repack and the context settings
that choose kernels (`signature_key`), as a signature per candidate: a real one, or for a candidate
that its witness alone set apart, the witness's own fingerprint.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Iterable, Sequence

from replay.run.kernels.types import Candidate, Witnessed

# the context settings that choose kernels, by attr (runtime/signature.py)
SIGNATURE_CONTEXT = ("n_batch", "n_ubatch", "flash_attn", "cache_type_k", "cache_type_v", "swa_full")


def file_id(path: Path) -> list:
    st = Path(path).stat()
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]


def lib_files(lib: Path | None, variant: str) -> list | None:
    """The library's files a variant computes with (its own CPU backend, not the other variants')."""
    from replay.runtime.variants import PREFIX
    if lib is None:
        return None
    return [file_id(f) for f in sorted(Path(lib).glob("lib*.so*"))
            if f.is_file() and (not f.name.startswith(PREFIX) or f.name.startswith(f"{PREFIX}{variant}."))]


def signature_key(*, model: str | Path, libllama: Path | None, candidate: Candidate, context: dict) -> str:
    """What a candidate's class depends on: this host, the model file, the variant's library files, the
    repack, and the context settings that choose kernels (`context`); not the transcript."""
    from replay.runtime.health import host_identity
    from replay.runtime.signature import VERSION
    parts = {"host": host_identity(), "model": file_id(Path(model)), "lib": lib_files(libllama, candidate.variant),
             "variant": candidate.variant, "repack": candidate.repack, "context": context, "version": VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def classes(candidates: Sequence[Candidate], signature: Callable[[Candidate], str | None]
            ) -> list[list[Candidate]] | None:
    """The candidates grouped by equal signature, best first within and between groups, or None when
    one's signature is not known (then every candidate is probed).

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


def undecided(seen: Iterable[Witnessed]) -> list[list[Candidate]]:
    """The groups whose members computed the witnesses identically (and are not twins by
    construction): each needs its members' kernel signatures to tell whether they are one class.

    >>> z, i, x = Candidate("zen4"), Candidate("icelake"), Candidate("x64")
    >>> [[c.label for c in g] for g in undecided([Witnessed(z, 0, (-1.0,), ()), Witnessed(i, 0, (-1.0,), ()),
    ...                                           Witnessed(x, 0, (-1.5,), ())])]
    [['zen4', 'icelake']]
    """
    groups: dict[str, list[Candidate]] = {}
    for w in seen:
        fp = w.fingerprint()
        if fp is not None and w.twin_of is None:
            groups.setdefault(fp, []).append(w.candidate)
    return [g for g in groups.values() if len(g) > 1]


def learnt(seen: Sequence[Witnessed], signatures: dict[Candidate, str | None]) -> dict[Candidate, str]:
    """Each candidate's class signature: its witness fingerprint, and its kernel signature after it where
    one was computed (its group's members computed the witnesses alike); a twin by construction takes
    its twin's. Candidates with neither (an error) are left out.

    >>> z, zn, x = Candidate("zen4"), Candidate("zen4", False), Candidate("x64")
    >>> got = learnt([Witnessed(z, 0, (-1.0,), ()), Witnessed(zn, 0, (-1.0,), (), twin_of="zen4"),
    ...               Witnessed(x, 0, (-1.5,), ())], {})
    >>> got[z] == got[zn] != got[x]
    True
    """
    by_label = {w.candidate.label: w for w in seen}
    out: dict[Candidate, str] = {}
    for w in seen:
        fp = w.fingerprint()
        if w.twin_of is not None or fp is None:
            continue
        if w.candidate not in signatures:
            out[w.candidate] = fp
        elif signatures[w.candidate]:  # within its witness group: candidates that computed it otherwise never join
            out[w.candidate] = f"{fp}:{signatures[w.candidate]}"
    for w in seen:
        if w.twin_of is not None and by_label.get(w.twin_of) is not None and by_label[w.twin_of].candidate in out:
            out[w.candidate] = out[by_label[w.twin_of].candidate]
    return out


def representatives(groups: Sequence[Sequence[Candidate]]) -> list[Candidate]:
    """One candidate per class, in class order, preferring a variant another class already probes (a
    probe's process evaluates its variant's two repack modes in turn: fewer processes).

    >>> z, s, zn, sn = Candidate("zen4"), Candidate("sapphirerapids"), Candidate("zen4", False), Candidate("sapphirerapids", False)
    >>> [c.label for c in representatives([[z], [sn, zn]])]
    ['zen4', 'zen4 --no-repack']
    """
    chosen: list[Candidate] = []
    for g in groups:
        have = {c.variant for c in chosen}
        chosen.append(next((c for c in g if c.variant in have), g[0]))
    return chosen
