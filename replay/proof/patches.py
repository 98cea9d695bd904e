"""Fixes for llama.cpp sources, generated from our own templates for the tree at hand.

`server_patch(tree)` makes `llama-server` report real probabilities for the tokens its
speculative loop emits. The placeholder it replaces (b11434
tools/server/server-context.cpp:4350-4357, [0c1e570] :3983-3988):

    result.prob = 1.0f; // set later
    // TODO: set result.probs

The fix is server-only (docs/server-loop.md, 'What a fixed server reports'):

* the verify batch rows (`slot.spec_i_batch`) are kept before the verifier clears them;
* pre-sampling probabilities (`post_sampling_probs` false) are the softmax of the target
  logits at the row the verifier sampled the token from, through the server's own
  `populate_token_probs` (the logits of that batch are still the context's current ones:
  only the draft context is decoded between the target decode and `post_decode`);
* post-sampling probabilities are the target sampler's candidates at that position: a
  clone of the sampler taken before verification samples each emitted position again
  (same chain state, same RNG draws, so the same candidates as the verifier saw) and
  accepts the emitted token, exactly as the verifiers do (common/sampling.cpp:686-718,
  732-836, server-context.cpp:57-79).

Nothing runs when `n_probs` is 0, and the clone never touches the real sampler, so the
sampled tokens cannot change. Streams need no change: a partial response carries
probabilities as soon as the token has a non-empty list (tools/server/server-task.cpp:1067-1081).

`example_patch(tree)` corrects `examples/speculative/speculative.cpp` (see `dist`).

The tree's version is recognised by the shape of its code, not by a version string; a tree
whose code does not match is refused with the name of the function that did not match.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from replay.errors import PatchError

SERVER_FILE = "tools/server/server-context.cpp"
EXAMPLE_FILE = "examples/speculative/speculative.cpp"


@dataclass(frozen=True)
class Patch:
    """A unified diff (-p1) against one file of a llama.cpp tree."""

    profile: str  # the code shape recognised: "b11434" or "0c1e570"
    path: str  # relative to the tree root
    diff: str

    def write(self, out: Path) -> None:
        out.write_text(self.diff, encoding="utf-8")


@dataclass(frozen=True)
class _Edit:
    """Replace the single match of `pattern` inside the body of `function`."""

    function: str
    pattern: str
    replacement: str


def _read(tree: Path, rel: str) -> str:
    path = Path(tree) / rel
    if not Path(tree).is_dir():
        raise PatchError(f"{tree}: not a directory")
    if not path.is_file():
        raise PatchError(f"{tree}: no {rel}; is this a llama.cpp checkout?")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise PatchError(f"{path}: not UTF-8 text") from None


def _function_span(text: str, signature: str, name: str, rel: str) -> tuple[int, int]:
    """Start and end of the brace-balanced body that follows the first match of `signature`."""
    m = re.search(signature, text)
    if m is None:
        raise PatchError(f"{rel}: cannot find {name}; this llama.cpp version is not one "
                         "spec-replay knows how to patch (b11434, 0c1e570)")
    start = text.index("{", m.end() - 1)
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return m.start(), i + 1
    raise PatchError(f"{rel}: {name} has unbalanced braces")


def _indent(block: str, indent: str) -> str:
    return "\n".join(indent + line if line else "" for line in block.split("\n"))


def _apply(text: str, rel: str, signature: str, name: str, edits: list[_Edit]) -> str:
    """Apply edits inside one function; each pattern must match exactly once there."""
    lo, hi = _function_span(text, signature, name, rel)
    body = text[lo:hi]
    for e in edits:
        found = list(re.finditer(e.pattern, body))
        if len(found) != 1:
            what = "does not contain" if not found else f"contains {len(found)} copies of"
            raise PatchError(f"{rel}: {name} {what} the code spec-replay patches ({e.function}); "
                             "this llama.cpp version is not one spec-replay knows how to patch (b11434, 0c1e570)")
        m = found[0]
        indent = m.groupdict().get("indent") or ""
        body = body[:m.start()] + _indent(e.replacement, indent) + body[m.end():]
    return text[:lo] + body + text[hi:]


def _diff(rel: str, before: str, after: str, header: str) -> str:
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 f"a/{rel}", f"b/{rel}", n=3)
    return header + "".join(lines)


# --- llama-server ----------------------------------------------------------------

_POPULATE = r"void\s+populate_token_probs\s*\("
_POST_DECODE = r"void\s+post_decode\s*\("

_POPULATE_EDITS = [
    # let the post-sampling branch read another sampler's candidates (the verify clone)
    _Edit("populate_token_probs signature",
          r"populate_token_probs\(\s*const server_slot & slot,\s*completion_token_output & result,\s*"
          r"bool post_sampling,\s*bool special,\s*int idx\s*\) const",
          "populate_token_probs(const server_slot & slot, completion_token_output & result, bool post_sampling, "
          "bool special, int idx, common_sampler * smpl = nullptr) const"),
    _Edit("post-sampling candidates",
          r"common_sampler_get_candidates\(\s*slot\.smpl\.get\(\),\s*true\s*\)",
          "common_sampler_get_candidates(smpl != nullptr ? smpl : slot.smpl.get(), true)"),
]

_KEEP_ROWS = r"""GGML_ASSERT(n_draft > 0);

