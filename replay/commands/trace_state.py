"""The state a llama-server keeps across requests, per slot, and which records of a JSONL it ties
together (so that `trace --workers` keeps those in one worker, in order).

A record depends on earlier ones through what the server keeps across requests (docs/server-loop.md,
fact 5; loop/loop.py `server_state`):

* ngram-mod's hash table, shared by all slots for the server's lifetime: a file whose server ran
  ngram-mod is one chain, in file order;
* per slot: the ngram-map-k / ngram-map-k4v / ngram-cache tables (loop/drafters.py, `persists`),
  which every later request on that slot continues; and draft-simple's draft sampler under
  --spec-draft-sampling probabilistic, retuned only by a request that drafts probabilistically
  (loop/draft_model.py, common/speculative.cpp:35-70): a temperature-0 request drafts with its
  slot's last retune, so it follows that slot's earlier records once one of them could have
  retuned; a temperature > 0 request retunes at its first draft and starts afresh, unless the
  transcript says its server drafted nothing (timings.draft_n 0 or missing);
* per slot: its memory (the KV cells and context checkpoints the loop left), which a request that
  took prompt tokens from the server's cache (timings.cache_n > 0) continues.

The slot is the response's id_slot (Record.slot_id); records whose slot is unknown share one.
Everything else starts from an empty slot either way, so independent records may go anywhere.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from replay.loop.drafters import DRAFTERS
from replay.loop.loop import MEMORY
from replay.settings import resolve
from replay.transcripts.chains import Unit
from replay.transcripts.entries import n_prompt_cached
from replay.transcripts.readers import Record
from replay.transcripts.request import request_settings

SERVER_WIDE = frozenset({"ngram-mod"})  # docs/server-loop.md, fact 5
PER_SLOT = frozenset(name for name, kind in DRAFTERS.items() if kind.persists) - SERVER_WIDE


class _SlotState(dict):
    """One slot's state dict (what loop/ and its drafters read and write), with the server-wide
    entries kept in the server's dict."""

    def __init__(self, shared: dict):
        super().__init__()
        self._shared = shared

    def __contains__(self, key) -> bool:
        return key in self._shared if key in SERVER_WIDE else super().__contains__(key)

    def __getitem__(self, key):
        return self._shared[key] if key in SERVER_WIDE else super().__getitem__(key)

    def __setitem__(self, key, value) -> None:
        if key in SERVER_WIDE:
            self._shared[key] = value
        else:
            super().__setitem__(key, value)

    def get(self, key, default=None):
        return self._shared.get(key, default) if key in SERVER_WIDE else super().get(key, default)


class ServerState:
    """What one llama-server keeps across the requests of a file: `slot(rec)` is the state dict to
    trace `rec` with (its slot's, sharing the server-wide entries). `close()` frees the slots'
    contexts (loop/loop.py HeldMemory)."""

    def __init__(self, n_parallel: int | None = None) -> None:
        self.n_parallel = n_parallel
        self._shared: dict = {}
        self._slots: dict[int | None, _SlotState] = {}

    def slot(self, rec: Record) -> dict:
        sid = rec.slot_id(self.n_parallel)
        if sid not in self._slots:
            self._slots[sid] = _SlotState(self._shared)
        return self._slots[sid]

    def close(self) -> None:
        for slot in self._slots.values():
            held = slot.pop(MEMORY, None)
            if held is not None:
                held.close()

    def __enter__(self) -> "ServerState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _joins_its_slot(types: set[str], draft_sampling: str, temp: float, drafted: bool, retuned: bool,
                    cached: bool = False) -> bool:
    """Does a record continue its slot's earlier state? (module docstring)"""
    if types & PER_SLOT or cached:
        return True
    if "draft-simple" in types and draft_sampling == "probabilistic":
        return retuned and (temp <= 0 or not drafted)
    return False


def trace_units(records: Sequence[Record], flags: Mapping[str, Any],
                model_meta: Callable[[str], str | None]) -> list[Unit]:
    """The records in units that share no server state (module docstring), largest first."""
    chains: dict[int | None, list[list[int]]] = {}  # per slot: its chains, in file order
    retuned: dict[int | None, bool] = {}
    wide = False
    for k, rec in enumerate(records):
        spec = resolve("speculative", flags=dict(flags), recorded=rec.flags, props=rec.props)
        types = set(spec.spec_types)
        wide = wide or bool(types & SERVER_WIDE)
        sid = rec.slot_id(flags.get("n_parallel"))
        temp = request_settings(rec, flags=dict(flags), model_meta=model_meta, grammar=False).params.temp
        timings = (rec.final() or {}).get("timings")
        drafted = isinstance(timings, dict) and bool(timings.get("draft_n"))
        slot = chains.setdefault(sid, [])
        if slot and _joins_its_slot(types, spec.draft_sampling, temp, drafted, retuned.get(sid, False),
                                    bool(n_prompt_cached(rec.final()))):
            slot[-1].append(k)
        else:
            slot.append([k])
        if "draft-simple" in types and temp > 0:
            retuned[sid] = True
    if wide:
        return [Unit(tuple(range(len(records))))] if records else []
    units = [Unit(tuple(c)) for slot in chains.values() for c in slot]
    return sorted(units, key=lambda u: (-u.size, u.records[0]))
