"""Distribution lab: which speculative loops sample the target's own distribution?

One context on the tiny fixture (vocabulary a..h): prompt "gfbdc", then the prefix "e".
After it the target's post-sampling distribution (top-k 3, temperature 1) is
c 0.416, a 0.379, e 0.205, and the noisy draft's top token is a (q 0.362 <= p 0.379), not c.
Every path generates from the prompt with N seeds; runs whose first token is the prefix
count, and their second token -- the first one a speculative loop verifies -- is tallied:

  a  the real llama-server without speculation
  b  the real speculating llama-server: draft-simple greedy, and probabilistic (rejection)
  c  spec-replay's trace loop, in both modes (must match b seed for seed)
  d  the real llama-speculative example program
  e  example_loop.py's reimplementation of d (must match d seed for seed)
  f  e with its two defects corrected (what `spec-replay patch --example` writes)
  d' llama-speculative rebuilt with that patch (must match f seed for seed)

Each tally is compared with the reference distribution by a chi-square test.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import math
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from replay.errors import SpecReplayError

if TYPE_CHECKING:
    from replay.proof.example_loop import Dist

PROMPT = "gfbdc"
PREFIX = "e"
SAMPLING = {"temperature": 1.0, "top_k": 3, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"]}
N_PREDICT = 6  # room for a full draft (n_max 3) after the first token
N_CTX = 256
PASS_P = 0.01
BIASED_P = 1e-6

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Lab:
    target: Path
    draft: Path
    prompt: str = PROMPT
    prefix: str = PREFIX
    seeds: range = range(1, 1001)

    def body(self, seed: int) -> dict:
        return {"prompt": self.prompt, "n_predict": N_PREDICT, "seed": seed, "cache_prompt": False,
                "return_tokens": True, **SAMPLING}


@dataclass
class PathRun:
    """What one path generated: the first two tokens per seed."""

    key: str
    label: str
    tokens: dict[int, tuple[int, ...]]
    counts: dict[int, int] = field(default_factory=dict)
    runs: int = 0
    chi2: float = 0.0
    p_value: float = 1.0

    @property
    def verdict(self) -> str:
        if self.runs == 0:
            return "no runs"
        if self.p_value > PASS_P:
            return "preserves"
        if self.p_value < BIASED_P:
            return "BIASED"
        return "inconclusive"

    def second(self, prefix_id: int) -> dict[int, int | None]:
        """Per seed: the token after the prefix, None where the first token was not the prefix."""
        return {s: (t[1] if len(t) > 1 and t[0] == prefix_id else None) for s, t in self.tokens.items()}


def chi_square(counts: dict[int, int], reference: dict[int, float]) -> tuple[float, float]:
    """Pearson's chi-square of `counts` against `reference` (scipy.stats.chisquare). A token the
    reference gives probability 0 makes the test fail outright (p 0)."""
    from scipy.stats import chisquare
    n = sum(counts.values())
    if n == 0:
        return 0.0, 1.0
    if any(c and reference.get(t, 0.0) == 0.0 for t, c in counts.items()):
        return float("inf"), 0.0
    ids = sorted(reference)
    obs = np.array([counts.get(t, 0) for t in ids], dtype=float)
    exp = np.array([reference[t] for t in ids], dtype=float)
    exp = exp / exp.sum() * n
    stat, p = chisquare(obs, exp)
    return float(stat), float(p)


def tv_curve(outcomes: Sequence[int], reference: Mapping[int, float], sizes: Sequence[int]
             ) -> list[tuple[int, float]]:
    """The total variation distance, 1/2 sum_t |f_n(t) - p(t)|, between the first n outcomes' frequencies
    and `reference`, for each n in `sizes` (those larger than the outcomes are left out). A sampler of
    `reference` has distances that shrink like 1/sqrt(n) (tv_noise); a biased one's settle at its bias.

    >>> tv_curve([1, 1, 2, 1], {1: 0.5, 2: 0.5}, [2, 4, 8])
    [(2, 0.5), (4, 0.25)]
    """
    out = []
    for n in sizes:
        if n > len(outcomes) or n <= 0:
            continue
        head = outcomes[:n]
        seen = set(head) | set(reference)
        out.append((n, 0.5 * sum(abs(head.count(t) / n - reference.get(t, 0.0)) for t in seen)))
    return out


def tv_noise(reference: Mapping[int, float], n: int, z: float = 3.0) -> float:
    """A bound on the distance sampling noise alone gives n draws of `reference`: z times
    1/2 sum_t sqrt(p(1-p)/n), the sum of the frequencies' standard errors (E|f - p| <= sd).

    >>> round(tv_noise({1: 0.5, 2: 0.5}, 100), 3)
    0.15
    """
    return z * 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in reference.values())


def outcomes(run: "PathRun", prefix_id: int) -> list[int]:
    """The token after the prefix, seed by seed in seed order, of the seeds that drew the prefix."""
    return [t for _, t in sorted(run.second(prefix_id).items()) if t is not None]


# --- the reference ---------------------------------------------------------------------------

def _settings(seed: int):
    """The lab's request (SAMPLING, the seed, N_PREDICT) on a server with default flags."""
    from replay.settings.sampling import effective, server_sampling
    return effective("/completion", {**SAMPLING, "seed": seed, "n_predict": N_PREDICT}, server_sampling())


