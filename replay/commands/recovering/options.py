"""How recover evaluates, besides the server's own settings: one definition, the CLI's and the API's."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from replay.comparison.bounds import BATCH_BOUND
from replay.comparison.values import DEFAULT_TOLERANCE


@dataclass(frozen=True)
class RecoverOptions:
    """How recover evaluates, besides the server's own settings (settings.ContextConfig)."""

    tolerance: float = DEFAULT_TOLERANCE
    batch_bound: float = BATCH_BOUND  # comparison/judgement.py judge_numerics
    server_backend: str | None = None  # --server-backend: what the server computed on, when no flag says
    build: int | None = None  # --build N: the server's llama.cpp build, over the transcript's build_info
    build_why: str | None = None  # why `build` where the run chose it (run/build_choice.py), not --build
    build_decided: bool = True  # False: no evidence told the build (the default replayed; values approximate)
    source: Path | None = None  # --source DIR: the server's llama.cpp checkout (its loop shape)
    reuse_prefix: bool = True  # keep KV of a prompt prefix shared with the previous record, where exact
    shared_batches: bool = False  # --shared-batches: the user says the server batched these requests with others
    renamed_model: bool = False  # --renamed-model: -m is the server's file under another name (reading/identity.py)
    only_entries: int = 0  # evaluate the prompt and only this many generated tokens; 0: all (run/kernels/processes.py)
