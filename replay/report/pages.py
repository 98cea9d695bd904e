"""Self-contained HTML pages of a trace (`trace --html`) and of a recover report (`recover --html`).

A page is one file that opens offline: the report as JSON inside `<script type="application/json">`
(every `<`, `>` and `&` escaped, so transcript text can never close the tag), and a small script
(assets/*.js) that builds the page from it with `textContent` only. Transcript text is data,
never markup: a reply holding `<script>` shows as those characters.

The data flows one way: a TraceResult or RecoverResult -> plain dicts (trace_data, recover_data,
pure and tested on their own) -> the page (page()).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from importlib import resources
from typing import Any, Callable, Iterable, Sequence

from replay.report.recovery import RecoverResult
from replay.report.schema import finite
from replay.transcripts.files import write_atomic

# how a token came to be emitted, in the order the legend shows them
PROVENANCE = {
    "outside": "sampled outside the speculative loop (the first token, or a step with no draft): "
               "the server sends its real probabilities",
    "accepted": "a draft token the target accepted: the server sends a placeholder",
    "resampled": "sampled by the target in place of a rejected draft token: the server sends a placeholder",
    "bonus": "sampled by the target after every draft token was accepted: the server sends a placeholder",
}


def _num(x: float | None, digits: int = 6) -> float | None:
    """A JSON-safe number: None for missing, NaN or infinite values (a page shows them as '-')."""
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


def provenance(steps: Sequence[Any], emitted: Sequence[Any]) -> list[dict[str, Any]]:
    """Where each emitted token came from, with the values that decided it, from the loop's steps.

    A step's emitted tokens are its accepted drafts, then the resampled or bonus token
    (loop/loop.py Step; the server's verify, server-context.cpp:4234-4340). For an accepted draft
    token: its q (the draft's probability, None for n-gram drafts), p (the target's) and u (the
    uniform draw of the rejection rule, None under sample-and-match); for a resampled token, those
    of the draft token it replaced, and u's second draw (the residual's).

    >>> from types import SimpleNamespace as S
    >>> steps = [S(index=0, draft=[], accepted=0, resampled=None, bonus=None, draft_q=None, target_p=[], uniforms=[]),
    ...          S(index=1, draft=[7, 8], accepted=1, resampled=9, bonus=None, draft_q=[0.9, 0.5],
    ...            target_p=[0.8, 0.1], uniforms=[[0.3, None], [0.7, 0.2]])]
    >>> emitted = [S(index=0, step=0), S(index=1, step=1), S(index=2, step=1)]
    >>> [(p["kind"], p["q"], p["p"], p["u"]) for p in provenance(steps, emitted)]
    [('outside', None, None, None), ('accepted', 0.9, 0.8, [0.3]), ('resampled', 0.5, 0.1, [0.7, 0.2])]
    >>> provenance(steps, emitted)[2]["rejected"]
    8
    """
    by_step: dict[int, list[Any]] = defaultdict(list)
    for e in emitted:
        by_step[e.step].append(e)
    def outside() -> dict[str, Any]:
        return {"kind": "outside", "q": None, "p": None, "u": None, "rejected": None}
    out: dict[int, dict[str, Any]] = {}
    for s in steps:
        for j, e in enumerate(by_step.pop(s.index, [])):
            info = outside()
            if s.draft and j <= s.accepted:  # a step emits its accepted drafts, then one more
                if j < s.accepted:
                    info["kind"] = "accepted"
                elif s.resampled is not None:
                    info["kind"], info["rejected"] = "resampled", s.draft[j] if j < len(s.draft) else None
                else:
                    info["kind"] = "bonus"
                if j < len(s.draft):
                    info["q"] = _num(s.draft_q[j]) if s.draft_q and j < len(s.draft_q) else None
                    info["p"] = _num(s.target_p[j]) if j < len(s.target_p) else None
                    if j < len(s.uniforms):
                        us = [_num(u) for u in s.uniforms[j] if u is not None]
                        info["u"] = us or None
            out[e.index] = info
    return [out.get(e.index) or outside() for e in emitted]


def trace_data(results: Iterable[tuple[str, Any]], piece: Callable[[int], str], *,
               prompt: str | None = None) -> dict[str, Any]:
    """The trace page's data: per record, every emitted token with its provenance and values, and
    every step's drafted/accepted counts. `results` are (where, TraceResult) pairs."""
    records = []
    for where, res in results:
        prov = provenance(res.steps, res.emitted)
        tokens = []
        for e, info in zip(res.emitted, prov):
            tokens.append({
                "i": e.index, "id": e.id, "piece": res.pieces[e.index], "step": e.step, **info,
                "rejected_piece": None if info["rejected"] is None else piece(info["rejected"]),
                "logprob": _num(e.logprob), "post_p": _num(e.post_prob),
                "top": [[piece(i), _num(lp)] for i, lp in e.top[:5]]})
        steps = [{"index": s.index, "pos0": s.pos0, "drafter": s.drafter, "rule": s.rule, "drafted": len(s.draft),
                  "accepted": s.accepted if s.draft else 0, "emitted": len(s.emitted),
                  "resampled": None if s.resampled is None else piece(s.resampled),
                  "bonus": None if s.bonus is None else piece(s.bonus)} for s in res.steps]
        records.append({
            "where": where, "reproduced": res.reproduced, "compared": res.compared,
            "first_divergence": res.first_divergence,
            "divergence": None if res.explanation is None else res.explanation.text,
            "draft_n": res.draft_n, "draft_n_accepted": res.draft_n_accepted,
            "server_draft_n": res.server_draft_n, "server_draft_n_accepted": res.server_draft_n_accepted,
            "loop": None if res.shape is None else f"{res.shape.era.describe()}, chosen by {res.shape.why}",
            "settings": [[k, v if isinstance(v, (str, int, float, bool, type(None))) else str(v), src]
                         for k, v, src in res.described()],
            "notes": list(res.notes), "tokens": tokens, "steps": steps})
    return {"kind": "trace", "prompt": prompt, "provenance": PROVENANCE, "records": records}