def _params(seed: int):
    return _settings(seed).params


def _after(model, seqs: list[list[int]]) -> list[tuple[np.ndarray, "Dist"]]:
    """For each token sequence: the loaded model's logits after it, and its candidates after the
    lab's sampler chain."""
    from replay.proof.example_loop import Dist
    from replay.runtime.llama import Context
    from replay.runtime.sampler import SamplerChain
    out = []
    with Context(model, n_ctx=N_CTX, n_threads=1) as ctx:
        chain = SamplerChain(model, _params(1))
        try:
            for seq in seqs:
                ctx.clear()
                ctx.decode(seq, 0, [False] * (len(seq) - 1) + [True])
                logits = ctx.logits(len(seq) - 1).copy()
                out.append((logits, Dist.of(chain.apply(logits)[0])))
        finally:
            chain.close()
    return out


@functools.lru_cache(maxsize=8)
def _vocab(target: Path) -> tuple[dict[int, str], frozenset[int]]:
    """The fixture's pieces by id and its end-of-generation ids (loaded once per model file)."""
    from replay.runtime.llama import Model
    with Model(target) as m:
        return ({t: m.piece(t).decode("utf-8", "replace") for t in range(m.n_vocab)},
                frozenset(m.eog_ids))


@functools.lru_cache(maxsize=8)
def tokenize(lab: Lab) -> tuple[list[int], int]:
    from replay.runtime.llama import Model
    with Model(lab.target) as m:
        ids = m.tokenize(lab.prompt, add_special=True, parse_special=False)
        pre = m.tokenize(lab.prefix, add_special=False, parse_special=False)
    if len(pre) != 1:
        raise SpecReplayError(f"the prefix {lab.prefix!r} must be one token, it is {len(pre)}")
    return ids, pre[0]


def reference(lab: Lab) -> dict[int, float]:
    """The target's post-sampling probabilities after prompt + prefix, computed in-process."""
    from replay.runtime.llama import Model
    ids, pre = tokenize(lab)
    with Model(lab.target) as m:
        (_, after), = _after(m, [ids + [pre]])
    return dict(zip(after.ids, after.p))


def server_reference(url: str, lab: Lab) -> dict[int, float]:
    """The same, as the server reports it (`post_sampling_probs` of the first token after prompt + prefix)."""
    from replay.llamacpp.http import post_json
    body = {**lab.body(1), "prompt": lab.prompt + lab.prefix, "n_predict": 1, "n_probs": 8,
            "post_sampling_probs": True}
    r = post_json(url, "/completion", body)
    entry = r["completion_probabilities"][0]
    return {int(t["id"]): float(t["prob"]) for t in entry["top_probs"]}


# --- the paths -------------------------------------------------------------------------------

def _split(seeds: range, k: int) -> list[list[int]]:
    return [list(seeds)[i::k] for i in range(k)]


def run_server(binary: Path, lab: Lab, draft_sampling: str | None, speculate: bool, *, key: str, label: str,
               progress: Progress | None = None, workers: int = 2) -> PathRun:
    """Paths a and b: one single-slot server per core, seeds split between them."""
    from replay.llamacpp.http import post_json
    from replay.llamacpp.process import LlamaServer, ServerConfig
    cfg = ServerConfig(lab.target, n_ctx=N_CTX, threads=1)
    if speculate:
        cfg = cfg.with_flags(draft_model=lab.draft, spec_types=("draft-simple",), draft_sampling=draft_sampling)
    out: dict[int, tuple[int, ...]] = {}
    lock = threading.Lock()
    total = len(lab.seeds)

    def work(seeds: list[int]) -> None:
        with LlamaServer(cfg, binary=binary) as srv:
            for s in seeds:
                toks = tuple(post_json(srv.url, "/completion", lab.body(s))["tokens"][:2])
                with lock:
                    out[s] = toks
                    if progress:
                        progress(label, len(out), total)

    with cf.ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(work, part) for part in _split(lab.seeds, workers)]:
            f.result()
    return PathRun(key, label, out)


