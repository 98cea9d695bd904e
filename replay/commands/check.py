"""`spec-replay check URL`: does this server send real probabilities for every token?

The audit an eval harness runs before scoring:
  1. /props and /slots: b11434's /props builds its `speculative.types` from a
     default-constructed task_params (server-context.cpp:4955-4962), so it says
     "none" even when /slots reports `"speculative": true` for every slot.
  2. One probe request with probabilities; every token after the first must
     carry a real top list. Exit 0 = all real, 1 = placeholders found,
     3 = cannot tell (unreachable, not llama.cpp, no probabilities, or the
     probe never reached the speculative path): errors.Exit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replay.builds.loop_shapes import Shape, shape_for
from replay.commands.record import server_snapshot
from replay.errors import Exit, ServerError
from replay.llamacpp.http import post_json
from replay.transcripts.entries import SentEntry, n_generated, sent_entries

OK, PLACEHOLDERS, CANNOT_TELL = Exit.OK, Exit.FAILED, Exit.ERROR

# Repetitive on purpose: n-gram drafters only draft after they have seen the
# continuation before, and a draft model drafts everywhere.
PROBE_PROMPT = ("The quick brown fox jumps over the lazy dog. " * 6).strip()


@dataclass
class CheckResult:
    url: str
    build_info: str | None
    props_speculative: str | None  # /props default_generation_settings.params["speculative.types"]
    slots_speculative: list[bool] | None  # /slots[i].speculative
    contradiction: bool
    tokens: list[dict] = field(default_factory=list)
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    exit_code: int = CANNOT_TELL
    verdict: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def loop_shape(self) -> Shape:
        """The server's loop shape by its build (builds/loop_shapes.py)."""
        return shape_for(build_info=self.build_info)

    def to_json(self) -> dict[str, Any]:
        shape = self.loop_shape
        return dict(self.__dict__, build=shape.build, era={"key": shape.era.key, "builds": shape.era.span,
                                                           "title": shape.era.title, "warning": shape.warning})


def _props_spec(props: dict) -> str | None:
    params = (props.get("default_generation_settings") or {}).get("params") or {}
    v = params.get("speculative.types")
    return str(v) if v is not None else None


def check(url: str, *, n_predict: int = 48, n_probs: int = 3, prompt: str = PROBE_PROMPT, seed: int = 1,
          expected: dict | None = None) -> CheckResult:
    """Audit the server at `url`. `expected` holds speculative flags the user says the server was
    started with (settings attrs); they are checked against what its /slots report."""
    try:
        snap = server_snapshot(url)
    except ServerError as e:
        return CheckResult(url, None, None, None, False, exit_code=CANNOT_TELL, verdict=str(e))
    props_spec = _props_spec(snap["props"])
    slots = snap["slots"] if isinstance(snap["slots"], list) else None
    slots_spec = [bool(s.get("speculative")) for s in slots] if slots else None
    says_off = props_spec in (None, "", "none")
    contradiction = bool(says_off and slots_spec and any(slots_spec))
    res = CheckResult(url, snap["build_info"], props_spec, slots_spec, contradiction)
    types = [t for t in (expected or {}).get("spec_types", ()) if t != "none"]
    if types and slots_spec is not None and not any(slots_spec):
        res.warnings.append(f"started with --spec-type {','.join(types)}, but /slots reports no slot speculating: "
                            "the server dropped speculation (a draft whose vocabulary does not match the target's?)")

    body = {"prompt": prompt, "n_predict": n_predict, "n_probs": n_probs, "seed": seed, "temperature": 0.0,
            "cache_prompt": False, "return_tokens": True}
    try:
        resp = post_json(url, "/completion", body)
    except ServerError as e:
        res.verdict = f"probe request failed: {e}"
        return res
    probs = sent_entries("/completion", resp)
    timings = resp.get("timings") or {}
    res.draft_n, res.draft_n_accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    res.tokens = [_token_row(i, p) for i, p in enumerate(probs)]
    generated = n_generated("/completion", resp)
    if not probs:
        res.verdict = "the server returned no probabilities for the probe (n_probs unsupported?)"
        return res
    bad = [r for r in res.tokens if r["placeholder"]]
    if bad:
        res.exit_code = PLACEHOLDERS
        res.verdict = (f"{len(bad)} of {len(probs)} tokens carry placeholder probabilities "
                       f"(logprob 0.0, no alternatives): first at token {bad[0]['index']}")
        if generated is not None and generated > len(probs):
            res.verdict += f"; {generated - len(probs)} generated tokens have no entry at all"
        return res
    spec_on = bool(slots_spec and any(slots_spec)) or not says_off
    if spec_on and not res.draft_n:
        res.verdict = ("speculation is on but the probe never drafted (no draft tokens in timings); "
                       "try a longer or more repetitive --prompt")
        return res
    res.exit_code = OK
    res.verdict = f"all {len(probs)} tokens carry real probabilities"
    return res


def _token_row(i: int, p: SentEntry) -> dict:
    return {"index": i, "id": p.id, "token": p.token, "logprob": p.logprob, "n_top": len(p.top),
            "placeholder": p.is_placeholder}