// spec-replay: keep what the emitted tokens' probabilities need (only when they are asked for):
// the verify batch rows, and a clone of the target sampler in its pre-verification state
const int32_t n_probs_req   = slot.task->params.sampling.n_probs;
const bool    post_sampling = slot.task->params.post_sampling_probs;
std::vector<int32_t> i_verify;
common_sampler_ptr   smpl_probs;
if (n_probs_req > 0) {
    i_verify = slot.spec_i_batch;
    if (post_sampling) {
        smpl_probs.reset(common_sampler_clone(slot.smpl.get()));
    }
}"""

_FILL = r"""result.prob         = 1.0f;

// spec-replay: the real probabilities of this token, from the row it was verified at
if (n_probs_req > 0) {
    GGML_ASSERT(i < i_verify.size());
    result.prob = 0.0f; // stays 0 if the token is not among the candidates
    if (post_sampling) {
        // the clone repeats the verifier's sample at this row (same state, same draws),
        // then accepts the emitted token, as the verifier did
        common_sampler_sample(smpl_probs.get(), slot.ctx_tgt, i_verify[i]);
        populate_token_probs(slot, result, true, params_base.special, i_verify[i], smpl_probs.get());
        common_sampler_accept(smpl_probs.get(), result.tok, true);
    } else {
        // the same row index the verifier passed to common_sampler_sample
        populate_token_probs(slot, result, false, params_base.special, i_verify[i]);
    }
}
"""

_POST_DECODE_EDITS = [
    _Edit("speculative verification: keep the verify rows",
          r"(?P<indent>[ \t]*)GGML_ASSERT\(n_draft > 0\);(?=\s*// verify and try to accept the draft\s*\{\s*"
          r"common_sampler_ptr smpl_save\(common_sampler_clone\(slot\.smpl\.get\(\)\)\);)",
          _KEEP_ROWS),
    _Edit("speculative emission placeholder",
          r"(?P<indent>[ \t]*)result\.prob\s*=\s*1\.0f;\s*// set later\s*\n\s*// TODO: set result\.probs\n",
          _FILL),
]

# the verifier each profile calls, recognised inside post_decode
_SHAPES = {
    "b11434": r"common_sampler_sample_and_accept_n_rejection\(",
    "0c1e570": r"auto accepted = synth_probs\.empty\(\)\s*\?\s*common_sampler_sample_and_accept_n\(",
}


def detect_server_profile(tree: Path) -> str:
    """Which known shape the tree's post_decode has: "b11434" (rejection verifier present) or
    "0c1e570" (sample-and-match only)."""
    text = _read(tree, SERVER_FILE)
    lo, hi = _function_span(text, _POST_DECODE, "post_decode()", SERVER_FILE)
    for name, shape in _SHAPES.items():
        if re.search(shape, text[lo:hi]):
            return name
    raise PatchError(f"{SERVER_FILE}: post_decode() has a speculative verification spec-replay does not know "
                     "(neither b11434's nor 0c1e570's); refusing to patch")


def server_patch(tree: Path) -> Patch:
    """The fix for `tree`'s llama-server, as a unified diff against tools/server/server-context.cpp."""
    profile = detect_server_profile(tree)
    before = _read(tree, SERVER_FILE)
    if "spec-replay:" in before:
        raise PatchError(f"{SERVER_FILE}: already patched by spec-replay")
    after = _apply(before, SERVER_FILE, _POPULATE, "populate_token_probs()", _POPULATE_EDITS)
    after = _apply(after, SERVER_FILE, _POST_DECODE, "post_decode()", _POST_DECODE_EDITS)
    header = (f"spec-replay: real probabilities for speculative tokens in llama-server ({profile} code shape).\n"
              "Fills prob and the top-N list of every token the speculative loop emits, pre- and post-sampling;\n"
              "no change to sampled tokens, no cost with n_probs = 0. Apply with: git apply -p1 <this file>\n\n")
    return Patch(profile, SERVER_FILE, _diff(SERVER_FILE, before, after, header))


