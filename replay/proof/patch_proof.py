"""Prove a patched llama-server right: its speculative tokens carry the real probabilities.

For each speculative setup, endpoint, stream flag and probability mode, a request goes to
the patched speculating server and is recorded; then

* every emitted token must carry a real entry (not the prob-1.0 placeholder) with a full
  top-N list;
* the values must equal what `trace` predicts for the same request (the same batches, the
  same logits, so bit for bit up to float formatting: tolerance 1e-6);
* where verification is sample-and-match (every setup but probabilistic drafting) the
  tokens equal the unspeculated server's, and so must the values, within the tolerance
  `recover` established between decode schedules;

and with `n_probs` 0 the patched and unpatched speculating servers must answer the same
seeds identically (the patch must not change what is sampled).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from replay.builds.loop_shapes import shape_of_source
from replay.commands.record import RequestItem, record_one
from replay.commands.trace import Drafts, trace_record
from replay.comparison.values import DEFAULT_TOLERANCE
from replay.llamacpp.build import Binaries
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.loop.state import SlotState
from replay.runtime.llama import Model
from replay.transcripts.entries import SentEntry, record_entries
from replay.transcripts.format import ENDPOINTS, dumps
from replay.transcripts.readers import Record, read_text

TRACE_TOLERANCE = 1e-6
MODES = ("pre", "post")


@dataclass(frozen=True)
class Setup:
    """One speculating server configuration and the request it answers."""

    name: str
    model: Path
    draft: Path | None
    spec_types: tuple[str, ...]
    draft_sampling: str | None
    temp: float
    prompt: str
    n_predict: int
    n_ctx: int = 2048
    endpoints: tuple[str, ...] = ENDPOINTS

    @property
    def sample_and_match(self) -> bool:
        """Verification that emits the unspeculated server's tokens (docs/server-loop.md, fact 2)."""
        return not (self.draft_sampling == "probabilistic" and self.temp > 0)

    def server(self, speculate: bool = True) -> ServerConfig:
        if not speculate:
            return ServerConfig(self.model, n_ctx=self.n_ctx)
        return ServerConfig(self.model, draft_model=self.draft, spec_types=self.spec_types,
                            draft_sampling=self.draft_sampling, n_ctx=self.n_ctx)

    def body(self, endpoint: str, seed: int, *, stream: bool, mode: str | None, n_probs: int) -> dict:
        b: dict = {"seed": seed, "temperature": self.temp, "stream": stream}
        if endpoint == "/v1/chat/completions":
            b.update(messages=[{"role": "user", "content": self.prompt}], max_tokens=self.n_predict)
            if n_probs:
                b.update(logprobs=True, top_logprobs=n_probs)
        elif endpoint == "/v1/completions":
            b.update(prompt=self.prompt, max_tokens=self.n_predict)
            if n_probs:
                b.update(logprobs=n_probs)
        else:
            b.update(prompt=self.prompt, n_predict=self.n_predict, n_probs=n_probs)
        if mode == "post":
            b["post_sampling_probs"] = True
        return b


REPEAT = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, wrote the weather in "
          "his book, and watched the ships pass slowly along the dark coast until morning came. ")


def default_setups(smollm2: Path, smollm2_draft: Path, tiny: Path, tiny_draft: Path) -> list[Setup]:
    """The setups the issue names, on SmolLM2 (with a Q2_K copy as a disagreeing draft) and the tiny fixture."""
    story = "Once upon a time, in a small village by the sea,"
    return [
        Setup("smol draft-simple greedy t0", smollm2, smollm2_draft, ("draft-simple",), None, 0.0, story, 24),
        Setup("smol draft-simple greedy t1", smollm2, smollm2_draft, ("draft-simple",), None, 1.0, story, 24),
        Setup("smol draft-simple probabilistic t1", smollm2, smollm2_draft, ("draft-simple",), "probabilistic",
              1.0, story, 24),
        Setup("smol ngram-mod t0", smollm2, None, ("ngram-mod",), None, 0.0, REPEAT * 4, 32),
        Setup("tiny draft-simple greedy t0", tiny, tiny_draft, ("draft-simple",), None, 0.0, "bcdbc", 16, 256,
              ("/v1/completions", "/completion")),
        Setup("tiny draft-simple greedy t1", tiny, tiny_draft, ("draft-simple",), None, 1.0, "bcdbc", 16, 256,
              ("/v1/completions", "/completion")),
        Setup("tiny draft-simple probabilistic t1", tiny, tiny_draft, ("draft-simple",), "probabilistic", 1.0,
              "bcdbc", 16, 256, ("/v1/completions", "/completion")),
    ]


