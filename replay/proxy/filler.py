"""The values a proxied response carries, recovered as `recover` recovers them (the same front door: the
engine chosen from the transcript's evidence, the schedule, the kernels, the loop where the server's
batches need it). One transcript at a time: a process holds one libllama.

    Filler.fill(transcript) -> Filled    the repaired response (or stream events), how many values were
                                         filled, and why not where they cannot be exact
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.commands.recover import RecoverOptions
from replay.errors import SpecReplayError
from replay.run.recover import recover


@dataclass(frozen=True)
class Filled:
    """What the replay made of one response: `response` (a JSON object) or `events` (the stream's data
    payloads), repaired; `filled`, the values it put in place of placeholders and missing entries;
    `refused`, the one-line reason the values are not exact (None: every value is the server's)."""

    response: Any = None
    events: list | None = None
    filled: int = 0
    refused: str | None = None


class Filler:
    """Recovers proxied transcripts with the target (and draft) models and the server's flags, as
    llama-server spells them, that the proxy was started with."""

    def __init__(self, model: str | Path, flags: dict | None = None, options: RecoverOptions | None = None, *,
                 libllama: str | None = None, server_cpu: str | None = None):
        self.model, self.flags, self.options = Path(model), dict(flags or {}), options or RecoverOptions()
        self.libllama, self.server_cpu = libllama, server_cpu

    def fill(self, transcript: dict) -> Filled:
        """The transcript's response with every placeholder and missing value replaced by the value the
        server computed; refused (with the reason) where recover refuses it or calls it approximate."""
        try:
            res = recover(transcript, self.model, flags=self.flags, options=self.options, libllama=self.libllama,
                          server_cpu=self.server_cpu, say=_quiet)
        except SpecReplayError as e:
            return Filled(refused=str(e).splitlines()[0])
        rec = res.records[0]
        why = res.failure()
        if why is None and rec.approximation() is not None:
            bound, reason = rec.approximation()
            why = f"the values are approximate (within {bound} nats): {reason}" if bound is not None else \
                f"the values are approximate: {reason}"
        if why is not None or not res.repaired:
            return Filled(refused=(why or "the response could not be repaired").splitlines()[0])
        counts = rec.summary()["counts"]
        repaired = json.loads(res.repaired)
        return Filled(repaired.get("response"), repaired.get("events"), counts["placeholder"] + counts["missing"])


def _quiet(line: str, warning: bool) -> None:
    pass
