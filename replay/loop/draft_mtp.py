"""The MTP drafter (`--spec-type draft-mtp`): the target's own nextn layer(s) draft, in a second context.

As b11434's common_speculative_impl_draft_mtp (common/speculative.cpp:1390-1828) does it, for targets
whose MTP context keeps its own KV (hy_v3, qwen35: `llama_get_ctx_other` is null for them,
src/llama-context.cpp:146-165; gemma4's assistant, which shares the target's memory and comes with
-md, is refused: loop/replayable.py, MtpHeads):

- The slot's MTP context is made from the target model (ctx_type MTP, ctx_other the target, n_rs_seq 0:
  speculative.cpp:2603-2617; one output per sequence: :2561-2562; runtime/llama.py Context(mtp_of=)), keeps its
  hidden states for its output rows, and the target keeps its own for every batch row
  (llama_set_embeddings_nextn(tgt, true, false) and (dft, true, true): :1478-1479).
- `process`, after every target decode, prompt batches and verify batches alike (server-context.cpp:
  4072-4084; :1539-1646): the MTP context decodes the same tokens, token k paired with the target's
  hidden row of entry k-1 and the first with `pending_h`, no outputs; then `pending_h` is the batch's
  last row and `verify_h` its rows. `pending_h` starts as zeros with the server (:1494) and is never
  reset: not by a new request, not by a checkpoint restore (MtpHeads lives with the slot's memory).
- `draft` (:1648-1812): decode [id_last at pos0] with `pending_h`; take the top candidate of the
  top-k 10 chain (greedy drafting: :1740; the chain's p of it stops drafting under --spec-draft-p-min,
  :1743-1748); feed the head's own hidden row with the drafted token at the next position (:1784-1788)
  until --spec-draft-n-max, with no decode past it (:1761-1765); fewer than --spec-draft-n-min is none
  (:1802-1811). Chained heads (several nextn layers, :1482-1491, 1700-1708): n_max is capped at the
  head count, and step i re-decodes the whole prefix [id_last, d1..di] from pos0 on head i.
- `accept(n)` (:1814-1827): `pending_h` becomes the target's row of the last accepted token; the server
  calls it on every drafter after a drafted step (:2958-2992), whichever drafted.

- Probabilistic drafting (`--spec-draft-sampling probabilistic` at temperature > 0, :1667-1674): the
  slot's draft sampler is retuned to the request's temperature and seed (spec_retune, :33-70: top-k 10,
  temperature, dist seeded `seed ^ 0x85ebca6b`), reset when a request begins (:1518-1520), the drawn
  candidate drafted and the candidates kept as q, so the target verifies by the rejection rule; a greedy
  request after it keeps the retuned chain (its p, against --spec-draft-p-min, is the tuned one).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from replay.errors import DecodeError, ModelError, TranscriptError
from replay.loop.draft_model import draft_chain
from replay.runtime.gguf import tensor_names
from replay.runtime.llama import Context, Model
from replay.runtime.staging import staging
from replay.runtime.sampler import LLAMA_DEFAULT_SEED, SamplerChain

DRAFT_TOP_K = 10  # common/speculative.cpp:1453-1460


def check_mtp(target: Model) -> None:
    """Refuse, in one line, a target a server could not have drafted from with MTP heads: no nextn layers
    (llama_init_from_model refuses the MTP context), or nextn layers the file declares without their
    tensors (src/models/hy-v3.cpp:26-32 then loads the trunk alone, and the MTP graph has no weights)."""
    if target.n_layer_nextn < 1:
        raise TranscriptError(f"--spec-type draft-mtp: {target.path.name} has no nextn (MTP) layers, so a server "
                              "could not have drafted with it (llama_init_from_model refuses an MTP context)")
    n_trunk = int(target.meta(f"{target.meta('general.architecture')}.block_count") or 0) - target.n_layer_nextn
    if f"blk.{n_trunk}.nextn.eh_proj.weight" not in tensor_names(target.path):
        raise TranscriptError(f"--spec-type draft-mtp: {target.path.name} declares {target.n_layer_nextn} nextn "
                              "layer(s) but holds no nextn tensors (a trunk-only file): give the file with them")


def backend_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """The logits a backend top-k sampler leaves the CPU chain: the k largest, the rest -inf. The server
    samples its MTP drafts with a backend top_k(10) in the draft graph (common/speculative.cpp:1462-1476,
    on by default: --spec-draft-backend-sampling), so its CPU chain (suppressed tokens, top-k, dist) sees
    only those k (common/sampling.cpp:134-166).

    >>> backend_top_k(np.array([0.5, 2.0, -1.0, 1.0], dtype=np.float32), 2).tolist()
    [-inf, 2.0, -inf, 1.0]
    """
    if k >= len(logits):
        return logits
    out = np.full_like(logits, -np.inf)
    top = np.argpartition(-logits, k)[:k]
    out[top] = logits[top]
    return out


class MtpHeads:
    """One slot's MTP context and what the server carries in it across steps and requests."""

    def __init__(self, target: Context, ctx: Context, *, suppress_tokens: bool):
        self.target, self.ctx = target, ctx
        n_embd = target.model.n_embd_out
        self.pending_h = np.zeros(n_embd, dtype=np.float32)
        self.verify_h = np.zeros((0, n_embd), dtype=np.float32)
        self.n_heads = max(1, target.model.n_layer_nextn)
        self.chained = self.n_heads > 1
        self.suppress_tokens = suppress_tokens
        self.retune: tuple[float, int] | None = None  # the slot's last spec_retune (temp, seed), kept across requests
        self.chain: SamplerChain | None = None  # this request's draft sampler, made at its first draft
        if staging().get_ctx_other(ctx.ptr):  # is_mem_shared (:1481): gemma4's assistant drafts at one position
            raise TranscriptError(f"--spec-type draft-mtp: {target.model.path.name}'s MTP context shares the target's "
                                  "memory (gemma4's assistant), which is not replayed yet")
        target.keep_hidden(masked=False)
        ctx.keep_hidden(masked=True)

    def close(self) -> None:
        self.begin()

    def begin(self) -> None:
        """A request begins: its draft sampler is made afresh (common_sampler_reset, :1518-1520)."""
        if self.chain is not None:
            self.chain.close()
            self.chain = None

    def _sampler(self, probabilistic: bool, temp: float, seed: int) -> SamplerChain:
        if probabilistic:
            self.retune = (temp, seed)
        return draft_chain(self.target.model, self.retune, suppress_tokens=self.suppress_tokens)

    def process(self, tokens: Sequence[int], pos0: int) -> None:
        """The MTP context's catch-up after the target decoded `tokens` at pos0.. (module docstring)."""
        n = len(tokens)
        h = self.target.hidden_rows(n)
        rows = np.vstack([self.pending_h[None, :], h[:-1]])
        no_outputs = [False] * n
        if self.chained:
            for head in range(self.n_heads):
                self.ctx.seq_rm(0, pos0, -1)
                self.ctx.nextn_layer(head)
                self.ctx.process(tokens, pos0, rows, no_outputs)
            self.ctx.nextn_layer(0)
        else:
            self.ctx.process(tokens, pos0, rows, no_outputs)
        self.verify_h = h
        self.pending_h = h[-1].copy()

    def draft(self, id_last: int, pos0: int, *, n_max: int, p_min: float, n_min: int, probabilistic: bool = False,
              temp: float = 0.0, seed: int = LLAMA_DEFAULT_SEED
              ) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]] | None]:
        """Drafts from [id_last at pos0] (module docstring), and their q where drafted probabilistically;
        the caller cuts them to the slot's limit, as common_speculative_draft does after the drafter
        returns (:2913-2923)."""
        if self.chain is None or probabilistic and self.retune != (temp, seed):
            if self.chain is not None:
                self.chain.close()
            self.chain = self._sampler(probabilistic, temp, seed)
        if self.chained:
            n_max = min(n_max, self.n_heads)
        out: list[int] = []
        qs: list[tuple[np.ndarray, np.ndarray]] = []
        hs = [self.pending_h]  # the hidden row each entry of a chained prefix carries
        tokens, start, rows = [id_last], pos0, np.asarray([self.pending_h])
        i = 0
        while True:
            if self.chained:
                self.ctx.seq_rm(0, pos0, -1)
                self.ctx.nextn_layer(i)
            try:
                self.ctx.process(tokens, start, rows, [False] * (len(tokens) - 1) + [True])
            except (DecodeError, ModelError):  # past the KV's cells: the server keeps what it drafted (:1710-1714)
                break
            cands, sel = self.chain.apply(backend_top_k(self.ctx.logits(-1), DRAFT_TOP_K))
            h_row = self.ctx.hidden_row(len(tokens) - 1)
            tok = int(cands["id"][sel] if probabilistic else cands["id"][0])
            if cands["p"][0] < p_min:
                break
            self.chain.accept(tok)
            out.append(tok)
            qs.append((cands["id"].copy(), cands["p"].copy()))
            if n_max <= len(out):
                break
            if self.chained:
                hs.append(h_row)
                tokens, start, rows = [id_last] + out, pos0, np.asarray(hs)
            else:
                tokens, start, rows = [tok], pos0 + i + 1, h_row[None, :]
            i += 1
        if self.chained:
            self.ctx.nextn_layer(0)
        if len(out) < n_min:
            return [], None
        return out, (qs if probabilistic else None)

    def accept(self, n_accepted: int) -> None:
        """pending_h = the target's row of the last accepted token (:1814-1827)."""
        if len(self.verify_h):
            self.pending_h = self.verify_h[min(n_accepted, len(self.verify_h) - 1)].copy()


