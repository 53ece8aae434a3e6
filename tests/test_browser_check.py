"""bench/browser_check.py on the suite's shared smoke run (conftest.smoke_run), as a user runs it
(its own process, a fresh headless Chromium profile): MLflow's UI with the Assistant panel as it
opens, table 1's view on p(target), and Snakemake's report. Skipped where Debian's `chromium` is
not installed (`apt-get install chromium`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # an MLflow server, a Chromium, snakemake --report: about a minute
def test_browser_check_passes_on_the_smoke_run(smoke_run: Path, tmp_path: Path) -> None:
    if shutil.which("chromium") is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium): browser check skipped")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "browser_check.py"), "--results", str(smoke_run)]
    proc = subprocess.run(
        [*cmd, "--screenshots", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "browser check passed" in proc.stdout, out[-4000:]
    # It looked with the Assistant panel as MLflow opens it, and at table 1's view.
    assert "MLflow's Assistant panel open as the page opens: True" in proc.stdout, out[-4000:]
    assert "ok   table 1's view opens on the p(target) charts" in proc.stdout
    assert (tmp_path / "mlflow_table1_view.png").stat().st_size > 10_000