_worker: dict = {}


def _trace_init(target: str, draft: str, share: int) -> None:
    from replay.runtime.llama import Model, set_verbose
    from replay.settings.config import set_batch_threads
    set_verbose(False)
    set_batch_threads(share)  # its share of the cores: workers whose batches spin on each other's cores crawl
    _worker["target"], _worker["draft"] = Model(target), Model(draft)


def _trace_seed(args: tuple[list[int], str, int]) -> tuple[int, tuple[int, ...]]:
    from replay.builds.loop_shapes import NEWEST
    from replay.loop.loop import SpeculativeLoop
    from replay.loop.request import Request
    from replay.schedule.memory import SlotConfig
    from replay.settings import ContextConfig
    from replay.settings import resolve
    ids, sampling, seed = args
    spec = resolve("speculative", flags={"spec_types": ("draft-simple",), "draft_sampling": sampling})
    loop = SpeculativeLoop(_worker["target"], Request(tuple(ids), _settings(seed), spec), era=NEWEST,
                           slot_config=SlotConfig.of(ContextConfig(n_ctx=N_CTX, threads=1, n_parallel=1)),
                           draft_model=_worker["draft"])
    try:
        for _step in loop.steps():
            if len(loop.emitted) >= 2:
                break
    finally:
        loop.close()
    return seed, tuple(e.id for e in loop.emitted[:2])


def run_trace(lab: Lab, sampling: str, *, key: str, label: str, progress: Progress | None = None,
              workers: int = 2) -> PathRun:
    """Path c: the trace loop in-process, seeds spread over worker processes."""
    import multiprocessing as mp
    from replay.settings.config import core_share
    ids, _ = tokenize(lab)
    out: dict[int, tuple[int, ...]] = {}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_trace_init,
                                initargs=(str(lab.target), str(lab.draft), core_share(workers))) as ex:
        for seed, toks in ex.map(_trace_seed, [(ids, sampling, s) for s in lab.seeds], chunksize=16):
            out[seed] = toks
            if progress:
                progress(label, len(out), len(lab.seeds))
    return PathRun(key, label, out)


def run_example_binary(binary: Path, lab: Lab, *, key: str, label: str, progress: Progress | None = None,
                       workers: int = 1) -> PathRun:
    """Path d: the real llama-speculative, one process per seed (one at a time by default: its
    log thread loses output far more often when processes compete for the cores). It prints
    the prompt followed by the generated text; on the fixture every character is one token."""
    from replay.llamacpp.kernels import runnable_program
    binary = runnable_program(binary).program  # the best CPU variant that runs on this host
    pieces, eog = _vocab(lab.target)
    by_char = {p: t for t, p in pieces.items()}
    args = ["-m", str(lab.target), "-md", str(lab.draft), "-p", lab.prompt, "-n", "4", "-c", str(N_CTX), "-t", "1",
            "--temp", "1.0", "--top-k", "3", "--top-p", "1.0", "--min-p", "0.0", "--repeat-penalty", "1.0",
            "--samplers", ";".join(SAMPLING["samplers"])]
    out: dict[int, tuple[int, ...]] = {}
    lock = threading.Lock()

    def one(seed: int) -> None:
        # The example prints through common_log's worker thread, which can lose the tail of its
        # output (stdout or --log-file alike; 1 run in ~20 here, far more while a build competes for
        # the CPU: the worker is starved and the process exits first). The text is looked
        # for in both; a run is deterministic for its seed, so one without it is simply rerun.
        for _attempt in range(20):
            with tempfile.TemporaryDirectory() as tmp:
                log = Path(tmp) / "out.log"
                p = subprocess.run([str(binary), *args, "--seed", str(seed), "--log-file", str(log)],
                                   capture_output=True, text=True, timeout=120)
                text = (log.read_text(errors="replace") if log.exists() else "") + "\n" + p.stdout
            if p.returncode != 0:
                break
            m = re.search(r"n_predict\s*=\s*(\d+)", text + p.stderr)
            if m is None:
                continue  # the stats at the end were lost, so the text may be too
            gen = _generated(text, lab.prompt, by_char)
            if len(gen) < min(2, int(m.group(1))):
                gen.append(min(eog))  # the end-of-generation token prints as nothing
            break
        else:
            raise SpecReplayError(f"{binary.name} --seed {seed}: no complete output in 20 runs")
        if p.returncode != 0:
            raise SpecReplayError(f"{binary.name} --seed {seed} failed (exit {p.returncode}): "
                                  f"{(p.stderr.strip().splitlines() or ['no output'])[-1]}")
        with lock:
            out[seed] = tuple(gen[:2])
            if progress:
                progress(label, len(out), len(lab.seeds))

    with cf.ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(one, s) for s in lab.seeds]:
            f.result()
    return PathRun(key, label, out)