# --- llama-speculative (examples/speculative/speculative.cpp) ------------------------------

_MAIN = r"int\s+main\s*\(\s*int\s+argc"

_EXAMPLE_EDITS = [
    _Edit("draft token: the sampled candidate",
          r"(?P<indent>[ \t]*)const llama_token id = cur_p->data\[is\]\.id;",
          "// spec-replay: the draft proposes the token its sampler drew (the verification below assumes\n"
          "// x ~ q), not the top candidate; extra tree branches (is > 0) keep taking the next candidates\n"
          "const llama_token id = cur_p->data[is == 0 && cur_p->selected >= 0 ? cur_p->selected : is].id;"),
    _Edit("residual: match token ids",
          r"(?P<indent>[ \t]*)if \(i < dist_dft\.size\) \{\s*"
          r"dist_tgt\.data\[i\]\.p = std::max\(0\.0f, dist_tgt\.data\[i\]\.p - dist_dft\.data\[i\]\.p\);\s*"
          r"\} else \{\s*dist_tgt\.data\[i\]\.p = std::max\(0\.0f, dist_tgt\.data\[i\]\.p\);\s*\}",
          "// spec-replay: residual max(0, p(x) - q(x)) for the same token x, not for the same array position\n"
          "float p_dft_i = 0.0f;\n"
          "for (size_t j = 0; j < dist_dft.size; j++) {\n"
          "    if (dist_dft.data[j].id == dist_tgt.data[i].id) {\n"
          "        p_dft_i = dist_dft.data[j].p;\n"
          "        break;\n"
          "    }\n"
          "}\n"
          "dist_tgt.data[i].p = std::max(0.0f, dist_tgt.data[i].p - p_dft_i);"),
]


def example_patch(tree: Path) -> Patch:
    """The fix for `tree`'s llama-speculative example (its two distribution defects, see
    example_loop.py), as a unified diff against examples/speculative/speculative.cpp."""
    before = _read(tree, EXAMPLE_FILE)
    if "spec-replay:" in before:
        raise PatchError(f"{EXAMPLE_FILE}: already patched by spec-replay")
    after = _apply(before, EXAMPLE_FILE, _MAIN, "main()", _EXAMPLE_EDITS)
    profile = detect_server_profile(tree) if (Path(tree) / SERVER_FILE).is_file() else "unknown"
    header = ("spec-replay: make llama-speculative's stochastic verification lossless.\n"
              "The draft proposes its sampled token (not the top candidate) and the residual subtracts the\n"
              "draft probability of the same token (not of the same array position).\n"
              "Apply with: git apply -p1 <this file>\n\n")
    return Patch(profile, EXAMPLE_FILE, _diff(EXAMPLE_FILE, before, after, header))
