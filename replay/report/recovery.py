"""What recover found, per record: the data of the report (rendered by cli/render.py), and the report
as its `--report` JSON file (`write_report`). Each token's verdict is a TokenReport (comparison/values.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from replay.comparison.bounds import APPROXIMATE_DRIFT, BATCH_BOUND, FIRST_ENTRY_BOUND
from replay.comparison.judgement import wrong_everywhere
from replay.comparison.values import RECOVERED, STATUSES, TokenReport
from replay.errors import Exit
from replay.report import schema as report_json
from replay.report.schema import REPORT_FORMAT, REPORT_VERSION
from replay.schedule.rows import split_kv
from replay.transcripts.files import write_atomic


@dataclass
class RecordReport:
    source: str
    record: int
    endpoint: str
    stream: bool
    field_kind: str  # "logprob" (pre-sampling) or "prob" (post_sampling_probs), as the server sent them
    n_probs: int
    tokens: list[TokenReport] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)  # gaps that no token row can show
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # KV positions kept from the previous record (schedule/prefix.py plan_prefix)
    prefix: str = "fresh"  # how: "fresh", "shared prefix", "server cache" or "server cache (rebuilt)"
    prefix_note: str | None = None  # prefix.Prefix.note: why the server's cache state could not be rebuilt exactly
    settings: list[tuple[str, Any, str]] = field(default_factory=list)  # (setting, value, where it came from)
    slots: int | None = None  # the server's slots (None: not known)
    shape: Any = None  # builds/loop_shapes.py Shape: the server's loop shape, and why
    replay_backend: str = "CPU"  # runtime/backend.py: what this replay computed on
    libllama: str | None = None  # runtime/binding.py: the libllama file it computed with (None: the binding's own)
    server_backend: str = "CPU"  # runtime/backend.py: what the server computed on, as far as we know
    kernels: str | None = None  # why the server's kernels are not the replay's (None: the same kind)
    cpu: dict | None = None  # runtime/engine.py KernelChoice.to_json(): the CPU variant replayed on, and how chosen
    cause: str | None = None  # comparison/judgement.py numerics_cause: why its values may differ from a one-request replay
    cause_kind: str | None = None  # comparison/judgement.py numerics_kind: the same, named (numerics.cause)
    weighted_diff: float | None = None  # comparison/judgement.py judge_numerics: weighted |server - true| of the real values
    first_diff: float | None = None  # the same of the first real entry alone (comparison/judgement.py Disagreement)
    batched: bool = False  # the real values' disagreement was judged to be numerics (batches, kernels)
    shared: bool = False  # evidence (or --shared-batches) that its batches were shared: approximate, whatever its entries say
    bound: float = BATCH_BOUND  # the bound it was judged within (RecoverOptions.batch_bound)
    judged_by: str | None = None  # "evidence" (the transcript shows the cause) or "option" (--shared-batches, --server-backend)
    schedule: dict | None = None  # schedule/memory.py schedule_of: the prompt batches and checkpoints replayed
    identity: list[dict] = field(default_factory=list)
    model_file: str | None = None  # the -m file's name  # reading/identity.py: the model evidence compared with -m
    drafting_known: bool = True  # something (flags, generation_settings, our --spec-type) said how the server drafted
    build_undecided: str | None = None  # why the build replayed is a default, not evidence's (run/build_choice.py)

    def approximation(self) -> tuple[float | None, str] | None:
        """Whether this record's values are approximate, as (bound, why), else None: the one place the
        report says "approximate" (numerics.approximate, numerics.bound, numerics.approximate_why). The
        bound holds by construction: the spread of the kernel classes no evidence told apart (run/kernels/
        processes.py value_spread), the equal kernels' decode spread, the judged bound of shared batches
        or other numerics (comparison/judgement.py), or the drift real entries were held to (APPROXIMATE_DRIFT).
        None as the bound: none could be measured (the exit code says so: Exit.APPROXIMATE).

        >>> RecordReport("f", 1, "/completion", False, "logprob", 1).approximation() is None
        True
        >>> RecordReport("f", 1, "/completion", False, "logprob", 1, cpu={"how": "default", "bounds": {"1": 0.03},
        ...     "why": "no real entry"}).approximation()
        (0.03, "the CPU kernels are undecided (no real entry): the bound is how far the kernel classes left open compute it apart; --server-cpu with the server machine's CPU makes it exact")
        """
        cpu = self.cpu or {}
        if cpu.get("how") in ("default", "unknown") and cpu.get("bounds"):
            build = f"; the build is the default, not evidence's ({self.build_undecided})" if self.build_undecided else ""
            return (cpu["bounds"].get(str(self.record)),
                    f"the CPU kernels are undecided ({cpu.get('why')}): the bound is how far the kernel classes "
                    f"left open compute it apart{build}; --server-cpu with the server machine's CPU makes it exact")
        if self.build_undecided:
            return None, f"the build is undecided ({self.build_undecided})"
        if self.batched or self.shared:
            return self.bound, f"judged within the bound of {self.cause or 'shared batches'}"
        approx = (self.schedule or {}).get("approximate_from")
        if approx is not None:
            return APPROXIMATE_DRIFT, (f"values from token {approx} on come from batches this replay does not "
                                       "reproduce; real entries held within the drift")
        if cpu.get("how") == "matched" and cpu.get("decode_spread"):
            return cpu["decode_spread"], "kernels equal on the first entry decode the tokens after it apart"
        return None

    def summary(self) -> dict[str, Any]:
        counts = {s: 0 for s in STATUSES}
        for t in self.tokens:
            counts[t.status] += 1
        true = [t.true_logprob for t in self.tokens if t.true_logprob is not None]
        server = [t.server_logprob for t in self.tokens if t.server_logprob is not None]
        real = [abs(t.server_logprob - t.true_logprob) for t in self.tokens
                if t.status in ("ok", "mismatch") and t.server_logprob is not None and t.true_logprob is not None]
        mean = lambda xs: (sum(xs) / len(xs)) if xs else None  # noqa: E731
        mt = mean(true)
        return {
            "tokens": len(self.tokens), "counts": counts,
            "server_mean_logprob": mean(server), "true_mean_logprob": mt,
            "true_perplexity": math.exp(-mt) if mt is not None else None,
            "max_abs_diff_real": max(real) if real else None,
            "field_kind": self.field_kind,
        }

    @property
    def recovered(self) -> bool:
        return self.error is None and all(t.status in RECOVERED for t in self.tokens)

    def _judgement(self) -> dict:
        """numerics' cause, why and judged_by (where the values were judged or the batches shared), and
        whether they are approximate, within what bound and why (approximation)."""
        said = self.batched or self.shared
        approx = self.approximation()
        return {"cause": self.cause_kind if said else None, "why": self.cause if said else None,
                "judged_by": self.judged_by if said else None, "approximate": approx is not None,
                "bound": approx[0] if approx else None, "approximate_why": approx[1] if approx else None}

    def to_json(self) -> dict:
        d = {"source": self.source, "record": self.record, "endpoint": self.endpoint, "stream": self.stream,
             "field_kind": self.field_kind, "n_probs": self.n_probs, "prompt_tokens": self.prompt_tokens,
             "reused_prompt_tokens": self.reused_prompt_tokens, "prefix": self.prefix, "schedule": self.schedule,
             "settings": [{"setting": k, "value": v, "source": src} for k, v, src in self.settings],
             "loop_shape": None if self.shape is None else self.shape.to_json(),
             "numerics": {"slots": self.slots, "replay_backend": self.replay_backend, "libllama": self.libllama,
                          "server_backend": self.server_backend, "kernels": self.kernels, "cpu": self.cpu,
                          "weighted_mean_diff_real": self.weighted_diff,
                          "weighted_diff_first_entry": self.first_diff,
                          **self._judgement()},
             "model": {"file": self.model_file, "compared": self.identity},
             "tokens": [t.to_json() for t in self.tokens], "summary": self.summary()}
        if self.error:
            d["error"] = self.error
        if self.notes:
            d["notes"] = self.notes
        return d


@dataclass
class RecoverResult:
    """What `recover()` returns: one report per record, and the repaired file text."""

    records: list[RecordReport]
    repaired: str

    @property
    def ok(self) -> bool:
        return all(r.recovered for r in self.records) and self._failure() is None

    def summary(self) -> dict[str, Any]:
        counts = {s: 0 for s in STATUSES}
        for r in self.records:
            for k, v in r.summary()["counts"].items():
                counts[k] += v
        diffs = [r.summary()["max_abs_diff_real"] for r in self.records]
        diffs = [d for d in diffs if d is not None]
        return {"records": len(self.records), "counts": counts, "max_abs_diff_real": max(diffs) if diffs else None,
                "prompt_tokens": sum(r.prompt_tokens for r in self.records),
                "reused_prompt_tokens": sum(r.reused_prompt_tokens for r in self.records)}

    def to_json(self) -> dict:
        out = {"format": REPORT_FORMAT, "version": REPORT_VERSION,
               "records": [r.to_json() for r in self.records], "summary": self.summary()}
        failure = self._failure()
        if failure is not None:
            out["failure"] = {"line": failure[0], "detail": failure[1]}
        return out

    def failure(self) -> str | None:
        """One short line saying why not everything was recovered, with the likely causes, or None."""
        f = self._failure()
        return None if f is None else f[0]

    def failure_code(self) -> int:
        """The exit code of a failure: 3 (Exit.ERROR) when a record could not be replayed at all, 1
        (Exit.FAILED) when the replay disagrees with the server (a value, or generated text this model's
        pieces do not spell: an unaligned token)."""
        unreplayed = [r for r in self.records if r.error and not any(t.status == "unaligned" for t in r.tokens)]
        return Exit.ERROR if unreplayed else Exit.FAILED  # text this model does not spell: a disagreement

    def failure_detail(self) -> str | None:
        """The longer explanation behind failure() (`-v` and `--json` show it), or None."""
        f = self._failure()
        return None if f is None else f[1]

    def _failure(self) -> tuple[str, str] | None:
        # where something let numerics explain a disagreement (evidence or an option), the transcript's first
        # entries are judged together: a model every one of them is far from is not the server's
        lenient = [r for r in self.records if r.cause is not None]
        wrong = wrong_everywhere([r.first_diff for r in self.records if r.first_diff is not None]) if lenient else None
        if wrong:
            return wrong, (f"{wrong}; its real values were judged against {lenient[0].cause}, which moves a first "
                           f"entry by at most {FIRST_ENTRY_BOUND} nats, but none of the {len(self.records)} "
                           "record(s) is that close (docs/recover.md, \"A wrong model file\")")
        for r in self.records:
            if r.error:
                line = f"{r.source}, record {r.record}: {r.error}"
                return line, line
        for r in self.records:
            approx = r.approximation() if r.recovered else None
            if approx is not None and approx[0] is None:
                line = (f"{r.source}, record {r.record}: its values are approximate and no bound could be measured "
                        f"({approx[1]}): give --server-cpu with the server machine's CPU (its model name, /proc/cpuinfo "
                        "flags line or llama-server's system_info line) and --build N")
                return line, line
        bad = [(r, t) for r in self.records for t in r.tokens if t.status in ("mismatch", "unaligned")]
        if not bad:
            return None
        r, t = bad[0]
        short = "model file, build or context settings not the server's?"
        why = "the replay does not match this server's numerics (model file, build, or context settings)"
        if r.weighted_diff is not None and r.cause is not None:
            short = f"{r.weighted_diff:.3f} nats, more than {r.cause} explain: model file or build not the server's?"
            why = (f"they differ by {r.weighted_diff:.3f} nats (weighted by probability, first entry or "
                   f"record), more than other numerics ({r.cause}) explain: the model file or the build is "
                   "not the server's")
        elif r.weighted_diff is not None and r.weighted_diff <= BATCH_BOUND:
            # the hints this record's evidence supports: its build's own kernels where they are not at hand,
            # shared batches and kept cells only where the server had several slots (or the transcript does not say), else a GPU
            hints = []
            if r.shape is not None and r.shape.warning and "does not say which build" in r.shape.warning:
                # the evidence's first cause: the transcript names no build, and none here was found to be its
                hints.append("the transcript names no build: give --build N, the server's (llama-server --version)")
            if r.cpu is None and r.shape is not None and r.shape.build is not None and \
                    (r.libllama is None or "llama_cpp" in str(r.libllama)):
                hints.append(f"`spec-replay build --build b{r.shape.build}` (its own kernels are not built here)")
            if r.slots is None or r.slots > 1:  # several slots, or a transcript that does not say
                hints += ["--shared-batches if it decoded these requests beside others",
                          "the server's --cache-ram 0 if so"]
            if not hints:
                hints.append("-ngl/-dev or --server-backend if the server computed on a GPU")
            short = f"{r.weighted_diff:.3f} nats: " + "; ".join(hints)
            why += (f"; they differ by {r.weighted_diff:.3f} nats, as other kernels or other requests' rows or "
                    "cells would: if the server ran on a GPU or another CPU, say so with -ngl/-dev or "
                    "--server-backend; if it decoded these requests together with others (several slots serving "
                    "at once), with --shared-batches; if it kept idle slots' cells in a unified cache (several "
                    "slots with --cache-ram 0 or --no-cache-idle-slots), give those flags")
        beyond = r.weighted_diff is not None and r.weighted_diff > r.bound  # farther than any numerics go
        if r.cpu and r.cpu.get("how") == "given" and not beyond:
            short = f"--server-cpu {r.cpu['variant']} is not the server's kernels (leave it out to find them)"
            why = (f"the {r.cpu['variant']} CPU kernels given with --server-cpu are not the server's: without it the "
                   "kernels are found from the transcript's first entry")
        elif r.cpu and r.cpu.get("how") == "matched" and r.cpu.get("record") is not None \
                and r.cpu["record"] + 1 != r.record:
            short += f"; kernels matched on record {r.cpu['record'] + 1}: if this one is from another machine, recover it apart"
            why += (f"; record {r.cpu['record'] + 1}'s first entry matched the {r.cpu['variant']} kernels: this record "
                    "may come from another machine (recover it separately)")
        threads = (r.schedule or {}).get("threads") or {}
        split = ((r.schedule or {}).get("rows") or {}).get("alone_split", 0)
        # a real entry after the first is a one-token decode's: one past 256 positions that agreed before this
        # token shows the thread count right, and a verify batch between them is where the values part
        counted = [x for x in r.tokens[1:t.index] if x.status == "ok" and split_kv(r.prompt_tokens + x.index - 1)]
        batch = counted and any(x.status == "placeholder" for x in r.tokens[counted[-1].index:t.index])
        if not beyond and t.index > 0 and batch and not r.drafting_known:
            short = (f"values part after a verify batch whose rows this replay did not rebuild: give the server's "
                     f"--spec-type (n-gram drafts of 63+ tokens verify in 64-row tiled batches)")
            why += (f"; its one-token values past 256 positions agreed up to token {counted[-1].index}, then a "
                    "verify batch came, and after it they disagree: a batch this replay computed row by row that "
                    "the server computed otherwise (a draft of 63 tokens or more verifies in a batch of 64 rows or "
                    "more, tile by tile: ggml-cpu ops.cpp:9545-9566); give the server's --spec-type (and -md) so "
                    "that recover replays its loop")
        elif not beyond and t.index > 0 and split and threads.get("source") in ("default", "identified"):
            how = "assumed" if threads.get("source") == "default" else "found from its first such value"
            short = (f"the server's -t? {split} real value(s) came from one-token decodes past 256 positions, "
                     f"which its thread count changes: give --threads N ({threads.get('value')} {how})")
            why += (f"; {split} of its real values came from one-token decodes over 512 KV cells or more, which "
                    "ggml-cpu splits by thread (the values depend on the server's -t), and the transcript does "
                    f"not record -t: {threads.get('value')} was {how}"
                    + (f" (so were {threads['candidates'][1:]}: they cut that KV alike)"
                       if len(threads.get("candidates") or ()) > 1 else "")
                    + "; give --threads N, the server's")
        # beyond what numerics explain, no cache or tolerance hint would make it right: the model line stands
        if not beyond and r.prefix == "server cache":
            short = "its values depend on the server's prompt cache: keep the file in request order, one slot"
            why = (f"this record's values depend on the server's prompt cache ({r.reused_prompt_tokens} tokens), "
                   "rebuilt from the previous record: keep the file in request order, one server slot")
        elif not beyond and r.prefix == "server cache (rebuilt)":
            short = ((r.prefix_note or "part of its prompt came from a server cache this file does not show")
                     + "; --tolerance 0.3 accepts it")
            why = ((r.prefix_note or "the server took part of this prompt from a cache this file does not show")
                   + "; --tolerance 0.3 accepts the difference and keeps the server's real values as sent")
        head = f"{len(bad)} token(s) disagree with the server's real values ({r.source}#{r.record} token {t.index})"
        return (f"{head}: {short}",
                f"{len(bad)} token(s) disagree with real values the server sent (first: {r.source}, record "
                f"{r.record}, token {t.index}, {t.note}); {why}")


def write_report(report_file: str | None, res: RecoverResult, force: bool) -> bool:
    """--report: recover's report as JSON (docs/report-format.md), written whole or not at all
    (transcripts/files.py write_atomic); whether a file was written."""
    if report_file:
        write_atomic(report_file, report_json.dumps(res.to_json(), indent=2) + "\n", force=force)
    return bool(report_file)
