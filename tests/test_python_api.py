"""docs/python-api.md's examples hold: the page a user reads the Python API from runs, on the committed
tiny fixtures (`dir(replay)`, recover and its result, RecoverOptions, trace, tune, the errors)."""
from __future__ import annotations

import doctest
import re

from replay.paths import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "python-api.md"


def test_the_python_api_pages_examples_hold():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    examples = "\n".join(b for b in blocks if b.lstrip().startswith(">>>"))
    test = doctest.DocTestParser().get_doctest(examples, {}, "docs/python-api.md", str(PAGE), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    got = runner.summarize(verbose=False)
    assert got.attempted >= 8 and got.failed == 0, got


def test_every_public_name_of_the_package_is_on_the_page():
    import replay
    page = PAGE.read_text()
    assert [name for name in replay.__all__ if name not in page] == []