def _generated(text: str, prompt: str, by_char: dict[str, int]) -> list[int]:
    """The token ids printed right after the prompt (each fixture token is one character)."""
    at = text.find(prompt)
    gen: list[int] = []
    if at >= 0:
        for c in text[at + len(prompt):]:
            if c not in by_char:
                break
            gen.append(by_char[c])
    return gen


def run_example_model(lab: Lab, *, fixed: bool, key: str, label: str) -> PathRun:
    """Paths e and f: example_loop.py, seed by seed, on in-process candidate lists.

    Only the first two tokens matter, so the candidates after the prompt and after each
    possible first token are computed once; the per-seed work is the example's random draws.
    The draft's own sampler is a clone of the target's (speculative.cpp:467-470), so its draw
    for the first draft token is the target chain's second draw; that only matters when the
    drafted token is the sampled one (`fixed`)."""
    from replay.numerics.rng import MinStdRand0
    from replay.proof.example_loop import first_token, verify
    from replay.runtime.llama import Model
    from replay.runtime.sampler import SamplerChain
    ids, _ = tokenize(lab)
    _, eog = _vocab(lab.target)
    out: dict[int, tuple[int, ...]] = {}
    with Model(lab.target) as mt, Model(lab.draft) as md:
        (logits0, tgt0), = _after(mt, [ids])
        firsts = list(tgt0.ids)  # the only possible first tokens
        tgt_after = {t: d for t, (_, d) in zip(firsts, _after(mt, [ids + [t] for t in firsts]))}
        dft_after = dict(zip(firsts, _after(md, [ids + [t] for t in firsts])))
        for seed in lab.seeds:
            rng = MinStdRand0(seed)
            t1 = first_token(rng, tgt0)
            if t1 in eog:
                out[seed] = (t1,)
                continue
            draft_logits, draft_dist = dft_after[t1]
            if fixed:
                chain = SamplerChain(mt, _params(seed))
                try:
                    chain.apply(logits0)  # the target's (discarded) sample of the first token
                    cands, sel = chain.apply(draft_logits)  # the cloned chain drafts
                    x = int(cands["id"][sel])
                finally:
                    chain.close()
            else:
                x = draft_dist.ids[0]
            t2, _ = verify(rng, tgt_after[t1], draft_dist, x, fixed=fixed)
            out[seed] = (t1, t2)
    return PathRun(key, label, out)


def finish(run: PathRun, prefix_id: int, ref: dict[int, float]) -> PathRun:
    sec = [t for t in run.second(prefix_id).values() if t is not None]
    run.counts = {t: sec.count(t) for t in sorted(set(sec))}
    run.runs = len(sec)
    run.chi2, run.p_value = chi_square(run.counts, ref)
    return run


def agreement(a: PathRun, b: PathRun) -> tuple[int, int]:
    """Seeds on which two paths produced the same first two tokens, of the seeds both ran."""
    common = sorted(set(a.tokens) & set(b.tokens))
    return sum(a.tokens[s] == b.tokens[s] for s in common), len(common)


@dataclass
class LabResult:
    lab: Lab
    prefix_id: int
    reference: dict[int, float]
    server_reference: dict[int, float] | None
    paths: list[PathRun]
    pieces: dict[int, str]

    def path(self, key: str) -> PathRun | None:
        return next((p for p in self.paths if p.key == key), None)

    def agreements(self) -> list[tuple[str, str, int, int]]:
        """Pairs that must agree seed for seed: (key a, key b, same, of)."""
        out = []
        for a, b in (("b-greedy", "c-greedy"), ("b-probabilistic", "c-probabilistic"), ("d", "e"),
                     ("d-patched", "f")):
            pa, pb = self.path(a), self.path(b)
            if pa and pb:
                out.append((a, b, *agreement(pa, pb)))
        return out

    def to_json(self) -> dict:
        tok = lambda t: self.pieces.get(t, str(t))
        return {
            "prompt": self.lab.prompt, "prefix": self.lab.prefix, "seeds": len(self.lab.seeds), "sampling": SAMPLING,
            "reference": {tok(t): p for t, p in self.reference.items()},
            "server_reference": None if self.server_reference is None else
            {tok(t): p for t, p in self.server_reference.items()},
            "paths": [{"key": p.key, "label": p.label, "runs_with_prefix": p.runs,
                       "counts": {tok(t): c for t, c in p.counts.items()},
                       "chi2": p.chi2, "p_value": p.p_value, "verdict": p.verdict} for p in self.paths],
            "agreement": [{"a": a, "b": b, "same": s, "seeds": n} for a, b, s, n in self.agreements()],
        }

    def table(self) -> tuple[list[list], list[str]]:
        toks = sorted(self.reference, key=lambda t: -self.reference[t])
        head = ["path", "runs"] + [f"{self.pieces[t]!s}" for t in toks] + ["other", "chi2", "p", "verdict"]
        rows = [["reference (target p)", ""] + [f"{self.reference[t]:.3f}" for t in toks] + ["", "", "", ""]]
        for p in self.paths:
            n = max(p.runs, 1)
            other = sum(c for t, c in p.counts.items() if t not in self.reference)
            rows.append([f"{p.key} {p.label}", p.runs] + [f"{p.counts.get(t, 0) / n:.3f}" for t in toks]
                        + [f"{other / n:.3f}", f"{p.chi2:.1f}", f"{p.p_value:.2g}", p.verdict])
        return rows, head


