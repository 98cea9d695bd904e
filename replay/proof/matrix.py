"""One build of the matrix, proven on real servers: trace token-exact and recover against the build's
own unspeculated server, for each configuration (scripts/build_matrix.py runs every build; the CI
tests run the builds whose loop shape no pinned tree has)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from replay.commands.record import RequestItem, record_one
from replay.commands.recover import Recoverer
from replay.commands.trace import Drafts, trace_record
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.loop.state import SlotState
from replay.runtime.llama import Model
from replay.transcripts.entries import record_entries
from replay.transcripts.readers import read_text

SEEDS = range(1, 11)
STORY = "Once upon a time, in a small village by the sea,"
REPEAT = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, wrote the weather in "
          "his book, and watched the ships pass slowly along the dark coast until morning came. ")


@dataclass(frozen=True)
class Config:
    name: str
    types: tuple[str, ...]
    draft: bool
    sampling: str | None
    temp: float
    prompt: str
    n_predict: int
    needs_rejection: bool = False


CONFIGS = (
    Config("draft-simple greedy t0", ("draft-simple",), True, None, 0.0, STORY, 24),
    Config("draft-simple probabilistic t1", ("draft-simple",), True, "probabilistic", 1.0, STORY, 24,
           needs_rejection=True),
    Config("ngram-mod t0", ("ngram-mod",), False, None, 0.0, REPEAT * 4, 48),
    # n-gram drafts cut to n_max near the end of n_predict: b11368..b11382 verify them by rejection
    Config("ngram-simple t1", ("ngram-simple",), False, None, 1.0, REPEAT * 4, 40),
)


def _record(srv: LlamaServer, body: dict) -> dict:
    return record_one(srv.url, RequestItem("/completion", body), srv.config.flags_block())


def max_value_diff(fixed: dict, plain: dict) -> tuple[float, int]:
    """(max |recovered - unspeculated| over each token's logprob and top-N, tokens compared): two
    transcripts of the same request, compared over the tokens both runs emitted alike."""
    a = record_entries(read_text(json.dumps(fixed), "fixed")[0])
    b = record_entries(read_text(json.dumps(plain), "plain")[0])
    worst, n = 0.0, 0
    for x, y in zip(a, b):
        if x.id != y.id:
            break
        n += 1
        for u, v in [(x.logprob, y.logprob)] + [(p[2], q[2]) for p, q in zip(x.top, y.top)]:
            if u is not None and v is not None and (math.isfinite(u) or math.isfinite(v)):
                worst = max(worst, abs(u - v))
    return worst, n


def run_config(cfg: Config, bins, target: Path, draft: Path, seeds: range = SEEDS) -> dict:
    flags = dict(spec_types=cfg.types, draft_model=draft if cfg.draft else None, draft_sampling=cfg.sampling)
    spec_cfg = ServerConfig(target, **flags)
    plain_cfg = ServerConfig(target)
    bodies = [{"prompt": cfg.prompt, "n_predict": cfg.n_predict, "n_probs": 3, "temperature": cfg.temp, "seed": s,
               "cache_prompt": False} for s in seeds]
    with LlamaServer(spec_cfg, binary=bins.server) as srv:
        spec = [_record(srv, b) for b in bodies]
    with LlamaServer(plain_cfg, binary=bins.server) as ref:
        plain = [_record(ref, b) for b in bodies]
    text = "".join(json.dumps(t) + "\n" for t in spec)
    records = read_text(text, f"{cfg.name}.jsonl")
    out = {"records": len(records), "reproduced": 0, "drafted": 0, "accepted": 0, "divergences": [],
           "max_diff": None, "compared": 0, "mismatch": 0}
    model = Model(target)
    state = SlotState()  # a one-slot server: ngram-mod's table and the slot's memory live as long as it
    try:
        drafts = Drafts()
        for rec in records:
            res = trace_record(rec, model, slot_state=state, drafts=drafts)
            out["reproduced"] += bool(res.reproduced)
            out["drafted"] += res.draft_n
            out["accepted"] += res.draft_n_accepted
            out["shape"] = res.shape.describe() if res.shape else None
            # n-gram drafts verified by rejection: the b11368..b11382 q-trim path (builds/loop_shapes.py)
            out["ngram_rejection_steps"] = out.get("ngram_rejection_steps", 0) + sum(
                1 for s in res.steps if s.rule == "rejection" and (s.drafter or "").startswith("ngram"))
            if not res.reproduced:
                out["divergences"].append({"record": rec.index, "token": res.first_divergence,
                                           "draft_n": [res.draft_n, res.server_draft_n],
                                           "explanation": res.explanation.text if res.explanation else None})
        recoverer = Recoverer(model, records=records)  # in this build's own process, on its libllama
        try:
            done = [recoverer.recover(rec) for rec in records]
        finally:
            recoverer.close()
        worst = 0.0
        for d, p in zip(done, plain):
            c = d.report.summary()["counts"]
            out["mismatch"] += c["mismatch"] + c["unaligned"]
            w, n = max_value_diff(d.container, p)
            worst, out["compared"] = max(worst, w), out["compared"] + n
        out["max_diff"] = worst
    finally:
        state.close()
        model.close()
    return out
