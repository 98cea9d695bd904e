"""The probes' processes compute with the package the run itself imported (run/kernels/processes.py
_context), wherever the run was started (quick tier: no model, no library).

Specification: a run started in a directory that holds another `replay` package (a clone at another
commit, a project of the user's) forks its probes from a server that imports the run's own package,
not that directory's.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import replay

ROOT = Path(replay.__file__).resolve().parent.parent
CHILD = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import concurrent.futures as cf, importlib.util
from replay.run.kernels.processes import _context
with cf.ProcessPoolExecutor(1, mp_context=_context()) as pool:
    print(pool.submit(importlib.util.find_spec, "replay").result().origin)
"""


def test_a_probe_imports_the_runs_own_package_not_the_working_directorys(tmp_path: Path):
    decoy = tmp_path / "replay"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("DECOY = True  # another package of the same name\n")
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert Path(p.stdout.strip()).resolve() == (ROOT / "replay" / "__init__.py").resolve(), p.stdout
