"""The state a llama-server keeps across requests, per slot, and which records of a JSONL it ties
together (so that `trace --workers` keeps those in one worker, in order); loop/state.py holds that state.

A record depends on earlier ones through what the server keeps across requests (docs/server-loop.md,
fact 5; loop/state.py):

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
from replay.loop.state import ServerWide, SlotState
from replay.reading.settings import request_settings
from replay.settings import resolve
from replay.transcripts.chains import Unit
from replay.transcripts.entries import n_prompt_cached
from replay.transcripts.readers import Record
from replay.transcripts.request import asked

SERVER_WIDE = frozenset(name for name, kind in DRAFTERS.items() if kind.scope == "server")  # ngram-mod
PER_SLOT = frozenset(name for name, kind in DRAFTERS.items() if kind.scope in ("slot", "slot-memory"))


class ServerState:
    """What one llama-server keeps across the requests of a file: `slot(rec)` is the SlotState to trace
    `rec` with (its slot's, over the one ServerWide). `close()` frees the slots' memory."""

    def __init__(self, n_parallel: int | None = None) -> None:
        self.n_parallel = n_parallel
        self.server = ServerWide()
        self._slots: dict[int | None, SlotState] = {}

    def slot(self, rec: Record) -> SlotState:
        sid = rec.slot_id(self.n_parallel)
        if sid not in self._slots:
            self._slots[sid] = SlotState(self.server)
        return self._slots[sid]

    def close(self) -> None:
        for slot in self._slots.values():
            slot.close()

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


def keeps_state(records: Sequence[Record], flags: Mapping[str, Any]) -> bool:
    """Does the server's drafter keep state from one request to the next (module docstring: ngram-mod's
    table, a slot's n-gram maps, draft-simple's probabilistic draft sampler) for any of `records`? Then
    recover replays the server's loop over them in file order, as one unit (transcripts/chains.py).

    >>> keeps_state([], {"spec_types": ("ngram-mod",)})
    False
    """
    for rec in records:
        spec = resolve("speculative", flags=dict(flags), recorded=rec.flags, props=rec.props)
        types = set(spec.spec_types)
        if types & (SERVER_WIDE | PER_SLOT) or ("draft-simple" in types and spec.draft_sampling == "probabilistic"):
            return True
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
        temp = request_settings(rec, asked(rec), flags=dict(flags), model_meta=model_meta,
                                grammar=False).params.temp
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