@dataclass
class Row:
    """One line of the verification table."""

    setup: str
    check: str  # "values" | "n_probs=0"
    endpoint: str
    stream: bool | None
    mode: str | None
    seeds: int = 0
    tokens: int = 0
    real: int = 0  # tokens with a real entry and a full top-N list
    vs_trace: float = 0.0  # max |logprob difference| against trace's prediction
    vs_plain: float | None = None  # same against the unspeculated server (None: not comparable)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and (self.check != "values" or self.real == self.tokens > 0)

    def to_json(self) -> dict:
        return {"setup": self.setup, "check": self.check, "endpoint": self.endpoint, "stream": self.stream,
                "mode": self.mode, "seeds": self.seeds, "tokens": self.tokens, "real": self.real,
                "max_diff_vs_trace": self.vs_trace, "max_diff_vs_unspeculated": self.vs_plain,
                "passed": self.passed, "problems": self.problems}


def _record(srv: LlamaServer, setup: Setup, endpoint: str, body: dict) -> Record:
    t = record_one(srv.url, RequestItem(endpoint, body), srv.config.flags_block())
    return read_text(dumps(t), f"{setup.name} {endpoint}")[0]


def _diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def _compare(got: list[SentEntry], want: list[tuple[int, float, list[tuple[int, float]]]]) -> tuple[float, list[str]]:
    """Largest logprob difference between entries and (id, logprob, top) predictions, and what did not match."""
    worst, problems = 0.0, []
    if len(got) != len(want):
        return math.inf, [f"{len(got)} entries for {len(want)} tokens"]
    for k, (g, (tid, lp, top)) in enumerate(zip(got, want)):
        if g.id is not None and g.id != tid:
            problems.append(f"token {k}: id {g.id}, expected {tid}")
            continue
        worst = max(worst, _diff(g.logprob, lp))
        ids = [t[0] for t in g.top]
        if any(i is not None for i in ids) and ids != [i for i, _ in top]:
            problems.append(f"token {k}: top ids {ids}, expected {[i for i, _ in top]}")
            continue
        if len(g.top) != len(top):
            problems.append(f"token {k}: {len(g.top)} alternatives, expected {len(top)}")
            continue
        for (_, _, glp), (_, wlp) in zip(g.top, top):
            worst = max(worst, _diff(glp, wlp))
    return worst, problems


def check_values(patched: Binaries, plain: Binaries, setups: list[Setup], *, seeds: range, tree: Path,
                 n_probs: int = 5, progress: Callable[[str], None] | None = None) -> list[Row]:
    """The value checks: patched speculating server vs trace (replaying the loop shape of `tree`, the
    source the server was built from: builds/loop_shapes.py) vs unspeculated server."""
    rows: list[Row] = []
    models: dict[Path, Model] = {}
    try:
        for setup in setups:
            if setup.model not in models:
                models[setup.model] = Model(setup.model)
            target = models[setup.model]
            drafts = Drafts()
            with LlamaServer(setup.server(), binary=patched.server) as srv, \
                    LlamaServer(setup.server(speculate=False), binary=plain.server) as ref:
                if progress:
                    progress(f"{setup.name}: servers on {srv.kernels.describe()}")
                slot_state = SlotState()  # one slot: ngram-mod's table and the slot's memory live as long as the server
                for endpoint in setup.endpoints:
                    for stream in (False, True):
                        for mode in MODES:
                            row = Row(setup.name, "values", endpoint, stream, mode)
                            if progress:
                                progress(f"{setup.name}: {endpoint} {'stream' if stream else 'non-stream'} {mode}")
                            for seed in seeds:
                                body = setup.body(endpoint, seed, stream=stream, mode=mode, n_probs=n_probs)
                                _check_one(row, setup, _record(srv, setup, endpoint, body), target, slot_state,
                                           drafts, ref, body, tree)
                            row.seeds = len(seeds)
                            rows.append(row)
                slot_state.close()
    finally:
        for m in models.values():
            m.close()
    return rows


def _check_one(row: Row, setup: Setup, rec: Record, target: Model, slot_state: SlotState, drafts: Drafts,
               ref: LlamaServer, body: dict, tree: Path) -> None:
    res = trace_record(rec, target, slot_state=slot_state, drafts=drafts, source=tree)
    seed = body["seed"]
    if not res.reproduced:
        row.problems.append(f"seed {seed}: trace did not reproduce the server (token {res.first_divergence})")
        return
    got = record_entries(rec)
    emitted = res.emitted
    if rec.stream and len(got) == len(emitted) - 1 and target.is_eog(emitted[-1].id):
        emitted = emitted[:-1]  # a stream sends no chunk, hence no entry, for the final end-of-generation token
    post = row.mode == "post"
    row.tokens += len(emitted)
    row.real += sum(1 for g, e in zip(got, emitted)
                    if not g.is_placeholder and len(g.top) == len(e.post_top if post else e.top))
    if post:
        want = [(e.id, _log(e.post_prob), [(i, _log(p)) for i, p in e.post_top]) for e in emitted]
    else:
        want = [(e.id, e.logprob, list(e.top)) for e in emitted]
    worst, problems = _compare(got, want)
    row.vs_trace = max(row.vs_trace, worst)
    if worst > TRACE_TOLERANCE:
        problems.append(f"differs from trace by {worst:.3g}")
    row.problems += [f"seed {seed}: {p}" for p in problems]
    if not setup.sample_and_match:
        return
    ref_rec = _record(ref, setup, rec.endpoint, body)
    ref_got = record_entries(ref_rec)
    if [g.id for g in ref_got] != [g.id for g in got]:
        row.problems.append(f"seed {seed}: tokens differ from the unspeculated server's")
        return
    worst, problems = _compare(got, [(r.id, r.logprob, [(t[0], t[2]) for t in r.top]) for r in ref_got])
    row.vs_plain = max(row.vs_plain or 0.0, worst)
    if worst > DEFAULT_TOLERANCE:
        problems.append(f"differs from the unspeculated server by {worst:.3g}")
    row.problems += [f"seed {seed}: {p}" for p in problems]


