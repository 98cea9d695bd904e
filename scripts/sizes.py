#!/usr/bin/env python3
"""The package's classes over 250 lines and functions over 60, the bars docs/architecture.md sets:

    python3 scripts/sizes.py            # one line each: KIND path name lines
    python3 scripts/sizes.py --all      # every class and function, longest first

Read from the source with ast: nothing is imported. tests/test_sizes.py holds the package to the bars.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASS_BAR, FUNCTION_BAR = 250, 60


def sizes(root: Path = ROOT / "replay") -> list[tuple[str, str, str, int]]:
    """(kind, path relative to the repository, qualified name, lines) of every class and function."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))

        def visit(node: ast.AST, prefix: str) -> None:
            for n in ast.iter_child_nodes(node):
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    kind = "class" if isinstance(n, ast.ClassDef) else "function"
                    out.append((kind, rel, prefix + n.name, n.end_lineno - n.lineno + 1))
                    visit(n, prefix + n.name + ".")
        visit(ast.parse(path.read_text()), "")
    return out


def over_bars(found: list[tuple[str, str, str, int]]) -> list[tuple[str, str, str, int]]:
    """Those over their bar, longest first."""
    return sorted((s for s in found if s[3] > (CLASS_BAR if s[0] == "class" else FUNCTION_BAR)), key=lambda s: -s[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every class and function, longest first")
    args = ap.parse_args()
    found = sizes()
    for kind, path, name, n in (sorted(found, key=lambda s: -s[3]) if args.all else over_bars(found)):
        print(f"{kind:<8} {path}:{name} {n}")


if __name__ == "__main__":
    main()
