"""The package's layers point one way (docs/architecture.md): a module imports only from its own
package or from the layers below it, at module level or inside a function alike, and no modules
import each other round a cycle. Read from the source with ast: nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "replay"

# bottom to top: the data flows transcript -> tokens -> evaluation -> comparison -> report, with the
# commands, the runners of many records, the proof harness and the CLI on top
LAYERS = ("version", "errors", "paths", "numerics", "settings", "builds", "runtime", "llamacpp", "transcripts", "schedule",
          "tokens", "reading", "loop", "evaluation", "comparison", "tuning", "report", "commands", "run", "scale", "proxy", "proof", "cli")
RANK = {name: k for k, name in enumerate(LAYERS)}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names) of every import of the package in `path`, relative ones made
    absolute."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            if target == "replay" or target.startswith("replay."):
                out.append((n.lineno, target, tuple(a.name for a in n.names)))
        elif isinstance(n, ast.Import):  # `import replay` alone hands the package on (Ray ships it): no names
            out += [(n.lineno, a.name, ("*",)) for a in n.names if a.name.startswith("replay.")]
    return out


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "replay"


MODULES = sorted(ROOT.rglob("*.py"))


def test_every_package_has_a_layer():
    assert {_layer(_module(p)) for p in MODULES} - set(RANK) == {"replay"}  # the package root: the API facade


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_its_own_layer_or_below(path):
    here = _layer(_module(path))
    if here == "replay":
        return  # replay/__init__.py: `replay.recover`, the facade over commands/recover.py
    wrong = []
    for line, target, names in _imports(path):
        there = _layer(target)
        if there == "replay":
            if set(names) != {"__version__"}:
                wrong.append(f"{line}: {target} {names}")
        elif RANK[there] > RANK[here]:
            wrong.append(f"{line}: {target} ({there} is above {here})")
    assert not wrong, f"{path.relative_to(ROOT)} imports upward: {wrong}"


def test_no_import_cycles():
    known = {_module(p) for p in MODULES}
    graph: dict[str, set[str]] = {}
    for p in MODULES:
        deps = set()
        for _, target, names in _imports(p):
            for cand in [f"{target}.{n}" for n in names] + [target]:
                if cand in known and cand != _module(p):
                    deps.add(cand)
                    break
        graph[_module(p)] = deps
    # a package's __init__ that re-exports its modules is the package, not a cycle through it
    for m in list(graph):
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    seen, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, cycles


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The rule is not vacuous: a runtime module that imports a command fails it."""
    fake = tmp_path / "replay" / "runtime"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from replay.commands.recover import recover\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "replay")
    with pytest.raises(AssertionError, match="commands is above runtime"):
        test_a_module_imports_only_its_own_layer_or_below(fake / "bad.py")
