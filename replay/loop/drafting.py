"""Which drafters the server drafts with, how long a step's draft may be, and which drafter's draft wins.

    server_types   the --spec-type list the server drafts with, as it takes the flags and the draft model
    draft_limit    n_max of a step (server_slot::get_n_draft_max, server-context.cpp:517-536), pure
    first_draft    the first drafter, in priority order, with a non-empty draft (speculative.cpp:2868-2956)

The drafters themselves are drafters.py (n-gram), draft_model.py (draft-simple) and draft_mtp.py (MTP).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from replay.builds.loop_shapes import Era
from replay.loop.draft_model import compatibility
from replay.loop.drafters import Drafter
from replay.runtime.llama import Model

EMPTY_Q = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32))  # a draft distribution with no candidates


def server_types(spec, era: Era, target: Model, draft_model: Model | None) -> tuple[list[str], Model | None, list[str]]:
    """(the speculative types the server drafted with, its draft model, notes on why it differs from the
    flags): b9246..b9453 enable draft-simple for -md themselves, a draft model whose vocabulary does not
    fit is not drafted with (common_speculative_are_compatible), and no type means no drafting."""
    notes: list[str] = []
    types = [t for t in spec.spec_types if t != "none"]
    if era.md_auto_draft and draft_model is not None and "draft-simple" not in types:
        # b9246..b9453: "'draft' speculative type is not explicitly enabled - enabling it"
        types.append("draft-simple")
        notes.append(f"-md without --spec-type draft-simple: {era.describe()} enables draft-simple itself")
    why = compatibility(target, draft_model) if draft_model is not None and "draft-simple" in types else None
    if why is not None:
        # the server logs "the target and draft vocabs are not compatible" and speculates not at all
        notes.append(f"the server cannot draft with {draft_model.path.name} ({why}), so it ran without "
                     "speculation (common_speculative_are_compatible); so does this trace")
        return [], None, notes
    if not types:
        notes.append("no speculative type: the server did not speculate (from b9464 it speculates only "
                     "with --spec-type; -md alone loads the draft and never drafts); traced without drafting")
    return types, draft_model, notes


def draft_limit(n_ctx: int, pos0: int, n_remaining: int) -> int:
    """The longest draft a step may take (server-context.cpp:517-536): room for the sampled token and one
    more in the context, `n_ctx - pos0 - 2`, and when n_predict leaves `n_remaining` > 0 tokens, one fewer
    than those (the sampled token is one of them); -1 for n_remaining means no n_predict.

    >>> draft_limit(4096, 100, -1), draft_limit(4096, 100, 5), draft_limit(102, 100, -1)
    (3994, 4, 0)
    """
    n_max = n_ctx - pos0 - 2
    if n_remaining > 0:
        n_max = min(n_max, n_remaining - 1)
    return n_max


@dataclass(frozen=True)
class Draft:
    """A step's draft: its tokens, the drafter that made them (None: no draft) and, for a probabilistic
    drafter, its distribution q at each position (ids, p), else None (verified by sample-and-match)."""

    tokens: list[int]
    drafter: Drafter | None = None
    q: list | None = None


NO_DRAFT = Draft([])


def first_draft(drafters: Sequence[Drafter], kv: Sequence[int], sampled: int, n_max: int, *, era: Era,
                temp: float) -> Draft:
    """The first drafter with a non-empty draft wins, cut to n_max (common_speculative_draft,
    speculative.cpp:2868-2956); a probabilistic drafter (draft-simple, MTP) keeps its q. On b11368..b11382
    the server resizes the empty q of an n-gram draft it cuts to n_max rows of nothing, and verifies it by
    rejection at temp > 0 (builds/loop_shapes.py q_trim_bug)."""
    for d in drafters:
        got = d.draft(kv, sampled, n_max)
        if not got:
            continue
        if getattr(d, "last_q", None) is not None:
            return Draft(got[:n_max], d, d.last_q[:n_max])
        if era.q_trim_bug and temp > 0 and len(got) > n_max:
            return Draft(got[:n_max], d, [EMPTY_Q] * n_max)
        return Draft(got[:n_max], d)
    return NO_DRAFT
