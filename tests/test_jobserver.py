"""The job server (rpb.jobserver): a job handed to it behaves as the same `rpb` command run in
its own process (outputs, exit status, error line on the client's stderr), and the server's
name changes with its key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rpb.jobserver import _connect, address

RPB = [sys.executable, "-c", "import sys; from rpb.cli import main; sys.exit(main())"]


def _env(key: str) -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, RPB_JOB_SERVER=key, RPB_JOB_SERVER_IDLE="5", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def test_a_served_job_writes_its_outputs_and_reports_errors(tmp_path: Path) -> None:
    key = f"test-{tmp_path}"
    env = _env(key)
    store = tmp_path / "mlflow.db"
    ok = subprocess.run(
        [*RPB, "init-tracking", "--tracking-uri", f"sqlite:///{store}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ok.returncode == 0, ok.stderr
    assert store.is_file() and "MLflow store ready" in ok.stderr  # the job's log reached us
    server = _connect(address(key))  # the first client started it; it idles for 5 s
    assert server is not None, "no job server answers: the job ran in the client"
    server.close()
    eval_args = ["--name", "m", "--label", "x", "--model", "missing", "--eval-dir", "."]
    eval_args += ["--tasks", "math", "--work", "w", "--out", "o.json"]
    bad = subprocess.run(
        [*RPB, "eval", *eval_args, "--tracking-uri", f"sqlite:///{store}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # Bad input: the same one-line error and status as without the server.
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("rpb eval: error:")


def test_the_server_name_depends_on_its_key() -> None:
    first, second = address("a"), address("b")
    assert first != second and first == address("a")
    assert first.startswith("\0")  # abstract: no socket file to go stale
