"""Config objects generated from the settings table, and where each value came from.

    spec = resolve("speculative", flags={"draft_n_max": 5}, transcript=rec.speculative)
    spec.draft_n_max         # 5
    spec.sources["draft_n_max"], spec.sources["spec_types"]   # "flag", "transcript"

A value is taken from the first of: a flag given to spec-replay (spelled as llama-server spells
it), the server's own report in the /props that `record` captured (what it really runs with: a
slot's n_ctx), the flags `record` was told the server was started with (the transcript's
`server.speculative`), llama-server's built-in default for the build profile.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .table import BY_ATTR, SETTINGS, Setting, rows

SOURCES = ("flag", "/props", "transcript", "default")


def _config_class(name: str, group: str, doc: str) -> type:
    fields = [(s.attr, Any, dataclasses.field(default=s.default)) for s in rows(group)]
    fields.append(("sources", Mapping[str, str], dataclasses.field(default_factory=dict, compare=False,
                                                                    repr=False)))

    def given(self) -> dict[str, Any]:
        """The values that did not come from llama-server's defaults."""
        return {k: getattr(self, k) for k, src in self.sources.items() if src != "default"}

    cls = dataclasses.make_dataclass(name, fields, frozen=True, namespace={"given": given, "__doc__": doc})
    cls.__module__ = __name__
    return cls


SpecConfig = _config_class("SpecConfig", "speculative",
                           "The server's speculative flags (rows of the `speculative` group of settings.table).")
ContextConfig = _config_class("ContextConfig", "context",
                              "The server's context flags that change numerics or limits (`context` group).")
_CLASSES = {"speculative": SpecConfig, "context": ContextConfig}


def dig(obj: Any, path: str) -> Any:
    """obj["a"]["b"] for path "a.b"; None where anything on the way is missing or not an object."""
    for part in path.split("."):
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)
    return obj


def resolve(group: str, *, flags: Mapping[str, Any] | None = None, transcript: Mapping | None = None,
            props: Mapping | None = None, profile: str = "b11434") -> Any:
    """The `group`'s config object, each value from the first source that has it (module docstring).
    Values are parsed as llama-server parses its flags; a bad one raises ValueError naming the flag."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in rows(group):
        for src, value in (("flag", (flags or {}).get(s.attr)),
                           ("/props", dig(props, s.props) if s.props else None),
                           ("transcript", dig(transcript, s.transcript) if s.transcript else None)):
            value = _usable(s, s.parse(value))
            if value is not None:
                values[s.attr], sources[s.attr] = value, src
                break
        else:
            values[s.attr], sources[s.attr] = s.default_for(profile), "default"
    return _CLASSES[group](**values, sources=sources)


def check_recorded(transcript: Mapping | None, props: Mapping | None) -> None:
    """Raise ValueError (naming the flag) for a value a transcript recorded that llama-server would
    not take: readers call this, so resolution never meets a bad recorded value."""
    for s in SETTINGS:
        for where, value in ((f"server.speculative.{s.transcript}", dig(transcript, s.transcript) if s.transcript else None),
                             (f"server.props.{s.props}", dig(props, s.props) if s.props else None)):
            try:
                s.parse(value)
            except ValueError as e:
                raise ValueError(f"\"{where}\": {e}") from e


def _usable(s: Setting, value: Any) -> Any:
    """An empty --spec-type list is no value (the server's default applies); so is a /props n_ctx of 0."""
    if value == () or (s.attr == "n_ctx" and value == 0):
        return None
    return value


def transcript_block(values: Mapping[str, Any]) -> dict:
    """The transcript's `server.speculative` block for the flags a server was started with (`values`
    by attr; absent or None = the server's default, written as null)."""
    unknown = set(values) - set(BY_ATTR)
    assert not unknown, f"not in the settings table: {unknown}"
    block: dict[str, Any] = {"types": [], "ngram": {}}
    for s in rows("speculative", "context"):
        v = s.parse(values.get(s.attr))
        if s.transcript.startswith("ngram."):
            if v is not None:
                block["ngram"][s.transcript.split(".", 1)[1]] = v
        elif s.kind == "list":
            block[s.transcript] = list(v or ())
        else:
            block[s.transcript] = v
    return block


def describe(config: Any) -> list[tuple[str, Any, str]]:
    """(flag, value, source) for every value of a config object, in table order."""
    return [(BY_ATTR[f.name].flag, getattr(config, f.name), config.sources.get(f.name, "default"))
            for f in dataclasses.fields(config) if f.name != "sources"]
