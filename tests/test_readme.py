"""The README stays true: its first command runs and prints the numbers it quotes, CI runs its
second command, the quick tier it names is the one the markers make, and every link in it and in
docs/ reaches a file (and a heading) that exists."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from replay.paths import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def _commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    main_job, tests = _commands()
    assert main_job.startswith("scripts/setup && spec-replay recover ")
    assert tests == "scripts/setup && python3 -m pytest -q"
    assert tests in (REPO_ROOT / ".ci" / "run").read_text()
    assert len(README.splitlines()) <= 160


def test_the_first_command_prints_what_the_readme_says(tmp_path):
    args = shlex.split(_commands()[0].split("&&", 1)[1])[1:]
    args = [a.replace("/tmp/", f"{tmp_path}/") for a in args]
    p = subprocess.run([sys.executable, "-m", "replay.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    for quoted in ("-0.0961", "-1.5692", "4.803", "-1.061"):
        assert quoted in README and quoted in p.stdout, quoted
    assert (tmp_path / "tiny-repaired.json").is_file() and (tmp_path / "tiny-report.html").is_file()


def test_the_quick_tier_the_readme_names_is_the_one_the_markers_make():
    """Every marker but other_builds, sweeps and wide (which the default run leaves out: the quick tier's -m
    replaces addopts') is excluded, in pyproject's order."""
    block = re.search(r"^markers = \[\n(.*?)^\]", (REPO_ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    names = [n for n in re.findall(r'^\s*"(\w+):', block, re.M) if n not in ("other_builds", "sweeps", "wide")]
    quick = " and ".join(f"not {n}" for n in names)
    assert f'python3 -m pytest -q -m "{quick}"' in README
    assert quick in (REPO_ROOT / "docs" / "testing.md").read_text()


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_heading(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
            assert anchor in headings, f"{page.name}: #{anchor} is no heading of {dest.name}"
