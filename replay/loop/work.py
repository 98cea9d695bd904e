"""What the server's generation phase did for one request: the work a speed model prices.

The span is the one llama-server times as `timings.predicted_ms`: from the first token (sampled from the
prompt's last logits) to the last one (server-common.h:437-446, server-context.cpp:4203-4211), so the
prompt's decodes are not in it and its `predicted_per_second` counts predicted_n - 1 tokens.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Work:
    """Decode calls by batch rows on the target and on the draft model (drafting and the draft context's
    mirror of each verify batch), the target chain's passes (one per verified row: sampled, or the
    verifier's draw) and the draft chain's (one per drafted position), and the tokens emitted."""

    target_batches: Mapping[int, int] = field(default_factory=dict)
    draft_batches: Mapping[int, int] = field(default_factory=dict)
    target_samples: int = 0
    draft_samples: int = 0
    tokens: int = 0

    @property
    def steps(self) -> int:
        """Generation-phase target decodes (one per speculative or normal step)."""
        return sum(self.target_batches.values())

    def __add__(self, other: "Work") -> "Work":
        """Two requests' work together.

        >>> (Work({1: 2}, {}, 2, 0, 3) + Work({1: 1, 4: 1}, {1: 3}, 4, 3, 5)).target_batches
        {1: 3, 4: 1}
        """
        return Work(dict(Counter(self.target_batches) + Counter(other.target_batches)),
                    dict(Counter(self.draft_batches) + Counter(other.draft_batches)),
                    self.target_samples + other.target_samples, self.draft_samples + other.draft_samples,
                    self.tokens + other.tokens)

    def to_json(self) -> dict:
        return {"target_batches": {str(k): v for k, v in sorted(self.target_batches.items())},
                "draft_batches": {str(k): v for k, v in sorted(self.draft_batches.items())},
                "target_samples": self.target_samples, "draft_samples": self.draft_samples, "tokens": self.tokens}


def since(before: Mapping[int, int], after: Mapping[int, int]) -> dict[int, int]:
    """The decode calls between two readings of a context's counter (runtime/llama.py Context.batches).

    >>> since({1: 2}, {1: 5, 3: 1})
    {1: 3, 3: 1}
    """
    return {k: n - before.get(k, 0) for k, n in sorted(after.items()) if n - before.get(k, 0)}
