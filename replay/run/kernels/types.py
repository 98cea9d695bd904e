"""The values kernel probing passes around (pure data): what a probe evaluates with (ProbeJob), a
candidate's kernels, what one evaluated on a witness in its process, what it computed for learning
classes, and its probe as the choice reads it."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from replay.commands.recover import RecoverOptions
from replay.run.inputs import Inputs

DECODES = 16  # tokens after the first, decoded one at a time, that make a variant's decode signature


@dataclass(frozen=True)
class Candidate:
    """Kernels a transcript may have been computed with: a CPU variant, with or without extra buffer
    types (llama-server's --no-repack)."""

    variant: str
    repack: bool = True

    @property
    def label(self) -> str:
        """As reports name it.

        >>> Candidate("zen4").label, Candidate("zen4", False).label
        ('zen4', 'zen4 --no-repack')
        """
        return self.variant if self.repack else f"{self.variant} --no-repack"


@dataclass(frozen=True)
class Witnessed:
    """What one candidate computed on the witnesses: the record, its own first-entry values and
    one-token decode values (None: not evaluated), and whether it is its variant's repack twin by
    construction (`twin_of`: the label of the candidate it computes exactly as)."""

    candidate: Candidate
    record: int | None
    values: tuple[float, ...] | None
    decode: tuple[float, ...] | None
    twin_of: str | None = None

    def fingerprint(self) -> str | None:
        if self.values is None:
            return None
        blob = json.dumps([self.record, [float(v).hex() for v in self.values],
                           [float(v).hex() for v in self.decode or ()]])
        return "witness:" + hashlib.sha256(blob.encode()).hexdigest()


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
    # the largest |server - replay| over the real entries among those DECODES tokens (the server's own
    # values: a token sampled outside the speculative loop, or every token of an unspeculated
    # transcript), None where none is real: what tells apart variants equal on the first entry
    later: float | None = None
    # not probed, and why (choice.py needless_slow: another class reproduced the entry exactly where
    # every class probed is far from it); diff is then None
    skipped: str | None = None

    @property
    def label(self) -> str:
        """The candidate as reports name it.

        >>> Probe("zen4", 0.0).label, Probe("zen4", 0.0, repack=False).label
        ('zen4', 'zen4 --no-repack')
        """
        return self.variant if self.repack else f"{self.variant} --no-repack"


@dataclass(frozen=True)
class Outcome:
    """One witness evaluated by one candidate in a probe's process (what travels back)."""

    record: int
    repack: bool
    diff: float | None = None  # the largest |server - replay| over the first entry's values
    error: str | None = None
    values: tuple[float, ...] | None = None  # the replay's own first-entry values (logprob, alternatives)
    decode: tuple[float, ...] | None = None  # its next DECODES tokens' values, one-token decodes
    later: float | None = None  # the largest |server - replay| over the real entries among them (Probe.later)
    twin: bool = False  # repack False computed as repack True: no weight took an extra buffer type


@dataclass(frozen=True)
class ProbeJob:
    """What every probe of one transcript evaluates with: its inputs, the server flags (settings attrs),
    the recover options and the release-style libllama's directory whose variants are probed."""

    inputs: Inputs
    flags: dict = field(default_factory=dict)
    options: RecoverOptions = field(default_factory=RecoverOptions)
    libllama: Path | None = None
