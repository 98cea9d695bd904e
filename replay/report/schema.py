"""The report's JSON: its format name and version (docs/report-format.md describes every field), and
the one encoder every command's JSON goes through.

JSON has no infinity or NaN. A report can hold them (a logprob of a token the sampler ruled out is
-inf; a CPU variant's probe distance is inf when the emitted token falls outside its post-sampling
candidates), so they are written as the strings "inf", "-inf" and "nan", and read back by
`from_json_number`.
"""
from __future__ import annotations

import json
import math
from typing import Any

REPORT_FORMAT = "spec-replay-report"  # recover and diff (report/recovery.py RecoverResult.to_json)
TRACE_FORMAT = "spec-replay-trace"  # trace (commands/trace.py)
REPORT_VERSION = 1  # bump when a field changes meaning or goes away; adding a field is no new version


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by its name, so that it encodes as strict JSON.

    >>> finite({"d": float("inf"), "l": [float("-inf"), 0.5, float("nan")], "n": None})
    {'d': 'inf', 'l': ['-inf', 0.5, 'nan'], 'n': None}
    """
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def from_json_number(v: Any) -> Any:
    """A number as the report wrote it, back to a float (inverse of `finite` for one value).

    >>> from_json_number("-inf"), from_json_number(0.25), from_json_number(None)
    (-inf, 0.25, None)
    """
    return float(v) if v in ("inf", "-inf", "nan") else v


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON of a report object (non-finite numbers as strings: see the module docstring)."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
