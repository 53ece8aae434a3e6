"""The one smoke run of the pipeline that the slow end-to-end tests share (conftest.smoke_run).

A smoke run costs minutes on the 2-core machine, so the suite makes one: config/smoke.yaml
narrowed to one seed, with checkpoints every 3 of the 10 post-training steps, under the offline
guard (tests/offline_guard.py, and a network namespace where `unshare` works) and with a fake
HF_TOKEN in every job's environment. tests/test_pipeline.py checks table 1 and MLflow on it,
tests/test_determinism.py reruns it from scratch (with a SIGKILLed training job) and compares, and
tests/test_report.py extends the same folder to `all`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from offline_guard import guarded_env, unshare_prefix

ROOT = Path(__file__).resolve().parents[1]
# One base per family: the shared smoke run stays one base's cost. Pooling runs over replicate
# bases is checked by test_pipeline's dry run of the unnarrowed smoke config and the unit tests.
NARROW = {
    "seeds": [0],
    "posttrain": {"save_every": 3},
    "models": {"tinyA": {"replicates": []}, "tinyB": {"replicates": []}},
}
FAKE_TOKEN = "hf_" + "Xy9" * 12
# `train_launcher`: checks that the offline guard reached the job, then runs `rpb` like the console
# script; with RPB_TEST_STOP set, the `rpb` job writes its pid there and stops (SIGSTOP) inside
# its second checkpoint, once (tests/test_determinism.py kills it there).
LAUNCHER = """
import os, signal, socket, sys
from pathlib import Path
from typing import Any
if socket.socket.connect.__name__ != "_connect":
    sys.exit("the offline guard is not installed in this job")
argv = sys.argv[1:]
flag = os.environ.get("RPB_TEST_STOP")
if flag and not Path(flag).exists() and argv[argv.index("--label") + 1] == "rpb":
    from transformers import Trainer
    save_rng, calls = Trainer._save_rng_state, []
    def stop_in_second_save(self, output_dir):
        calls.append(output_dir)
        if len(calls) == 2:
            Path(flag).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        save_rng(self, output_dir)
    Trainer._save_rng_state = stop_in_second_save
from rpb.pipeline.cli import main
sys.exit(main(argv))
"""


def snakemake_command(
    results: Path, *args: str, site: Path | None = None, config: dict[str, Any] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Command and environment of a guarded, narrowed smoke invocation writing to `results`
    (`args`: targets and options; `config`: more `--config` entries). Its config and launcher
    files sit beside `results`."""
    config_file = results.parent / f"{results.name}.yaml"
    launcher = results.parent / "launcher.py"
    launcher.write_text(LAUNCHER)
    narrow = {**NARROW, "train_launcher": f"{sys.executable} {launcher}"}
    config_file.write_text(yaml.safe_dump(narrow))
    env = guarded_env(dict(os.environ), site or results.parent / "site")
    for name in ("MLFLOW_TRACKING_URI", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "RPB_TEST_STOP"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_TOKEN=FAKE_TOKEN)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    cmd = [
        *unshare_prefix(),
        *(sys.executable, "-m", "snakemake", *args),
        *("--configfile", "config/smoke.yaml", str(config_file)),
        *("--config", f"results_dir={results}"),
        *(f"{key}={value}" for key, value in (config or {}).items()),
    ]
    return cmd, env


def snakemake_in_repo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m snakemake ARGS` from the repository root, offline, one thread per job (a dry run,
    a rule listing); fails the calling test with the output's tail unless it succeeds."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


def run(results: Path, *args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    """Run a smoke invocation (see `snakemake_command`) and return the finished process."""
    cmd, env = snakemake_command(results, *args, site=site)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def run_or_fail(results: Path, *args: str, site: Path | None = None) -> None:
    """Run a smoke invocation; on failure, fail the test with its stderr and the job logs."""
    proc = run(results, *args, site=site)
    if proc.returncode != 0:
        logs = "\n".join(
            f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(results.glob("logs/**/*.log"))
        )
        pytest.fail(f"smoke pipeline failed:\n{proc.stderr[-4000:]}\n{logs[-12000:]}")
