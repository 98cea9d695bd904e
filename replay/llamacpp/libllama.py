"""Which libllama replays a transcript: the server's own build's, when it is at hand and callable.

A llama.cpp build's llama-server and its libllama share one ggml (our CMakeLists.txt builds them
together, shared). Replaying on that libllama makes every kernel the server's, so a draft model's
argmax at a near-tie and the last bit of a logprob come out as the server's did. It is at hand when
the user gives the checkout (`--source DIR`, built under DIR/build) or the library (`--libllama`), or
when `spec-replay build --build bN` has built the transcript's build. It is callable when its
llama.h declares what the replay uses as llama-cpp-python's binding does (runtime/binding.py:
abi_differences; measured on the index: b10679 and later are, b10666 and older are not).
Otherwise the binding's own libllama (0c1e570 = b11311) is used, and the report says so.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from replay.builds.loop_shapes import BUILD_0C1E570, build_of
from replay.errors import BindingError
from replay.llamacpp.build import Binaries, BuildSpec, find_built
from replay.runtime.binding import LibChoice, check_library, header_near, library_file

BUNDLED = "llama-cpp-python's own libllama (llama.cpp 0c1e570 = b11311)"
UNNAMED = "the transcript names no single build"  # the build is then chosen by evidence (run/build_choice.py)


def _tree_library(source: Path) -> Path | None:
    for d in (source / "build" / "bin", source.parent / "build" / "bin"):
        lib = library_file(d)
        if lib is not None:
            return lib
    return None


def _built_library(n: int) -> tuple[Path | None, Path | None]:
    """The build's own libllama: its release-style build (every CPU variant: the replay can load the
    server's), else a native one."""
    profile = "0c1e570" if n == BUILD_0C1E570 else f"b{n}"
    bins = find_built(BuildSpec(profile)) or find_built(BuildSpec(profile, cpu="native"))
    if bins is None:
        return None, None
    source = bins.manifest.get("source")
    return library_file(bins.bin_dir), Path(source) if source else None


def libllama_for(*, explicit: str | None = None, source: Path | None = None, build: int | None = None,
                 build_infos: Iterable[str | None] = ()) -> LibChoice:
    """The libllama to replay with, and why: `--libllama PATH` (or `bundled`), else the `--source`
    checkout's build, else the build (`--build N`, or the one build every record's build_info names)
    if `spec-replay build` has built it. A library found but not callable through the binding falls
    back to the bundled one with a warning; one given explicitly is an error."""
    if explicit == "bundled":
        return LibChoice(None, "--libllama bundled")
    if explicit:
        lib = library_file(Path(explicit))
        if lib is None:
            raise BindingError(f"--libllama {explicit}: no libllama.so there")
        header = header_near(lib, source)
        diffs = check_library(lib, header)
        if diffs:
            raise BindingError(f"--libllama {explicit}: cannot be called through llama-cpp-python's binding: {diffs[0]}")
        return LibChoice(lib, f"--libllama {explicit}", header)
    lib, header, label, n = None, None, "", None
    if source is not None:
        lib, label = _tree_library(Path(source)), f"--source {source}"
        header = header_near(lib, Path(source)) if lib else None
        if lib is None:
            return LibChoice(None, f"{label} has no build/bin/libllama.so", warning=None)
    else:
        if build is not None:
            n, label = build, f"--build {build}"
        else:
            numbers = {build_of(b) for b in build_infos}
            if len(numbers) == 1 and None not in numbers:
                n = numbers.pop()
                label = f"build_info b{n}"
        if n is None:
            return LibChoice(None, UNNAMED)
        if n == BUILD_0C1E570:
            return LibChoice(None, f"{label}: the binding's own build")
        lib, tree = _built_library(n)
        if lib is None:
            return LibChoice(None, f"{label} is not built here",
                             hint=f"`spec-replay build --build b{n}` makes b{n}'s own kernels available "
                                  "to the replay")
        header = header_near(lib, tree)
    return _checked(lib, header, label)


def libllama_of(bins: Binaries) -> LibChoice:
    """The libllama built beside `bins`' llama-server, if the binding can call it (else the bundled one)."""
    lib = library_file(bins.bin_dir)
    source = bins.manifest.get("source")
    if lib is None:
        return LibChoice(None, f"{bins.key} has no libllama.so in {bins.bin_dir}")
    return _checked(lib, header_near(lib, Path(source) if source else None), f"the {bins.key} build")


def _checked(lib: Path, header: Path | None, label: str) -> LibChoice:
    diffs = check_library(lib, header)
    if diffs:
        return LibChoice(None, f"{label}: its libllama cannot be called through llama-cpp-python's binding",
                         warning=f"{lib} is not callable through llama-cpp-python 0.3.36's binding ({diffs[0]}); "
                                 f"replaying on {BUNDLED}: a draft model's argmax at a "
                                 "near-tie and the last bits of a logprob may differ from the server's")
    return LibChoice(lib, f"{label}: the build's own", header)
