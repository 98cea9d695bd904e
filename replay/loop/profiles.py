"""Which server loop a replay runs: the build profiles and the speculative types each can replay.

SERVER_LOOP.md section 7: b11434 verifies by rejection when the draft is probabilistic and the
temperature positive, else by sample-and-match; 0c1e570 has no rejection verifier and no
--spec-draft-sampling (it always verifies by sample-and-match). Everything else the loop touches
(chain construction, seeds, libllama samplers, n-gram drafters, probabilities) is identical.
"""
from __future__ import annotations

from ..errors import TranscriptError
from ..settings import PROFILES

DEFAULT_PROFILE = "b11434"

# Replayable speculative types, in common_speculative_init's priority order (common/speculative.cpp:2697-2707):
# the first one that returns a draft for a step wins.
PRIORITY = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple")
_HIDDEN_STATES = ("needs the target's hidden states (src/llama-ext.h), which libllama's C API does not expose")
UNSUPPORTED = {
    "draft-mtp": "MTP heads " + _HIDDEN_STATES,
    "draft-eagle3": "EAGLE-3 " + _HIDDEN_STATES,
    "draft-dflash": "DFlash " + _HIDDEN_STATES,
}


def profile_of(build_info: str | None) -> str | None:
    """b11434 or 0c1e570 from a server's build_info / system_fingerprint, else None."""
    if not build_info:
        return None
    if "0c1e570" in build_info:
        return "0c1e570"
    if build_info.startswith("b11434"):
        return "b11434"
    return None


def check_replayable(spec, profile: str, *, has_draft_model: bool) -> None:
    """Refuse, in one line, a configuration this profile's loop cannot replay. No speculative type
    at all is replayable: the server then decodes one token per step."""
    if profile not in PROFILES:
        raise TranscriptError(f"unknown server profile {profile!r}; known: {', '.join(PROFILES)}")
    if profile == "0c1e570" and spec.draft_sampling == "probabilistic":
        raise TranscriptError("the 0c1e570 server has no --spec-draft-sampling probabilistic (no rejection "
                              "path); this transcript cannot come from it")
    types = [t for t in spec.spec_types if t != "none"]
    for t in types:
        if t in UNSUPPORTED:
            raise TranscriptError(f"--spec-type {t} cannot be replayed: {UNSUPPORTED[t]}")
        if t not in PRIORITY:
            raise TranscriptError(f"unknown --spec-type {t!r}")
    if "draft-simple" in types and not has_draft_model:
        raise TranscriptError("--spec-type draft-simple needs the draft model: pass -md/--spec-draft-model")