def run_lab(lab: Lab, server_binary: Path, speculative_binary: Path | None, *,
            patched_speculative: Path | None = None, progress: Progress | None = None,
            paths: tuple[str, ...] | None = None) -> LabResult:
    """Run every path (or the keys in `paths`) and test each against the reference."""
    from replay.llamacpp.process import LlamaServer, ServerConfig
    _, pre = tokenize(lab)
    ref = reference(lab)
    pieces, _ = _vocab(lab.target)
    with LlamaServer(ServerConfig(lab.target, n_ctx=N_CTX, threads=1), binary=server_binary) as srv:
        srv_ref = server_reference(srv.url, lab)
    want = lambda k: paths is None or k in paths
    runs: list[PathRun] = []
    if want("a"):
        runs.append(run_server(server_binary, lab, None, False, key="a", label="llama-server, no speculation",
                               progress=progress))
    for mode in ("greedy", "probabilistic"):
        if want(f"b-{mode}"):
            runs.append(run_server(server_binary, lab, mode, True, key=f"b-{mode}",
                                   label=f"llama-server, draft-simple {mode}", progress=progress))
        if want(f"c-{mode}"):
            runs.append(run_trace(lab, mode, key=f"c-{mode}", label=f"spec-replay trace, {mode}", progress=progress))
    if speculative_binary is not None and want("d"):
        runs.append(run_example_binary(speculative_binary, lab, key="d", label="llama-speculative",
                                       progress=progress))
    if want("e"):
        runs.append(run_example_model(lab, fixed=False, key="e", label="example reimplemented"))
    if want("f"):
        runs.append(run_example_model(lab, fixed=True, key="f", label="example, both defects fixed"))
    if patched_speculative is not None and want("d-patched"):
        runs.append(run_example_binary(patched_speculative, lab, key="d-patched",
                                       label="llama-speculative, patched", progress=progress))
    for r in runs:
        finish(r, pre, ref)
    return LabResult(lab, pre, ref, srv_ref, runs, pieces)


def example_binaries(source: Path | None, profile: str, log=None) -> tuple[Path, Path]:
    """The pristine and the patched (`patches.example_patch`) llama-speculative of a tree."""
    from replay.llamacpp.build import BuildSpec, ensure_built
    from replay.proof.patch_proof import pinned_tree, saved_patch
    from replay.proof.patches import example_patch
    tree = Path(source) if source is not None else pinned_tree(profile)
    diff = example_patch(tree).diff
    plain = ensure_built(BuildSpec(profile, source_dir=source), log=log)
    patched = ensure_built(BuildSpec(profile, source_dir=source, patch=saved_patch(diff, "example")), log=log)
    return plain.speculative, patched.speculative


def render(res: LabResult) -> str:
    from tabulate import tabulate
    rows, head = res.table()
    out = [f"prompt {res.lab.prompt!r}, prefix {res.lab.prefix!r}, {len(res.lab.seeds)} seeds; "
           "frequencies of the token after the prefix", tabulate(rows, headers=head)]
    if res.server_reference is not None:
        d = max(abs(res.server_reference.get(t, 0.0) - p) for t, p in res.reference.items())
        out.append(f"reference cross-check: the server's post_sampling_probs differ by at most {d:.2g}")
    for a, b, same, n in res.agreements():
        out.append(f"{a} vs {b}: identical first two tokens for {same}/{n} seeds")
    return "\n".join(out)
