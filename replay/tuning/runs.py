"""What one record did under one setting (RecordRun), and a setting over the whole file (SettingRun).

Counts come from the loop's steps (loop/loop.py Step) and its generation-phase work (loop/work.py):
drafted and accepted as the server counts them (draft_n, draft_n_accepted), acceptance by draft
position, decodes by batch size. `Expected` is the verifier's expectation along a path
(loop/expectation.py); `Counts` one run's totals, of which a record at temperature > 0 may have several
(`tune --samples N`, one per seed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from replay.loop.expectation import kept_by_position
from replay.loop.work import Work
from replay.tuning.costs import CostTable, plain, tokens_per_second
from replay.tuning.stats import Estimate, estimate
from replay.tuning.sweep import Setting


def fresh_drafts(steps) -> list:
    """The steps that verified a fresh draft (a restored step's replay re-verifies kept tokens, not a draft)."""
    return [s for s in steps if s.draft and not s.rule.startswith("checkpoint replay")]


def positions(steps) -> tuple[list[int], list[int]]:
    """Per draft position: how many fresh drafts reached it (were that long), and how many of those the
    target kept.

    >>> from types import SimpleNamespace as S
    >>> positions([S(draft=[1, 2, 3], accepted=1, rule="sample-and-match"), S(draft=[4], accepted=1, rule="rejection")])
    ([2, 1, 1], [2, 0, 0])
    """
    tried: list[int] = []
    kept: list[int] = []
    for s in fresh_drafts(steps):
        for k in range(len(s.draft)):
            if k == len(tried):
                tried.append(0)
                kept.append(0)
            tried[k] += 1
            kept[k] += k < s.accepted
    return tried, kept


@dataclass(frozen=True)
class Expected:
    """The verifier's expected acceptance along one path: drafts as drafted there, each kept position
    weighed by its probability (loop/expectation.py). `along` says which path: "the recorded tokens" or
    "this run"."""

    drafted: int
    accepted: float
    tried: tuple[int, ...]
    kept: tuple[float, ...]
    along: str

    @staticmethod
    def of(steps, along: str) -> "Expected | None":
        """None when a draft has no acceptance probabilities (the chain has none: loop/expectation.py).

        >>> from types import SimpleNamespace as S
        >>> e = Expected.of([S(draft=[1, 2], accept_p=[0.5, 0.5], rule="sample-and-match")], "this run")
        >>> e.accepted, e.kept
        (0.75, (0.5, 0.25))
        """
        drafts = fresh_drafts(steps)
        if any(s.accept_p is None for s in drafts):
            return None
        tried: list[int] = []
        kept: list[float] = []
        for s in drafts:
            for k, p in enumerate(kept_by_position(s.accept_p)):
                if k == len(tried):
                    tried.append(0)
                    kept.append(0.0)
                tried[k] += 1
                kept[k] += p
        return Expected(sum(len(s.draft) for s in drafts), float(sum(kept)), tuple(tried), tuple(kept), along)

    def __add__(self, other: "Expected") -> "Expected":
        n = max(len(self.tried), len(other.tried))
        pad = lambda xs, z: list(xs) + [z] * (n - len(xs))
        return Expected(self.drafted + other.drafted, self.accepted + other.accepted,
                        tuple(a + b for a, b in zip(pad(self.tried, 0), pad(other.tried, 0))),
                        tuple(a + b for a, b in zip(pad(self.kept, 0.0), pad(other.kept, 0.0))),
                        self.along if self.along == other.along else "the recorded tokens, or this run's")

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def by_position(self) -> list[float | None]:
        return [k / t if t else None for k, t in zip(self.kept, self.tried)]

    def to_json(self) -> dict:
        return {"along": self.along, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "acceptance_by_position": self.by_position()}


@dataclass(frozen=True)
class Counts:
    """One run's totals for one record."""

    seed: int
    drafted: int
    accepted: int
    work: Work


@dataclass
class RecordRun:
    """One record under one setting: what the server's loop would have done."""

    record: int
    emitted: tuple[int, ...]
    temp: float
    steps: int  # speculative steps after the prompt (each one target decode)
    drafted: int
    accepted: int
    target: tuple[int, int]  # (decode calls, rows) on the target, prompt included
    draft: tuple[int, int]  # the same on the draft model (0, 0 without one)
    work: Work = field(default_factory=Work)  # the generation phase's (loop/work.py)
    tried: list[int] = field(default_factory=list)  # drafts that reached position k
    kept: list[int] = field(default_factory=list)  # of those, kept by the target
    expected: Expected | None = None
    no_expectation: str | None = None  # why `expected` is None
    samples: list[Counts] = field(default_factory=list)  # --samples: the runs with other seeds
    same_tokens: bool | None = None  # the baseline's tokens (None: the baseline itself)

    @property
    def exact(self) -> bool:
        """At temperature 0 the counts are this traffic's; at t > 0 one sampled run's."""
        return self.temp <= 0

    def counts(self, k: int) -> Counts:
        """Run k (0: the request's seed): a record at temperature 0 gives the same run for every seed."""
        if k == 0 or not self.samples:
            return Counts(-1, self.drafted, self.accepted, self.work)
        return self.samples[k - 1]

    def to_json(self) -> dict:
        return {"record": self.record, "tokens": len(self.emitted), "temperature": self.temp,
                "counts": "exact" if self.exact else "one sampled run (the request's seed)",
                "same_tokens_as_recorded": self.same_tokens, "steps": self.steps, "drafted": self.drafted,
                "accepted": self.accepted, "target_decodes": self.target[0], "target_rows": self.target[1],
                "draft_decodes": self.draft[0], "draft_rows": self.draft[1],
                "acceptance_by_position": [k / t if t else None for k, t in zip(self.kept, self.tried)],
                "generation": self.work.to_json(),
                "expected": None if self.expected is None else self.expected.to_json(),
                "no_expectation": self.no_expectation,
                "samples": [{"seed": c.seed, "drafted": c.drafted, "accepted": c.accepted,
                             "generation": c.work.to_json()} for c in self.samples]}


@dataclass
class SettingRun:
    setting: Setting
    records: list[RecordRun]

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.records)

    @property
    def tokens(self) -> int:
        return sum(len(r.emitted) for r in self.records)

    @property
    def target_decodes(self) -> int:
        return sum(r.target[0] for r in self.records)

    @property
    def decodes_per_token(self) -> float | None:
        """Target decodes per emitted token, prompt decodes included: 1 and a little without speculation."""
        return self.target_decodes / self.tokens if self.tokens else None

    @property
    def acceptance(self) -> float | None:
        drafted = self.total("drafted")
        return self.total("accepted") / drafted if drafted else None

    def by_position(self) -> list[float | None]:
        n = max((len(r.tried) for r in self.records), default=0)
        tried = [sum(r.tried[k] for r in self.records if k < len(r.tried)) for k in range(n)]
        kept = [sum(r.kept[k] for r in self.records if k < len(r.kept)) for k in range(n)]
        return [k / t if t else None for k, t in zip(kept, tried)]

    @property
    def expected(self) -> Expected | None:
        """The expectation summed over the records that have one (None: none has); `expected_records` says
        how many."""
        have = [r.expected for r in self.records if r.expected is not None]
        if not have:
            return None
        out = have[0]
        for e in have[1:]:
            out = out + e
        return out

    @property
    def expected_records(self) -> int:
        return sum(r.expected is not None for r in self.records)

    @property
    def n_samples(self) -> int:
        return 1 + max((len(r.samples) for r in self.records), default=0)

    def works(self, k: int = 0) -> list[Work]:
        return [r.counts(k).work for r in self.records]

    def sampled(self, table: CostTable | None = None) -> dict[str, Estimate] | None:
        """Over the --samples runs (None with one run): each run's acceptance, target decodes per token in
        the generation phase (after the first token: steps / (tokens - 1)) and, with a cost table, predicted tokens per second and speed-up against that
        run's tokens without speculation; their mean and interval."""
        n = self.n_samples
        if n < 2:
            return None
        acc, dpt, tps, up = [], [], [], []
        for k in range(n):
            cs = [r.counts(k) for r in self.records]
            drafted = sum(c.drafted for c in cs)
            if drafted:
                acc.append(sum(c.accepted for c in cs) / drafted)
            steps, toks = sum(c.work.steps for c in cs), sum(max(c.work.tokens - 1, 0) for c in cs)
            if toks:
                dpt.append(steps / toks)
            if table is not None:
                t = tokens_per_second([c.work for c in cs], table)
                base = tokens_per_second([plain(c.work) for c in cs], table)
                if t is not None:
                    tps.append(t)
                    if base:
                        up.append(t / base)
        out = {}
        for name, xs in (("acceptance", acc), ("generation_decodes_per_token", dpt), ("tokens_per_second", tps),
                         ("speedup", up)):
            if xs:
                out[name] = estimate(xs)
        return out

    def priced(self, table: CostTable) -> bool:
        """Whether `table` prices every run's work (tuning/costs.py CostTable.prices)."""
        return all(table.prices(r.counts(k).work) for r in self.records for k in range(self.n_samples))

    def speed(self, table: CostTable) -> tuple[float | None, float | None]:
        """(predicted tokens per second, speed-up against the same tokens without speculation): the mean over
        the --samples runs where there are several, else the one run's; (None, None) where the table cannot
        price this setting's work."""
        if not self.priced(table):
            return None, None
        samp = self.sampled(table)
        if samp and "tokens_per_second" in samp and "speedup" in samp:
            return samp["tokens_per_second"].mean, samp["speedup"].mean
        works = self.works()
        tps = tokens_per_second(works, table)
        base = tokens_per_second([plain(w) for w in works], table)
        return tps, (tps / base if tps and base else None)

    def to_json(self, table: CostTable | None = None) -> dict:
        exp = self.expected
        if table is not None and not self.priced(table):
            table = None  # its predicted figures are None (the note names the setting)
        samp = self.sampled(table)
        out = {"setting": self.setting.spelled, "overrides": self.setting.to_json(),
               "tokens": self.tokens, "drafted": self.total("drafted"), "accepted": self.total("accepted"),
               "acceptance": self.acceptance, "target_decodes": self.target_decodes,
               "target_decodes_per_token": self.decodes_per_token,
               "draft_decodes": sum(r.draft[0] for r in self.records),
               "acceptance_by_position": self.by_position(),
               "expected": None if exp is None else {**exp.to_json(), "records": self.expected_records},
               "samples": None if samp is None else {k: v.to_json() for k, v in samp.items()}}
        tps, up = self.speed(table) if table is not None else (None, None)
        out["predicted"] = {"tokens_per_second": tps, "speedup": up,
                            "of": None if tps is None else
                            f"the mean of {self.n_samples} runs" if self.n_samples > 1 else "one run (the request's seeds)"}
        out["records"] = [r.to_json() for r in self.records]
        return out


def sample_seeds(seed: int, n: int) -> list[int]:
    """The seeds of runs 1..n-1 (run 0 is the request's own): the next ones, modulo 2^32, past the
    server's "random seed" value 0xFFFFFFFF.

    >>> sample_seeds(7, 3), sample_seeds(0xFFFFFFFE, 3)
    ([8, 9], [0, 1])
    """
    out, s = [], seed
    while len(out) < n - 1:
        s = (s + 1) & 0xFFFFFFFF
        if s != 0xFFFFFFFF:
            out.append(s)
    return out

