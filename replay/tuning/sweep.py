"""The settings of a `tune` sweep: the transcript's own, then every combination of the `--vary` lists.

A setting is spelled as llama-server spells its flags (settings/server_flags.py); only the speculative
loop's settings can vary (the `--spec-*` flags but the draft model and its KV types).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from replay.errors import SettingsError
from replay.settings.server_flags import BY_FLAG

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

    def to_json(self) -> dict:
        return {a: list(v) if isinstance(v, tuple) else v for a, v in self.overrides}


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