class DraftMtp:
    """The draft-mtp drafter of one request, over its slot's MtpHeads."""

    name = "draft-mtp"
    accepts_others = True  # common_speculative_accept calls every drafter's accept (:2986-2991)

    def __init__(self, heads: MtpHeads, spec, temp: float = 0.0, seed: int = LLAMA_DEFAULT_SEED):
        self.heads, self.spec, self.temp, self.seed = heads, spec, temp, seed
        # the server asks for q (rejection) only at temperature > 0, and MTP keeps it only when probabilistic
        self.probabilistic = spec.draft_sampling == "probabilistic" and temp > 0
        self.last_q: list[tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def passes(self) -> int:
        """The draft chain's passes so far this request (one per drafted position)."""
        return self.heads.chain.passes if self.heads.chain is not None else 0

    def begin(self, prompt: Sequence[int]) -> None:
        self.heads.begin()

    def draft(self, inp: Sequence[int], id_last: int, n_max: int) -> list[int]:
        out, self.last_q = self.heads.draft(id_last, len(inp), n_max=self.spec.draft_n_max,
                                            p_min=self.spec.draft_p_min, n_min=self.spec.draft_n_min,
                                            probabilistic=self.probabilistic, temp=self.temp, seed=self.seed)
        return out

    def accept(self, n_accepted: int) -> None:
        self.heads.accept(n_accepted)
