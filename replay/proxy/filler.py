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

from replay.commands.recover import Recoverer, RecoverOptions, result_of
from replay.errors import SpecReplayError
from replay.run.engine import choose_engine
from replay.run.inputs import Inputs
from replay.run.recover import open_recoverer
from replay.runtime.engine import EngineChoice
from replay.settings.server_flags import from_mapping


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
    llama-server spells them, that the proxy was started with.

    The engine (the libllama and the CPU kernels: run/engine.py) is chosen once, from the evidence of the
    first transcript, as recover chooses it, and kept for the ones after it: they come from the same
    server, and a later transcript whose real entries the kernels do not reproduce is refused by its own
    comparison, never filled."""

    def __init__(self, model: str | Path, flags: dict | None = None, options: RecoverOptions | None = None, *,
                 libllama: str | None = None, server_cpu: str | None = None):
        self.model, self.flags, self.options = Path(model), dict(flags or {}), options or RecoverOptions()
        self.libllama, self.server_cpu = libllama, server_cpu
        self.engine: EngineChoice | None = None
        self.build_info: str | None = None  # the server's build the engine was chosen for
        self._recoverer: Recoverer | None = None  # the models and the replayed server state, across responses
        self._seq: int | None = None  # the place of the last transcript replayed (fill's `seq`)
        self._lost = False  # a replay failed midway: the state replayed is not the server's

    def fill(self, transcript: dict, seq: int | None = None) -> Filled:
        """The transcript's response with every placeholder and missing value replaced by the value the
        server computed; refused (with the reason) where recover refuses it or calls it approximate. `seq`:
        the transcript's place among the generation requests the proxy sent the server (1, 2, ...): one
        that does not follow the last this Filler replayed comes after requests it did not see."""
        try:
            attrs, _ = from_mapping(self.flags, "recover")
            inputs = Inputs.of_object(transcript, self.model, renamed=self.options.renamed_model)
            build = (transcript.get("server") or {}).get("build_info")
            if self.engine is not None and build != self.build_info:
                return Filled(refused=f"the server's build changed from {self.build_info} to {build} since the "
                                      "proxy chose its engine: restart the proxy")
            if self.engine is None:
                self.build_info = build
                self.engine = choose_engine(inputs, flags=attrs, options=self.options, libllama=self.libllama,
                                            server_cpu=self.server_cpu, say=_quiet)
            after_gap = seq is not None and (self._lost or seq != (self._seq or 0) + 1)
            self._seq = seq
            res = self._recover(inputs, attrs, after_gap)
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

    def _recover(self, inputs: Inputs, attrs: dict, after_gap: bool):
        """recover's run of one transcript on one Recoverer (run/recover.py open_recoverer, as RecoverSession opens it) kept across
        responses: the models load once, and what the server keeps from one request to the next (the loop's
        slots, an n-gram table, MTP's carry, a draft sampler) is replayed in the order the responses came.
        Where requests came between (others' workers, requests that passed through unfilled or were
        cancelled: `after_gap`), a record that continues what they left is not looped, and where the order
        is not the server's, the loop's replay parts from the server's tokens or draft totals: either way
        its values are refused, not guessed (commands/looped.py)."""
        if self._recoverer is None:
            self._recoverer = open_recoverer(inputs, self.engine, attrs, self.options)
        self._recoverer.take(inputs.records, after_gap=after_gap)
        try:
            done = [self._recoverer.recover(rec) for rec in inputs.records]
        except BaseException:
            self._recoverer.close()  # its state is not the server's any more: the next starts afresh
            self._recoverer, self._lost = None, True
            raise
        self._lost = False
        return result_of(inputs.records, done, inputs.text)


def _quiet(line: str, warning: bool = False, detail: bool = False) -> None:
    pass
