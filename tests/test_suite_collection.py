"""No test module holds libllama's lazy binding `L` as a module-level name. pytest looks at every
module-level name while collecting (its `__test__` attribute, for one), and a look at `L` loads a
libllama: llama-cpp-python's own, before tests/conftest.py chooses b11434's for a run with `build`
tests, and the whole run then stops at collection ("libllama is already loaded ..."), as a full run
did when two test files imported it so."""
from __future__ import annotations

import ast

from replay.paths import REPO_ROOT


def _module_level_names(path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module == "replay.runtime.binding":
            names |= {a.asname or a.name for a in node.names}
    return names


def test_no_test_module_imports_the_lazy_binding_at_module_level():
    bad = [p.name for p in sorted((REPO_ROOT / "tests").glob("*.py")) if "L" in _module_level_names(p)]
    assert not bad, f"import L inside the functions that use it: {bad}"
