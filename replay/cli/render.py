"""Terminal tables of recover/diff reports (tabulate)."""
from __future__ import annotations

from tabulate import tabulate

from replay.report.recovery import RecordReport, RecoverResult


def shown(value) -> str:
    """A setting's value as a user would type it on llama-server's command line.

    >>> shown(("draft-simple",)), shown(["ngram-mod", "draft-simple"]), shown("greedy"), shown(0.8), shown(None)
    ('draft-simple', 'ngram-mod,draft-simple', "'greedy'", '0.8', 'None')
    """
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return repr(value)


def _f(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def token_table(r: RecordReport) -> str:
    rows = []
    for t in r.tokens:
        top = ", ".join(f"{x['piece']!r} {x['logprob']:.3f}" for x in t.true_top[:3])
        rows.append([t.index, t.id, repr(t.piece), _f(t.server_logprob), _f(t.true_logprob), t.status, top])
    return tabulate(rows, headers=["#", "id", "piece", "server", "true", "status", "true top"])


def summary_table(res: RecoverResult) -> str:
    rows = []
    for r in res.records:
        s = r.summary()
        c = s["counts"]
        rows.append([f"{r.source}#{r.record}", r.endpoint + (" (stream)" if r.stream else ""), s["tokens"], c["ok"],
                     c["placeholder"], c["missing"], c["mismatch"] + c["unaligned"], _f(s["server_mean_logprob"]),
                     _f(s["true_mean_logprob"]), _f(s["true_perplexity"], 3),
                     "-" if s["max_abs_diff_real"] is None else f"{s['max_abs_diff_real']:.1e}"])
    return tabulate(rows, headers=["record", "endpoint", "tokens", "ok", "placeholder", "missing", "bad",
                                   "server mean", "true mean", "true ppl", "max |diff| real"])
