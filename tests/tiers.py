"""The default run and the `wide` tier.

A proof that holds on several configurations (endpoints, sampling, drafters, architectures, kernels)
runs by default on a few that cover each axis at least once; its other configurations carry the
`wide` marker and run with `pytest -m wide` (docs/testing.md), so that CI, which runs the default,
stays well under an hour from a cold machine. Nothing in `wide` is weaker than what the default
runs: the same assertions, on more servers.
"""
from __future__ import annotations

from typing import Any, Iterable

import pytest

WIDE = pytest.mark.wide


def default_and_wide(values: Iterable[Any], keep: Iterable[str], *, ids: Iterable[str] | None = None) -> list:
    """`values` for `pytest.mark.parametrize`, each one whose id (its value when it has no id) is in
    `keep` running by default and the rest marked `wide`. A tuple is a multi-argument parameter set.
    An id in `keep` that names no parameter is an error, so a renamed case cannot drop silently.

    >>> [p.marks for p in default_and_wide(["a", "b"], {"a"})] == [(), (WIDE,)]
    True
    >>> default_and_wide([("x", 1)], {"y"}, ids=["x1"])
    Traceback (most recent call last):
    ...
    ValueError: kept by default but not a parameter: ['y']
    """
    values = list(values)
    names = list(ids) if ids is not None else [str(v) for v in values]
    keep = set(keep)
    unknown = sorted(keep - set(names))
    if unknown:
        raise ValueError(f"kept by default but not a parameter: {unknown}")
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=name,
                         marks=() if name in keep else (WIDE,))
            for v, name in zip(values, names)]
