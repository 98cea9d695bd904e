"""What the field grids (test_field.py: SmolLM2, test_gemma.py: Gemma 3) ask of a speculative
transcript recorded live, next to the same request to an unspeculated server with the same model
and flags."""
from __future__ import annotations

import json
import math
from pathlib import Path

from cli_helpers import run

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import LlamaServer
from replay.schedule.rows import split_kv
from replay.transcripts.entries import sent_entries
from replay.transcripts.format import dumps, stream_objects

TOL = 5e-4


def entries(t: dict):
    if t["stream"]:
        return sent_entries(t["endpoint"], events=stream_objects(t))
    return sent_entries(t["endpoint"], t["response"])


def record(srv: LlamaServer, endpoint: str, body: dict, snapshot: dict | None = None) -> dict:
    return record_one(srv.url, RequestItem(endpoint, body), srv.config.flags_block(), snapshot=snapshot)


def check_recovered(spec: dict, plain: dict, model: Path, tmp_path: Path, case: str, *,
                     spec_args: tuple = (), concurrent: bool = False, drift: float = TOL,
                     min_same: int = 8, trace_args: tuple = ()) -> dict:
    """recover the speculative transcript; its values must be the plain server's wherever the two
    runs emitted the same tokens. Where they part (a draw near a boundary that the speculating
    server's own numerics moved: its KV is built by verify batches), tracing the plain transcript
    with the speculative flags must part at the same token and explain it by numerics. The few real
    values the speculating server sent after its first token (tokens sampled outside its loop) are
    its own, computed on KV its verify batches built, and kept as sent: they must be within `drift`
    of the plain server's, and, where they are not within the tolerance, be trace's (run with
    `trace_args`), which decodes those batches. Returns the record's JSON report."""
    src = tmp_path / f"{case}.json"
    src.write_text(dumps(spec))
    out = tmp_path / f"{case}.repaired.json"
    # a record of concurrent requests saved on its own shows nothing of the others (no /slots snapshot taken
    # while they ran, no record beside it to overlap in time): its user says so with --shared-batches
    r = run("recover", src, "-m", model, "-o", out, "--json", *(("--shared-batches",) if concurrent else ()))
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)["records"][0]
    assert rep["numerics"]["judged_by"] in (None, "option"), rep["numerics"]
    c = rep["summary"]["counts"]
    assert c["mismatch"] == c["unaligned"] == 0 and "error" not in rep, rep.get("error") or rep["notes"]
    assert c["placeholder"] + c["missing"] > 0, "nothing was speculated: the case proves nothing"
    if rep["numerics"]["cause"] is not None:
        assert concurrent and rep["numerics"]["weighted_mean_diff_real"] <= 0.25
    fixed, truth = aligned(entries(json.loads(out.read_text())), entries(plain))
    same, worst, kept = compare_filled(fixed, truth, rep, concurrent=concurrent)
    if same < min(len(fixed), len(truth)) and not concurrent:
        tr = trace(plain, model, tmp_path, f"{case}-plain", *spec_args)[0]
        assert tr["divergence"] and tr["divergence"]["cause"] == "numerics", (same, tr["divergence"])
        print(f"\n{case}: the runs part at token {same}: {tr['divergence']['text']}")
    # concurrent: shared batches move the draws, so the runs may part at any token; the callers trace each
    # record and assert it is reproduced or its parting explained by numerics (test_field, test_gemma)
    assert same >= min_same or concurrent, f"only {same} tokens in common with the unspeculated run"
    if concurrent:  # and every filled value before the parting is compared
        filled_idx = {t["index"] for t in rep["tokens"] if t["status"] in ("placeholder", "missing")}
        compared = sum(1 for k in range(same) if k in filled_idx)
        assert compared > 0 or same <= 1, f"{case}: {same} tokens in common and no filled value among them"
    assert worst <= TOL, f"{case}: recover vs unspeculated server: max |diff| {worst:.2e}"
    if kept > TOL:  # the server's own values: trace, which decodes its verify batches, must give them
        assert kept <= drift, f"{case}: the speculating server's own later values vs unspeculated: {kept:.2e}"
        assert trace_args, f"{case}: later real values {kept:.2e} off, and no trace to say why"
        tr = trace(spec, model, tmp_path, f"{case}-kept", *trace_args)[0]
        off = traced_real_values(tr, spec)
        assert off <= TOL, f"{case}: the server's later real values are not trace's either ({off:.2e})"
        print(f"\n{case}: later real values {kept:.2e} from the unspeculated server's, {off:.2e} from trace's")
    print(f"\n{case}: max |recovered - unspeculated| {worst:.2e} over {same} tokens")
    rep["compared_with_unspeculated"] = same
    return rep


