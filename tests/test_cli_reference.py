"""docs/cli.md is every command's real --help (generated with cog from replay/cli/reference.py):
this fails when an option or a docstring changed and the page was not regenerated."""
from __future__ import annotations

import subprocess
import sys

from replay.paths import REPO_ROOT as ROOT


def test_the_cli_reference_is_the_current_help():
    p = subprocess.run([sys.executable, "-m", "cogapp", "--check", "--diff", "docs/cli.md"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, f"docs/cli.md is stale: run `cog -r docs/cli.md`\n{p.stdout[-3000:]}{p.stderr[-2000:]}"


def test_every_command_has_a_section():
    from replay.cli import main
    text = (ROOT / "docs" / "cli.md").read_text()
    for name in main.commands:
        assert f"\n## spec-replay {name}\n" in text, name
