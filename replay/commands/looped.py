"""recover's values from the server's loop replayed, where one decode per token cannot give them.

A target whose memory cannot drop a suffix (Gemma 3's sliding window, recurrent and hybrid models)
verifies a partly accepted draft by restoring a checkpoint and decoding the accepted tokens again
(tools/server/server-context.cpp:4276-4305), and a server with flash attention off computes a verify
batch's attention with other kernels than a one-row decode's: in both, past the point
`approximate_from` names (schedule/exactness.py), the transcript does not show the batches the server
computed its values and its KV in. The loop replay does: it drafts with the draft model (or the n-gram
tables), decodes the server's verify batches and restores its checkpoints step by step
(loop/loop.py, what `spec-replay trace` runs), and every emitted token carries the values of the row
that scored it, which is what a server patched to report real probabilities sends.

Those values are used only on evidence that the replay ran the server's batches: it emitted the
transcript's tokens (where a chat stream sent text without ids, tokens that spell each chunk's text,
ending at its end), and its draft totals equal the server's (timings.draft_n, draft_n_accepted) where
the server sent them; the caller then holds every real entry to the full tolerance. Where the loop
cannot be replayed (no draft model file here, server state left by records this replay did not
loop), `LoopValues.values` says why, and recover keeps its approximate values.
"""
from __future__ import annotations

from dataclasses import dataclass

from replay.commands.trace import Drafts, trace_read
from replay.commands.trace_state import PER_SLOT, SERVER_WIDE, ServerState
from replay.comparison.trace import items_of_emitted
from replay.errors import ModelError, SpecReplayError
from replay.evaluation.walk import Truth
from replay.loop.replayable import drafts_with_model
from replay.reading.record import ReadRecord
from replay.runtime.llama import Model
from replay.schedule.prefix import FRESH, Prefix
from replay.settings import draft_thread_count
from replay.settings.config import thread_count


@dataclass(frozen=True)
class Looped:
    """The loop's values for a record's tokens (None: not replayed, and `why`), and what the replay did."""

    truths: list[Truth] | None
    why: str = ""
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    totals_checked: bool = False  # the server sent its draft totals and the replay's equal them
    schedule: dict | None = None  # the prompt schedule the loop replayed (schedule/memory.py schedule_of)
    prefix: Prefix = FRESH  # what the request kept of the loop's slot memory
    notes: tuple[str, ...] = ()  # the loop's own notes (loop/loop.py)


class LoopValues:
    """The server's loop over a file's records, in order, as one server ran them (commands/trace_state.py
    ServerState: the slots' memory, drafters and draft samplers across requests); the draft models loaded
    once. A record that is not looped breaks the chain: the next looped record starts on a fresh server,
    unless it continues what earlier records left (the prompt cache, an n-gram table): that one is not
    looped."""

    def __init__(self, target: Model, drafts: Drafts, n_parallel: int | None, renamed: bool = False):
        self.target = target
        self.drafts = drafts
        self.n_parallel = n_parallel
        self.renamed = renamed
        self._state: ServerState | None = None
        self._gap = False  # a record the loop was not replayed for came since the server started
        self._before: tuple[bool, bool] = (True, False)  # (no state, _gap) when values() was last called

    @property
    def live(self) -> bool:
        """Does the loop hold a server state (the records it replayed since the server started)?"""
        return self._state is not None

    def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._state = None

    def forget(self) -> None:
        """A new unit of work (transcripts/chains.py): the next record starts the server afresh."""
        self.close()
        self._gap = False

    def skip(self) -> None:
        """A record this replay did not loop: what the server kept from it is not in the state."""
        self.close()
        self._gap = True

    def undo(self) -> None:
        """Forget the last values() call where it started the server afresh (a retry of the same record on
        other settings, the server's -t found since); else what it changed stays a gap."""
        fresh, gap = self._before
        if fresh:
            self.close()
            self._gap = gap

    def values(self, read: ReadRecord) -> Looped:
        """The loop's values for every token of `read`'s plan, or why they cannot be had."""
        self._before = (self._state is None, self._gap)
        spec = read.spec
        types = {t for t in spec.spec_types if t != "none"}
        if not read.speculative or not (types or drafts_with_model(spec, read.shape.era)):
            self.skip()
            return Looped(None, "the transcript does not say how the server drafted (give its --spec-type)")
        if self._state is None:
            if self._gap and (read.cached or types & (SERVER_WIDE | PER_SLOT)):
                return Looped(None, "it continues what earlier records left on the server (the prompt cache or an "
                                    "n-gram table), and the loop was not replayed for them")
            self._state = ServerState(self.n_parallel)
        try:
            res = trace_read(read, self.target, slot_state=self._state.slot(read.rec), drafts=self.drafts,
                             renamed=self.renamed, explain=False)
        except ModelError as e:
            self.skip()
            return Looped(None, f"the loop needs the draft model: {e}")
        except SpecReplayError as e:  # a setting or drafter trace does not replay (MTP heads, -td, ...)
            self.skip()
            return Looped(None, f"the loop cannot be replayed: {e}")
        if res.first_divergence is not None:
            self.skip()
            return Looped(None, f"the loop replay parts from the transcript at token {res.first_divergence}",
                          res.draft_n, res.draft_n_accepted)
        if res.reproduced is False:
            self.skip()
            return Looped(None, f"the loop replay drafted {res.draft_n} and accepted {res.draft_n_accepted}, the "
                                f"server {res.server_draft_n} and {res.server_draft_n_accepted}: other batches"
                          + _other_drafts(read), res.draft_n, res.draft_n_accepted)
        prefix = res.prefix or FRESH
        if read.cached and (prefix.keep == 0 or prefix.rebuild):
            self.skip()
            return Looped(None, f"the server took {read.cached} prompt tokens from its cache, which the loop replay "
                                "does not hold (requests it did not replay left them)", res.draft_n,
                          res.draft_n_accepted)
        # a gap (a chat stream's speculative chunk: text without ids) stands for the loop's tokens that
        # spell it; the loop emitted the transcript's text at its chunk boundaries and its draft totals
        items = items_of_emitted([e.id for e in res.emitted], read.plan,
                                 lambda t: self.target.piece(t, special=False))
        if items is None:
            self.skip()
            return Looped(None, "the loop replay's tokens do not spell the transcript's text", res.draft_n,
                          res.draft_n_accepted)
        n = read.n_probs
        out = []
        for k, (item, e) in enumerate(zip(items, res.emitted)):
            out.append(Truth(index=k, id=e.id, item=item, logprob=e.logprob, top=list(e.top[:n]),
                             post_prob=e.post_prob if read.post else None,
                             post_top=list(e.post_top[:n]) if read.post else None))
        return Looped(out, "", res.draft_n, res.draft_n_accepted, res.server_draft_n is not None, res.schedule,
                      prefix, tuple(res.notes))


def _other_drafts(read: ReadRecord) -> str:
    """What may have drafted otherwise, where the transcript leaves it open: the draft context's thread
    count (-td) when a draft model drafts and nothing gave it. Past 256 positions a one-token decode sums
    its KV in one chunk per thread (ggml-cpu/ops.cpp:9489-9492), so the draft's probabilities, and with
    --spec-draft-p-min its draft lengths, follow the count; the totals alone cannot tell it."""
    spec = read.spec
    if not drafts_with_model(spec, read.shape.era) or draft_thread_count(spec) is not None:
        return ""
    n = thread_count(read.context)
    return (f" (the server's drafts differ: its --spec-draft-threads, not recorded, taken as -t {n}; "
            "give it with -td if it was another)")
