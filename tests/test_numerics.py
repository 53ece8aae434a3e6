"""The pinned CPU numeric path (rpb.numerics): what a pinned process runs with, and that a
pipeline job refuses to compute on any other path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rpb.numerics import LOCK_ENV, PIN_ENV, PINNED, pinned_environment
from rpb.pipeline import jobserver

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*PINNED, PIN_ENV, "RPB_JOB_SERVER")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT), **extra)
    return env


def test_the_job_server_tells_numeric_paths_apart() -> None:
    # A server started under other kernel settings must not run a pinned job (rpb.jobserver).
    assert set(jobserver.NUMERIC_ENV) == {*PINNED, PIN_ENV}
    assert {*PINNED, PIN_ENV} <= set(pinned_environment())


def test_a_pinned_process_computes_on_the_pinned_path() -> None:
    code = (
        "import json; from rpb.numerics import apply_pinned, numeric_path; "
        "apply_pinned(); print(json.dumps(numeric_path()))"
    )
    env = _env(**pinned_environment(), **{LOCK_ENV: "a" * 64})
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    path = json.loads(out.stdout.strip().splitlines()[-1])
    assert path["pinned"] is True
    assert path["capability"] == "AVX2" and path["mkl_cbwr"] == "COMPATIBLE"
    assert path["onednn"] is False and path["threads"] == 1
    assert path["lock_sha256"] == "a" * 64
    assert path["cpu"] and path["torch"].startswith("2.")


def test_a_pipeline_job_off_the_pinned_path_stops_in_one_line(tmp_path: Path) -> None:
    env = _env(**{**pinned_environment(), "ATEN_CPU_CAPABILITY": "default"})
    job = [
        "pipeline",
        "permute-prior",
        "--prior",
        str(tmp_path / "p"),
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "rpb.cli", *job],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "ATen runs DEFAULT kernels" in lines[0] and "cpu_numerics: free" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_suite_computes_on_the_pinned_kernels() -> None:
    # tests/conftest.py sets them before torch's import: a CPU-dependent test fails everywhere.
    import torch

    assert {name: os.environ.get(name) for name in PINNED} == PINNED
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
