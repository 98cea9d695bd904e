"""What other speculative settings would have done on the user's own traffic (`spec-replay tune`).

For every setting of a sweep (the transcript's own, then each combination of the `--vary` lists), the
server's loop (commands/trace.py) is replayed over every record in file order on a fresh server
(trace_state.ServerState: ngram-mod's table and each slot's state live as long as the server, as they did
for the transcript), with each record's prompt and request (seed, sampling, stop). Each run counts what
the server would have done: its target and draft-model decodes and their rows (the replay's own decode
calls, prompt included), the drafted and accepted tokens, and acceptance by draft position.

What the counts are (the report says which, record by record):

* The transcript's own setting is the baseline: its replay must reproduce every token and the draft
  totals the server reported (timings.draft_n, draft_n_accepted), as trace does. Where it does not, the
  sweep is refused: nothing else could then be trusted.
* At temperature 0 sampling is an argmax: every setting emits the same tokens, and speculation changes
  only how many decodes produce them. The counts are exact for this traffic. The sweep checks that the
  tokens are the same; where a setting's verify batches move a near-tie (their numerics differ from
  another batch size's), the record is flagged, not hidden.
* At temperature > 0 each setting draws its own sample from the same distribution: the counts are those
  of one run with the request's seed, not an expectation.

A speed prediction (a cost model of decodes by batch size) is not made yet: the table ranks settings by
target decodes per emitted token, the quantity speculation exists to lower.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from replay.commands.trace import Drafts, trace_read
from replay.commands.trace_state import ServerState
from replay.errors import SettingsError, TranscriptError, located
from replay.reading.record import read_record
from replay.runtime.llama import Model
from replay.settings import resolve
from replay.settings.server_flags import BY_FLAG
from replay.tokens.prompt_ids import message_spans
from replay.transcripts.readers import Record

LOOP_GROUP = "speculative"
NOT_VARIED = ("draft_model", "draft_cache_type_k", "draft_cache_type_v")  # -md is given once; KV types are numerics


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: the loop settings it overrides (settings attrs) and how a user spells it."""

    overrides: tuple[tuple[str, Any], ...]
    spelled: str  # "--spec-draft-n-max 4 --spec-type ngram-mod", or "as recorded"

    @property
    def flags(self) -> dict[str, Any]:
        return dict(self.overrides)


BASELINE = Setting((), "as recorded")


def parse_vary(text: str) -> tuple[str, list[Any], list[str]]:
    """One --vary: "FLAG=V1,V2,..." with FLAG spelled as llama-server spells a loop setting. Returns (the
    setting's attr, its parsed values, their spellings). A list setting (--spec-type) takes one
    alternative per comma, several types joined by "+".

    >>> parse_vary("--spec-draft-n-max=2,4")
    ('draft_n_max', [2, 4], ['2', '4'])
    >>> parse_vary("--spec-type=ngram-mod,draft-simple+ngram-mod")[1]
    [('ngram-mod',), ('draft-simple', 'ngram-mod')]
    >>> parse_vary("--temp=0.5")
    Traceback (most recent call last):
    ...
    replay.errors.SettingsError: --vary --temp=0.5: --temp is not a setting of the speculative loop (tune varies only those: --spec-*)
    """
    flag, sep, values = text.partition("=")
    flag = flag.strip()
    if not sep or not values.strip():
        raise SettingsError(f"--vary {text}: give FLAG=V1,V2,... (e.g. --spec-draft-n-max=2,4,8)")
    setting = BY_FLAG.get(flag)
    if setting is None:
        raise SettingsError(f"--vary {text}: {flag} is not a flag of llama-server (b11434)")
    if setting.group != LOOP_GROUP or setting.attr in NOT_VARIED:
        raise SettingsError(f"--vary {text}: {flag} is not a setting of the speculative loop (tune varies only "
                            "those: --spec-*)")
    raw = [v.strip() for v in values.split(",")]
    if any(not v for v in raw):
        raise SettingsError(f"--vary {text}: an empty value")
    try:
        parsed = [setting.parse(v.replace("+", ",")) for v in raw]
    except ValueError as e:
        raise SettingsError(f"--vary {text}: {e}") from None
    return setting.attr, parsed, raw