def recover_data(res: RecoverResult) -> dict[str, Any]:
    """The recover page's data: per record, server vs true logprob of every token with its status,
    and the means and perplexities side by side."""
    records = []
    for r in res.records:
        s = r.summary()
        sm = s["server_mean_logprob"]
        records.append({
            "where": f"{r.source}#{r.record}", "endpoint": r.endpoint, "stream": r.stream,
            "field_kind": r.field_kind, "error": r.error, "notes": list(r.notes),
            "counts": s["counts"], "n_tokens": s["tokens"],
            "server_mean": _num(sm), "true_mean": _num(s["true_mean_logprob"]),
            "server_ppl": _num(math.exp(-sm)) if sm is not None else None,
            "true_ppl": _num(s["true_perplexity"]), "max_abs_diff_real": _num(s["max_abs_diff_real"]),
            "tokens": [{"i": t.index, "id": t.id, "piece": t.piece, "server": _num(t.server_logprob),
                        "true": _num(t.true_logprob), "status": t.status, "note": t.note or None,
                        "top": [[x["piece"], _num(x["logprob"])] for x in t.true_top[:5]]} for t in r.tokens]})
    return {"kind": "recover", "failure": res.failure(), "records": records}


def _asset(name: str) -> str:
    return resources.files("replay.report").joinpath("assets", name).read_text(encoding="utf-8")


