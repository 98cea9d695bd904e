"""`recover --ray ADDRESS`: the same units on Ray actors, on a local 2-CPU head this test starts.

* the output and journal are written by the driver, the same bytes as one local worker's;
* an actor killed mid-run is replaced and its unit retried: the run completes, same bytes;
* an actor on a node without the model file at its path gets it through Ray's object store;
* a cluster that does not answer is one line, and leaves no files behind.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import cli_command, recover_in_subprocess

from replay.errors import Exit
from replay.llamacpp.models import tiny_target

pytestmark = pytest.mark.ray

N_RECORDS = 160


def _ray_cli() -> str:
    exe = Path(sys.executable).parent / "ray"
    if not exe.exists():
        raise AssertionError("Ray is not installed: pip install -e '.[ray]' (scripts/setup does)")
    return str(exe)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    subprocess.run([_ray_cli(), "start", "--head", "--num-cpus", "2", "--port", str(port), "--node-ip-address",
                    "127.0.0.1", "--include-dashboard=false", "--disable-usage-stats"],
                   check=True, capture_output=True, env=env, timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([_ray_cli(), "stop", "--force"], capture_output=True, env=env, timeout=180)


def recover(src: Path, out: Path, *extra) -> subprocess.CompletedProcess:
    return recover_in_subprocess(src, tiny_target(), out, *extra)


def test_ray_actors_write_the_bytes_of_one_local_worker(ray_head, tiny_evals, tiny_evals_one_worker, tmp_path):
    r = recover(tiny_evals, tmp_path / "out.jsonl", "--ray", ray_head, "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == tiny_evals_one_worker
    assert not list(tmp_path.glob("out.jsonl.partial*"))


def _actors() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith("ray::RayEvaluator"):
                pids.append(int(d.name))
    return pids


def test_a_killed_actor_is_replaced_and_its_unit_retried(ray_head, tiny_evals, tiny_evals_one_worker, tmp_path):
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(cli_command("recover", tiny_evals, "-m", tiny_target(), "-o", out, "--ray", ray_head, "--workers", "2"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "out.jsonl.partial"
    deadline = time.monotonic() + 180
    while (not partial.exists() or partial.read_bytes().count(b"\n") < 8) and p.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    actors = _actors()
    assert p.poll() is None and actors, "the run ended before an actor could be killed"
    os.kill(actors[0], signal.SIGKILL)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert "a Ray actor died while recovering" in err and "retried on a new actor" in err
    assert out.read_bytes() == tiny_evals_one_worker


def test_a_node_without_the_model_file_gets_it_through_the_object_store(ray_head, tiny_evals, tiny_evals_one_worker,
                                                                        tmp_path):
    """The driver runs in a mount namespace of its own, with the model on a tmpfs only it sees: the
    actors (started by the raylet, outside it) lack the file at that path, as another node would."""
    import hashlib
    import shutil
    import tempfile
    if shutil.which("unshare") is None:
        pytest.fail("unshare(1) (util-linux) is needed to give the driver a file the actors cannot see")
    # root gets a mount namespace of its own; anyone else one inside a user namespace (unshare -r)
    unshare = ["unshare", "-m", "--propagation", "private"] if os.geteuid() == 0 else \
        ["unshare", "-r", "-m", "--propagation", "private"]
    if subprocess.run(unshare + ["true"], capture_output=True).returncode != 0:
        pytest.skip("this kernel gives neither root nor a user namespace here (kernel.unprivileged_userns_clone)")
    model = tiny_target()
    # kept under its sha256 and its own name (the name the transcript's "model" is compared with)
    shipped = Path(tempfile.gettempdir()) / "spec-replay-models" / hashlib.sha256(model.read_bytes()).hexdigest() / model.name
    shipped.unlink(missing_ok=True)
    mnt, out = tmp_path / "private", tmp_path / "out.jsonl"
    mnt.mkdir()
    recover_cmd = " ".join(map(str, cli_command("recover", tiny_evals, "-m", mnt / model.name, "-o", out,
                                                "--ray", ray_head, "--workers", "2")))
    r = subprocess.run(unshare + ["sh", "-c",
                        f"mount -t tmpfs none {mnt} && cp {model} {mnt}/{model.name} && exec {recover_cmd}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert not list(mnt.iterdir()), "the tmpfs leaked out of the driver's namespace: the test proves nothing"
    assert shipped.read_bytes() == model.read_bytes()  # what the actors loaded
    assert out.read_bytes() == tiny_evals_one_worker


def test_a_cluster_that_does_not_answer_is_one_line_and_leaves_nothing(tiny_evals, tmp_path):
    port = _free_port()  # nothing listens there
    r = recover(tiny_evals, tmp_path / "out.jsonl", "--ray", f"127.0.0.1:{port}", "--workers", "2")
    assert r.returncode == Exit.ERROR and "Traceback" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: cannot reach the Ray cluster at 127.0.0.1:{port}")
    assert not list(tmp_path.iterdir())
