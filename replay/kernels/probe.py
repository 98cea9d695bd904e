"""Evaluate a transcript's first real entry under each CPU variant this host runs.

The first entry of every response is computed for real, in the prompt batch, by whatever kernels the
server's ggml loaded (tools/server/server-context.cpp: the first token is sampled outside the
speculative loop, its probabilities taken from the prompt's last logits). Evaluating that one prompt
under each variant of a release-style libllama tells which kernels computed it: on quantized weights
the variants fall into a few classes whose values differ by 1e-3 to 0.1 nats, and the server's class
reproduces the entry to the last bit.

A process holds one ggml, so each variant is evaluated in a fresh (spawned) worker process with the
variant named in its environment (runtime/binding.py: use_cpu_variant); the worker recovers only the
prompt and the first token (RecoverOptions.first_entry_only). What travels is the transcript text
and the record's position, as for `recover --workers` (scale/worker.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from ..errors import SpecReplayError
from ..transcripts.entries import n_prompt_cached, record_entries
from ..transcripts.readers import Record


@dataclass(frozen=True)
class Probe:
    """One variant's evaluation of the probed entry: `diff` is the largest |server - replay| over the
    entry's logprob and its alternatives (nats), None with `error` when it could not be evaluated."""

    variant: str
    diff: float | None
    error: str | None = None


def probe_record(records: Sequence[Record]) -> int | None:
    """The record whose first entry identifies the kernels: the first with a real first entry (a
    logprob and alternatives, or a nonzero logprob) whose prompt the server evaluated in full, else
    the first with a real first entry at all; None when no record carries one.

    A record served from the server's prompt cache had part of its prompt's KV computed by an earlier
    request that may not be in the file: its first entry is then a weaker witness."""
    real = []
    for k, rec in enumerate(records):
        entries = record_entries(rec)
        if entries and (entries[0].top or entries[0].logprob != 0.0):
            real.append(k)
            if not n_prompt_cached(rec.final()):
                return k
    return real[0] if real else None


def _child_init(libllama: str | None, variant: str) -> None:  # pragma: no cover - runs in the child
    from ..runtime import binding
    if libllama:
        os.environ[binding.ENV] = libllama
    os.environ[binding.VARIANT_ENV] = variant


def _child_probe(text: str, source: str, request: dict | None, index: int, model: str, flags: dict,
                 options, variant: str) -> tuple[float | None, str | None]:  # pragma: no cover - in the child
    from ..recovery.recover import Recoverer
    from ..runtime.binding import loaded_variant
    from ..transcripts.readers import read_text
    try:
        if loaded_variant() != variant:
            return None, f"loaded {loaded_variant()} instead of {variant}"
        rec = read_text(text, source, request)[index]
        r = Recoverer(model, flags, replace(options, first_entry_only=True))
        try:
            rep = r.recover(rec).report
        finally:
            r.close()
    except SpecReplayError as e:
        return None, str(e)
    pairs = rep.tokens[0].real_pairs if rep.tokens else ()
    if not pairs:
        return None, rep.error or "the first entry carries no real value to compare"
    return max(abs(a - b) for a, b in pairs), None


def probe_variants(variants: Sequence[str], *, text: str, source: str, request: dict | None, index: int,
                   model: str | Path, flags: dict, options, libllama: Path | None,
                   progress: Callable[[str, Probe], None] | None = None, until_exact: float | None = None) -> list[Probe]:
    """Evaluate record `index`'s first entry under each of `variants` (one spawned process each, one
    after another: each uses the machine's cores), stopping at the first within `until_exact` when
    given (`variants` best first: a transcript from a machine of this host's class costs one). A worker
    that dies is that variant's error."""
    out: list[Probe] = []
    ctx = mp.get_context("spawn")
    for v in variants:
        try:
            with cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_child_init,
                                        initargs=(str(libllama) if libllama else None, v)) as pool:
                diff, err = pool.submit(_child_probe, text, source, request, index, str(model), dict(flags),
                                        options, v).result()
        except cf.process.BrokenProcessPool:
            diff, err = None, "the worker process died"
        probe = Probe(v, diff, err)
        out.append(probe)
        if progress is not None:
            progress(v, probe)
        if until_exact is not None and diff is not None and diff <= until_exact:
            break
    return out