def embed_json(data: Any) -> str:
    """JSON safe inside a <script> element: no `<`, `>` or `&` survive, nor line separators.

    >>> embed_json({"t": "</script><img src=x onerror=alert(1)>"})
    '{"t": "\\\\u003c/script\\\\u003e\\\\u003cimg src=x onerror=alert(1)\\\\u003e"}'
    """
    text = json.dumps(finite(data), ensure_ascii=False, allow_nan=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def page(data: dict[str, Any], title: str) -> str:
    """One self-contained page: the styles, the data and the script that renders it, nothing fetched.
    `title` is ours (never transcript text)."""
    script = _asset("common.js") + "\n" + _asset(f"{data['kind']}.js")
    return ("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src 'none'\">\n"
            f"<title>{title}</title>\n<style>\n{_asset('page.css')}</style>\n</head>\n<body>\n"
            "<main id=\"app\"><noscript>This page draws itself with JavaScript.</noscript></main>\n"
            "<div id=\"tip\" role=\"tooltip\" hidden></div>\n"
            f"<script type=\"application/json\" id=\"data\">{embed_json(data)}</script>\n"
            f"<script>\n{script}</script>\n</body>\n</html>\n")


def trace_page(results: Iterable[tuple[str, Any]], piece: Callable[[int], str], *, prompt: str | None = None) -> str:
    """`trace --html`: the token stream coloured by provenance, q/p/u on hover, drafted/accepted per step."""
    return page(trace_data(results, piece, prompt=prompt), "spec-replay trace")


def recover_page(res: RecoverResult) -> str:
    """`recover --html` / `diff --html`: server vs true logprob per token, placeholders marked."""
    return page(recover_data(res), "spec-replay recover")


def write_page(html_file: str | None, res: RecoverResult, force: bool) -> bool:
    """--html: recover's report as one self-contained page, written whole or not at all
    (transcripts/files.py write_atomic); whether a file was written."""
    if html_file:
        write_atomic(html_file, recover_page(res), force=force)
    return bool(html_file)


def tune_data(report: dict[str, Any]) -> dict[str, Any]:
    """The tune page's data from tune's JSON report (cli/tune.py): per setting, ranked by predicted speed
    (else in sweep order), its prediction with any interval, acceptance counted and expected by position,
    and each record's target decodes per token in the generation phase.

    >>> rep = {"speed_model": None, "notes": [], "settings": [{"setting": "as recorded", "tokens": 3, "drafted": 2,
    ...        "accepted": 1, "acceptance": 0.5, "target_decodes_per_token": 1.0, "acceptance_by_position": [0.5],
    ...        "expected": None, "samples": None, "records": [{"record": 1, "tokens": 3, "drafted": 2, "accepted": 1,
    ...        "generation": {"target_batches": {"3": 1, "1": 1}}}]}]}
    >>> d = tune_data(rep)
    >>> d["settings"][0]["records"][0]["decodes_per_token"], d["tokens"]
    (1.0, 3)
    """
    settings = []
    for k, s in enumerate(report["settings"]):
        pred = s.get("predicted") or {}
        samples = s.get("samples") or {}
        samp, samp_up = samples.get("tokens_per_second") or {}, samples.get("speedup") or {}
        exp = s.get("expected") or {}
        recs = []
        for r in s["records"]:
            steps = sum((r.get("generation") or {}).get("target_batches", {}).values())
            recs.append({"record": r["record"], "tokens": r["tokens"],
                         "acceptance": _num(r["accepted"] / r["drafted"]) if r["drafted"] else None,
                         "decodes_per_token": _num(steps / (r["tokens"] - 1)) if r["tokens"] > 1 else None})
        settings.append({"name": s["setting"], "baseline": k == 0, "tps": _num(pred.get("tokens_per_second")),
                         "speedup": _num(pred.get("speedup")), "tps_interval": samp.get("interval_95"),
                         "interval": samp_up.get("interval_95"), "acceptance": _num(s["acceptance"]), "expected": _num(exp.get("acceptance")),
                         "decodes_per_token": _num(s["target_decodes_per_token"]), "drafted": s["drafted"],
                         "accepted": s["accepted"], "by_position": [_num(p) for p in s["acceptance_by_position"]],
                         "expected_by_position": [_num(p) for p in exp.get("acceptance_by_position") or []],
                         "records": recs})
    if any(s["tps"] is not None for s in settings):
        settings.sort(key=lambda s: -(s["tps"] or 0.0))
    first = report["settings"][0] if report["settings"] else {"records": [], "tokens": 0}
    return {"kind": "tune", "speed_model": (report.get("speed_model") or {}).get("source"), "notes": report["notes"],
            "records": len(first["records"]), "tokens": first["tokens"], "settings": settings}


def tune_page(report: dict[str, Any]) -> str:
    """`tune --html`: predicted speed-up by setting, acceptance by position, the spread over records."""
    return page(tune_data(report), "spec-replay tune")