def compare_filled(fixed: list, truth: list, rep: dict, *, concurrent: bool = False) -> tuple[int, float, float]:
    """(tokens the two runs share, max |diff| of the values recover filled and of the first token,
    max |diff| of the speculating server's later real values) between a repaired transcript's entries
    and the unspeculated server's, up to where their tokens part; concurrent: the real values are
    the server's, batched with other requests, and are not compared. An unspeculated server is the
    truth only where the schedule changes no value: a token scored by a row at position 256 or later
    (512 KV cells or more) was computed by the speculating server in a verify batch, which one-token
    decodes split by thread do not reproduce; those are compared with the patched server's in
    tests/test_schedule_live.py, not here."""
    ids_f, ids_t = [f.id for f in fixed], [t.id for t in truth]
    same = next((k for k, (a, b) in enumerate(zip(ids_f, ids_t)) if a != b), min(len(ids_f), len(ids_t)))
    filled = {t["index"] for t in rep["tokens"] if t["status"] in ("placeholder", "missing")}
    worst = kept = 0.0
    for k, (f, t) in enumerate(zip(fixed[:same], truth[:same])):
        if concurrent and k not in filled:
            continue
        if k > 0 and split_kv(rep["prompt_tokens"] + k - 1):
            continue
        assert f.kind == t.kind and [x[0] for x in f.top] == [x[0] for x in t.top], (k, k in filled, f, t)
        for a, b in [(f.logprob, t.logprob)] + [(x[2], y[2]) for x, y in zip(f.top, t.top)]:
            if math.isfinite(a) or math.isfinite(b):
                if k in filled or k == 0:
                    worst = max(worst, abs(a - b))
                else:
                    kept = max(kept, abs(a - b))
    return same, worst, kept


def traced_real_values(tr: dict, spec: dict) -> float:
    """The largest |server - trace| over the real values a speculating server sent after its first
    token (the token's and its alternatives', matched by id), up to trace's first divergence."""
    worst = 0.0
    upto = tr["first_divergence"] if tr["first_divergence"] is not None else len(tr["emitted"])
    for k, (e, s) in enumerate(zip(tr["emitted"][:upto], entries(spec)[:upto])):
        if k == 0 or not s.top or s.id != e["id"]:
            continue
        post = s.kind == "prob"
        ours = {x["id"]: x["logprob"] for x in e["post_top" if post else "top"]}
        mine = math.log(e["post_prob"]) if post else e["logprob"]
        pairs = [(s.logprob, mine)] + [(lp, ours[i]) for i, _, lp in s.top if i in ours]
        worst = max([worst] + [abs(a - b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)])
    return worst


def aligned(fixed: list, truth: list) -> tuple[list, list]:
    """The repaired file holds entries for tokens the server held back (they ended inside a UTF-8
    character, so it sent nothing for them): drop those to line the two up."""
    out, j = [], 0
    for i, t in enumerate(truth):
        # an inserted entry (its text may be the valid start of a character the next token completes):
        # the entries after it line up with the truth's from here on, for as far as both go (up to 3);
        # where only the next one does, the two runs parted by chance (measured: a Gemma 3 chat whose
        # speculative run drew ' is' ' always' where the unspeculated one drew ' always' ' sleeps')
        while j + 1 < len(fixed) and fixed[j].id != t.id and all(
                f.id == u.id for f, u in zip(fixed[j + 1:j + 4], truth[i:i + 3])):
            j += 1
        # a held-back token's entry carries no whole character: "" for a cut-off lead, U+FFFD for a lone
        # continuation byte (the server's own rule for an entry's text: transcripts/utf8.py sent_text)
        while j < len(fixed) and fixed[j].id != t.id and not fixed[j].token.strip("\ufffd") and t.token != "":
            j += 1
        if j == len(fixed):
            break
        out.append(fixed[j])
        j += 1
    return out, truth[:len(out)]


def trace(spec: dict | list[dict], model: Path, tmp_path: Path, case: str, *extra: str) -> list[dict]:
    src = tmp_path / f"{case}.trace.jsonl"
    src.write_text("".join(dumps(t, indent=None) + "\n" for t in (spec if isinstance(spec, list) else [spec])))
    r = run("trace", src, "-m", model, "--json", *extra)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    d = json.loads(r.stdout)
    return d["records"] if "records" in d else [d]


def spec_args(draft: Path) -> tuple[str, ...]:
    return ("-md", str(draft), "--spec-type", "draft-simple")


def settings_of(rep: dict) -> dict[str, tuple]:
    return {s["setting"]: (s["value"], s["source"]) for s in rep["settings"]}