def check_no_probs(patched: Binaries, unpatched: Binaries, setups: list[Setup], *, seeds: range,
                   progress: Callable[[str], None] | None = None) -> list[Row]:
    """With n_probs 0 the patched and unpatched servers must answer identically, seed for seed."""
    rows = []
    for setup in setups:
        if progress:
            progress(f"{setup.name}: n_probs 0, patched vs unpatched")
        row = Row(setup.name, "n_probs=0", "/completion", False, None, seeds=len(seeds))
        answers = []
        for binaries in (patched, unpatched):
            with LlamaServer(setup.server(), binary=binaries.server) as srv:
                out = []
                for seed in seeds:
                    body = setup.body("/completion", seed, stream=False, mode=None, n_probs=0)
                    r = record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())["response"]
                    t = r.get("timings") or {}
                    out.append((r.get("tokens"), r.get("content"), t.get("draft_n"), t.get("draft_n_accepted")))
                answers.append(out)
        for seed, a, b in zip(seeds, *answers):
            row.tokens += len(a[0] or [])
            if a != b:
                row.problems.append(f"seed {seed}: patched and unpatched servers answered differently")
        rows.append(row)
    return rows


def table(rows: list[Row]) -> list[list]:
    """Rows for tabulate."""
    out = []
    for r in rows:
        out.append([r.setup, r.check, r.endpoint, "" if r.stream is None else ("stream" if r.stream else "-"),
                    r.mode or "", r.seeds, r.tokens, f"{r.real}/{r.tokens}" if r.check == "values" else "",
                    f"{r.vs_trace:.1e}" if r.check == "values" else "",
                    "" if r.vs_plain is None else f"{r.vs_plain:.1e}",
                    "pass" if r.passed else "FAIL: " + "; ".join(r.problems[:2])])
    return out


HEADERS = ["setup", "check", "endpoint", "stream", "mode", "seeds", "tokens", "real", "|Δ| trace",
           "|Δ| unspec.", "verdict"]


def pinned_tree(profile: str) -> Path:
    """The unpacked pinned source of a profile (fetched and unpacked, not built, on first use)."""
    from replay.llamacpp.build import unpack_source
    return unpack_source(profile)


def saved_patch(diff: str, name: str) -> Path:
    """The patch stored under the cache by content, so a build keyed by it finds it again."""
    import hashlib

    from replay.paths import cache_root
    d = cache_root() / "patches"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}-{hashlib.sha256(diff.encode()).hexdigest()[:12]}.patch"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(diff, encoding="utf-8")
        tmp.replace(path)
    return path


def verify_server_patch(source: Path | None, profile: str, *, seeds: range, log: Callable[[str], None] | None = None,
                        progress: Callable[[str], None] | None = None) -> tuple[str, list[Row]]:
    """Build the unpatched and patched server of `source` (or of the pinned `profile` tree)
    and run every check; returns the recognised code shape and the table rows."""
    from replay.llamacpp import models
    from replay.llamacpp.build import BuildSpec, ensure_built
    from replay.llamacpp.libllama import libllama_of
    from replay.proof.patches import server_patch
    from replay.runtime.binding import use_libllama
    tree = Path(source) if source is not None else pinned_tree(profile)
    patch = server_patch(tree)
    path = saved_patch(patch.diff, f"server-{patch.profile}")
    base = BuildSpec(profile, source_dir=source)
    unpatched = ensure_built(base, log=log)
    patched = ensure_built(BuildSpec(profile, source_dir=source, patch=path), log=log)
    # trace's predictions on the build's own kernels, unless this process already holds a libllama
    use_libllama(libllama_of(unpatched), strict=False)
    setups = default_setups(models.smollm2(), models.smollm2_draft(unpatched.quantize),
                            models.tiny_target(), models.tiny_draft())
    if not shape_of_source(tree)[0].rejection:  # no --spec-draft-sampling before b11368 (builds/loop_shapes.py)
        setups = [s for s in setups if s.draft_sampling is None]
    rows = check_values(patched, unpatched, setups, seeds=seeds, tree=tree, progress=progress)
    rows += check_no_probs(patched, unpatched, setups, seeds=range(1, 11), progress=progress)
    return patch.profile, rows