def sweep(varies: Sequence[str]) -> list[Setting]:
    """The baseline, then every combination of the --vary lists (a grid), each once.

    >>> [s.spelled for s in sweep(["--spec-draft-n-max=2,4", "--spec-type=ngram-mod"])]
    ['as recorded', '--spec-draft-n-max 2 --spec-type ngram-mod', '--spec-draft-n-max 4 --spec-type ngram-mod']
    """
    axes = []
    for text in varies:
        attr, values, raw = parse_vary(text)
        flag = text.partition("=")[0].strip()
        if any(attr == a for a, _, _ in axes):
            raise SettingsError(f"--vary {flag} is given twice: give its values in one list")
        axes.append((attr, flag, list(zip(values, raw))))
    out = [BASELINE]
    for combo in itertools.product(*[a[2] for a in axes]):
        overrides = tuple((attr, v) for (attr, _, _), (v, _) in zip(axes, combo))
        spelled = " ".join(f"{flag} {r.replace('+', ',')}" for (_, flag, _), (_, r) in zip(axes, combo))
        if overrides and all(s.overrides != overrides for s in out):
            out.append(Setting(overrides, spelled))
    return out


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
    tried: list[int] = field(default_factory=list)  # drafts that reached position k
    kept: list[int] = field(default_factory=list)  # of those, kept by the target
    same_tokens: bool | None = None  # the baseline's tokens (None: the baseline itself)

    @property
    def exact(self) -> bool:
        """At temperature 0 the counts are this traffic's; at t > 0 one sampled run's."""
        return self.temp <= 0

    def to_json(self) -> dict:
        return {"record": self.record, "tokens": len(self.emitted), "temperature": self.temp,
                "counts": "exact" if self.exact else "one sampled run (the request's seed)",
                "same_tokens_as_recorded": self.same_tokens, "steps": self.steps, "drafted": self.drafted,
                "accepted": self.accepted, "target_decodes": self.target[0], "target_rows": self.target[1],
                "draft_decodes": self.draft[0], "draft_rows": self.draft[1],
                "acceptance_by_position": [k / t if t else None for k, t in zip(self.kept, self.tried)]}


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

    def to_json(self) -> dict:
        return {"setting": self.setting.spelled, "overrides": {a: list(v) if isinstance(v, tuple) else v
                                                               for a, v in self.setting.overrides},
                "tokens": self.tokens, "drafted": self.total("drafted"), "accepted": self.total("accepted"),
                "acceptance": self.acceptance, "target_decodes": self.target_decodes,
                "target_decodes_per_token": self.decodes_per_token,
                "draft_decodes": sum(r.draft[0] for r in self.records),
                "acceptance_by_position": self.by_position(),
                "records": [r.to_json() for r in self.records]}


def _positions(steps) -> tuple[list[int], list[int]]:
    """Per draft position: how many fresh drafts reached it, and how many of those the target kept (a
    restored step's replay re-verifies kept tokens, not a draft, and is not counted)."""
    tried: list[int] = []
    kept: list[int] = []
    for s in steps:
        if not s.draft or s.rule.startswith("checkpoint replay"):
            continue
        for k in range(len(s.draft)):
            if k == len(tried):
                tried.append(0)
                kept.append(0)
            tried[k] += 1
            kept[k] += k < s.accepted
    return tried, kept


def tune(records: Sequence[Record], target: Model, varies: Sequence[str], *, flags: Mapping[str, Any] | None = None,
         drafts: Drafts | None = None, build: int | None = None, renamed: bool = False,
         progress: Callable[[int, int], None] | None = None) -> list[SettingRun]:
    """Replay every record under every setting of the sweep (module docstring); the baseline first. `flags`:
    server flags given on the command line (settings attrs), under each setting's overrides."""
    settings = sweep(varies)
    flags = dict(flags or {})
    drafts = drafts or Drafts()
    reads = []  # each record read once (prompt ids, settings, plan, identity); a setting replaces only its spec
    for rec in records:
        with located(rec.source, rec.index):
            read = read_record(rec, target, flags, command="trace", build=build, renamed=renamed)
            reads.append((read, message_spans(rec, target, list(read.prompt))))
    runs: list[SettingRun] = []
    total, done = len(settings) * len(records), 0
    for setting in settings:
        out = []
        with ServerState(flags.get("n_parallel")) as state:
            for rec, (read, spans) in zip(records, reads):
                with located(rec.source, rec.index):
                    if setting is not BASELINE:
                        read = replace(read, spec=resolve("speculative", flags={**flags, **setting.flags},
                                                          recorded=rec.flags, props=rec.props))
                    res = trace_read(read, target, slot_state=state.slot(rec), drafts=drafts, renamed=renamed,
                                     spans=spans)
                if setting is BASELINE and res.reproduced is not True:
                    what = (f"token {res.first_divergence} differs" if res.first_divergence is not None else
                            f"its draft totals differ (replayed {res.draft_n}/{res.draft_n_accepted}, the server "
                            f"{res.server_draft_n}/{res.server_draft_n_accepted})" if res.server_draft_n is not None
                            else "it carries no draft totals to check")
                    raise TranscriptError(f"the transcript's own settings do not reproduce it ({what}): a sweep "
                                          "against it would mean nothing; `spec-replay trace` shows why",
                                          source=rec.source, record=rec.index)
                tried, kept = _positions(res.steps)
                out.append(RecordRun(rec.index, tuple(e.id for e in res.emitted), res.settings.params.temp,
                                     len(res.steps) - 1, res.draft_n, res.draft_n_accepted,
                                     res.decodes.get("target", (0, 0)), res.decodes.get("draft", (0, 0)),
                                     tried, kept))
                done += 1
                if progress:
                    progress(done, total)
        runs.append(SettingRun(setting, out))
    for run in runs[1:]:
        for r, b in zip(run.records, runs[0].records):
            r.same_tokens = r.emitted == b.emitted
    return runs
