"""What a loop shape (builds/loop_shapes.py) can replay: the speculative types, in priority order, and the
configurations a shape's server could not have run."""
from __future__ import annotations

from replay.builds.loop_shapes import Era
from replay.errors import TranscriptError

# Replayable speculative types, in common_speculative_init's priority order (common/speculative.cpp:2697-2707):
# the first one that returns a draft for a step wins.
PRIORITY = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple", "draft-mtp")
_HIDDEN_STATES = ("drafts from the target's hidden states (src/llama-ext.h), which this replay does not feed it yet "
                  "(only MTP heads: --spec-type draft-mtp)")
UNSUPPORTED = {
    "draft-eagle3": "EAGLE-3 " + _HIDDEN_STATES,
    "draft-dflash": "DFlash " + _HIDDEN_STATES,
    "draft-dspark": "DSpark (DFlash's block drafter with a Markov head, common/speculative.cpp:1006) " + _HIDDEN_STATES,
}


def drafts_with_model(spec, era: Era) -> bool:
    """Does this server draft with its draft model (-md)? With draft-simple among its types, or, in era C
    (b9246..b9453: Era.md_auto_draft), with -md alone: "'draft' speculative type is not explicitly
    enabled - enabling it" (common/speculative.cpp of those builds).

    >>> from types import SimpleNamespace as S
    >>> from replay.builds.loop_shapes import BY_KEY
    >>> drafts_with_model(S(spec_types=("none",), draft_model="d.gguf"), BY_KEY["C"])
    True
    >>> drafts_with_model(S(spec_types=("none",), draft_model="d.gguf"), BY_KEY["D"])
    False
    """
    if not spec.draft_model:
        return False
    return "draft-simple" in spec.spec_types or era.md_auto_draft


def check_replayable(spec, era: Era, *, has_draft_model: bool) -> None:
    """Refuse, in one line, a configuration this loop shape cannot replay. No speculative type
    at all is replayable: the server then decodes one token per step."""
    if era.unsupported is not None:
        raise TranscriptError(f"{era.describe()} is not replayed: {era.unsupported}")
    if not era.rejection and spec.draft_sampling == "probabilistic":
        raise TranscriptError(f"{era.describe()} has no --spec-draft-sampling probabilistic (no rejection verifier "
                              "before b11368); this transcript cannot come from such a build")
    types = [t for t in spec.spec_types if t != "none"]
    for t in types:
        if t in UNSUPPORTED:
            raise TranscriptError(f"--spec-type {t} cannot be replayed: {UNSUPPORTED[t]}")
        if t not in PRIORITY:
            raise TranscriptError(f"unknown --spec-type {t!r}")
    if "draft-simple" in types and not has_draft_model:
        raise TranscriptError("--spec-type draft-simple needs the draft model: pass -md/--spec-draft-model")
    if "draft-mtp" in types:
        if not era.rejection:  # the driver of b11368.. (b11434's) is the one replayed (loop/draft_mtp.py)
            raise TranscriptError(f"--spec-type draft-mtp on {era.describe()}: that build's MTP driver "
                                  "(common/speculative.cpp common_speculative_impl_draft_mtp, changed by b10724, "
                                  "b10917, b11236 and b11368) is not the one this replay runs (b11368 on); not "
                                  "replayed")
        if has_draft_model or spec.draft_model:
            raise TranscriptError("--spec-type draft-mtp with a draft model (-md): the server then drafts with the draft "
                                  "model's MTP heads (common/speculative.cpp:2625-2637), which is not replayed yet")
