"""Every example in the package's docstrings runs and gives what it shows (the quick tier: the
examples use pure functions and the committed tiny fixtures only)."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import replay

MODULES = sorted(m.name for m in pkgutil.walk_packages(replay.__path__, "replay.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"
