"""The engine a run computes with, chosen once (runtime/engine.py EngineChoice: the libllama, its CPU
kernels, the repack, the threads), before anything loads a model.

    choose_engine(inputs, flags, options, ...) -> EngineChoice

1. The libllama (llamacpp/libllama.py libllama_for): --libllama, else the --source checkout's build,
   else the transcript's build's own when it is built here and callable, else llama-cpp-python's own.
   A process that already loaded one (tests, notebooks) keeps it, and says so.
2. Its CPU kernels, where it is a release-style build with a libggml-cpu-<variant>.so per x86 level
   (run/kernels/policy.py): --server-cpu, else the variant whose evaluation of the transcript's first
   real entry is the server's.

What the choice says goes through `say(line, warning)` as it happens (the command line prints it on
stderr: warnings always, the rest unless --json) and is kept in the value's notes. Applying it is the
task's, once per process (EngineChoice.apply).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from replay.commands.recover import RecoverOptions
from replay.llamacpp.libllama import UNNAMED, libllama_for
from replay.run.build_choice import candidates_here, choose_build, nothing_built_line
from replay.run.inputs import Inputs
from replay.run.kernels.policy import choose_kernels
from replay.runtime import binding
from replay.runtime.binding import LibChoice, library_file
from replay.runtime.engine import EngineChoice

Say = Callable[..., None]  # (line, warning=False, detail=False): a warning; a detail shown only with -v


def _quiet(line: str, warning: bool = False, detail: bool = False) -> None:
    pass


def choose_engine(inputs: Inputs, *, flags: dict, options: RecoverOptions | None = None, libllama: str | None = None,
                  threads: int | None = None, server_cpu: str | None = None, say: Say | None = None,
                  guess: bool = False) -> EngineChoice:
    """The engine for a run over `inputs`, with the server flags given here (settings attrs) and the
    options (`build` and `source` choose the libllama; the rest how kernels are judged). `libllama`:
    --libllama (a path, or "bundled"); `threads`: -t of every context (None: each context's own);
    `guess`: the caller can start again on other kernels (run/kernels/policy.py choose_kernels)."""
    options = options or RecoverOptions()
    say = say or _quiet
    notes: list[str] = []

    def tell(line: str, warning: bool = False, detail: bool = False) -> None:
        if not detail:
            notes.append(line)
        say(line, warning, detail)
    lib, kept = _libllama(inputs, libllama, options, tell)
    loaded, _ = binding.variant_in_process()
    if lib.why == UNNAMED and not kept and not loaded:
        cands = candidates_here()
        if not cands:
            tell(f"warning: {nothing_built_line()}", True)
        else:
            got = choose_build(inputs, cands, flags=flags, options=options, server_cpu=server_cpu, say=tell,
                               guess=guess)
            lib = LibChoice(got.candidate.lib.path, got.why, got.candidate.lib.header)
            tell(f"libllama: {got.candidate.lib.path}, {got.why}" if got.decided else
                 f"warning: build undecided: {got.why}; values are approximate (numerics.bound)", not got.decided)
            k = got.kernels
            return EngineChoice(lib, k.choice, k.repack, threads, kept, tuple(notes), k.tried,
                                build=got.candidate.number, build_why=got.why, build_decided=got.decided)
    lib_dir = binding.chosen_dir() if loaded else _dir_of(lib)
    kernels = choose_kernels(inputs, lib_dir=lib_dir, flags=flags, options=options, server_cpu=server_cpu,
                             say=tell, guess=guess and not loaded)
    return EngineChoice(lib, kernels.choice, kernels.repack, threads, kept, tuple(notes), kernels.tried)


def _libllama(inputs: Inputs, explicit: str | None, options: RecoverOptions,
              tell: Callable[..., None]) -> tuple[LibChoice, bool]:
    """The libllama for this run and whether another, already loaded in this process, stays instead
    (then the loaded one is the engine's: workers load that)."""
    infos = [r.server_build for r in inputs.records]
    choice = libllama_for(explicit=explicit, source=options.source and Path(options.source), build=options.build,
                          build_infos=infos)
    if binding.keeps(choice, strict=bool(explicit)):  # in-process reuse (tests, notebooks): keep what is loaded
        have = binding.loaded_path()
        tell(f"libllama: {have or 'llama-cpp-python own'} (already loaded in this process; {choice.describe()} "
             "not used)")
        return LibChoice(have, "already loaded in this process"), True
    if choice.why != UNNAMED:  # else the build is chosen by evidence, and said then
        tell(f"libllama: {choice.describe()}")
    if choice.warning:
        tell(f"warning: {choice.warning}", True)
    if choice.hint:
        tell(f"hint: {choice.hint}")
    return choice, False


def _dir_of(choice: LibChoice) -> Path | None:
    """The directory whose CPU variants a library choice loads: the one it names, as given."""
    lib = library_file(Path(choice.path).absolute()) if choice.path is not None else None
    return lib.parent if lib is not None else None
