"""The CPU numeric paths (rpb.numerics): what a process on each path runs with, and that a
pipeline job refuses to compute on any other path than the one it was started on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpb.numerics import (
    COMPATIBLE,
    KERNEL_ENV,
    LOCK_ENV,
    PATHS,
    PIN_ENV,
    path_environment,
)
from rpb.pipeline import jobserver

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*KERNEL_ENV, PIN_ENV, "RPB_JOB_SERVER")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _path_in(env: dict[str, str]) -> dict:
    code = (
        "import json; from rpb.numerics import apply_path, numeric_path; "
        "apply_path(); print(json.dumps(numeric_path()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_job_server_tells_numeric_paths_apart() -> None:
    # A server started under other kernel settings must not run a pinned job (rpb.jobserver).
    assert set(jobserver.NUMERIC_ENV) == {*KERNEL_ENV, PIN_ENV}
    for name, path in PATHS.items():
        assert set(path.env) <= set(KERNEL_ENV), name
        assert path_environment(name)[PIN_ENV] == name


def test_a_compatible_process_computes_on_the_compatible_path() -> None:
    path = _path_in(_env(**path_environment("compatible"), **{LOCK_ENV: "a" * 64}))
    assert path["pinned"] is True and path["path"] == "compatible"
    assert path["capability"] == "AVX2" and path["mkl_cbwr"] == "COMPATIBLE"
    assert path["onednn"] is False and path["threads"] == 1
    assert path["lock_sha256"] == "a" * 64
    assert path["cpu"] and path["torch"].startswith("2.")


def test_a_native_process_runs_the_cpus_own_kernels() -> None:
    import torch

    path = _path_in(_env(**path_environment("native")))
    assert path["path"] == "native" and path["mkl_cbwr"] == "unset"
    assert path["onednn"] is False and path["threads"] == 1
    # The widest the CPU has: not the AVX2 this (compatible-pinned) test process was started on,
    # unless the CPU's widest is AVX2.
    assert path["capability"] in ("AVX512", "AVX2", "DEFAULT")
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        assert path["capability"] == "AVX512"
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"


@pytest.mark.parametrize(
    ("path", "change", "says"),
    [
        ("compatible", {"ATEN_CPU_CAPABILITY": "default"}, "ATen runs DEFAULT kernels"),
        ("native", {"MKL_CBWR": "COMPATIBLE"}, "MKL_CBWR=COMPATIBLE in this job's environment"),
        ("native", {"ATEN_CPU_CAPABILITY": "avx2"}, "ATEN_CPU_CAPABILITY=avx2 in this job's"),
        ("native", {PIN_ENV: "fast"}, "RPB_CPU_NUMERICS=fast names no CPU numeric path"),
    ],
)
def test_a_pipeline_job_off_its_numeric_path_stops_in_one_line(
    tmp_path: Path, path: str, change: dict[str, str], says: str
) -> None:
    env = _env(**{**path_environment(path), **change})
    job = [
        "pipeline",
        "permute-prior",
        "--prior",
        str(tmp_path / "p"),
        "--out",
        str(tmp_path / "o"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "rpb.cli", *job], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert says in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


def test_the_suite_computes_on_the_compatible_kernels() -> None:
    # tests/conftest.py sets them before torch's import: a test on near-ties sees the kernels it
    # was written on, whatever this CPU's widest are.
    import torch

    assert {name: os.environ.get(name) for name in COMPATIBLE} == COMPATIBLE
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
