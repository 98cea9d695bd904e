"""What llama-server keeps across requests, as it keeps it (docs/server-loop.md, fact 5):

    ServerWide   for the server's lifetime, shared by every slot: ngram-mod's hash table
                 (common/speculative.cpp keeps one per server; its drafter kind's scope is "server")
    SlotState    per slot: the n-gram maps and ngram-cache (scope "slot"), draft-simple's draft sampler
                 as its last retune left it (spec_retune, common/speculative.cpp:35-70), and the slot's
                 memory (its contexts, their KV cells and the slot's checkpoints), which a request that
                 took prompt tokens from the cache continues

A SpeculativeLoop takes the SlotState of the slot its request ran on (commands/trace_state.py gives each
slot its own, over one ServerWide); without one it starts from a fresh slot on a fresh server and frees
the memory it made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from replay.schedule.memory import SlotMemory


@dataclass
class ServerWide:
    """What the server keeps for its lifetime across all slots."""

    drafters: dict[str, Any] = field(default_factory=dict)  # --spec-type name -> its drafter (scope "server")


@dataclass
class SlotState:
    """What one slot keeps across the requests it serves."""

    server: ServerWide = field(default_factory=ServerWide)
    drafters: dict[str, Any] = field(default_factory=dict)  # --spec-type name -> its drafter (scope "slot")
    retune: tuple[float, int] | None = None  # (temp, seed) of the draft sampler's last retune, None: never
    memory: SlotMemory | None = None
    memory_key: tuple | None = None  # what `memory` was made for: the models and their SlotConfig

    def drafter(self, name: str, scope: str, make: Callable[[], Any]) -> Any:
        """The slot's (scope "slot") or the server's (scope "server") drafter `name`, made once."""
        table = self.server.drafters if scope == "server" else self.drafters
        if name not in table:
            table[name] = make()
        return table[name]

    def memory_for(self, key: tuple, make: Callable[[], SlotMemory]) -> tuple[SlotMemory, bool]:
        """(the slot's memory, whether it continues the slot's earlier requests): the memory kept while
        `key` is the one it was made for, else a new one from `make` (the old one freed)."""
        if self.memory is not None and self.memory_key == key:
            return self.memory, True
        self.close()
        self.memory, self.memory_key = make(), key
        return self.memory, False

    def close(self) -> None:
        """Free the slot's memory (its contexts); the drafters' tables stay."""
        if self.memory is not None:
            self.memory.close()
        self.memory, self.memory_key = None, None
