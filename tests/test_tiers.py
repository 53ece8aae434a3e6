"""The test tiers: the unit tier (`make test-fast`, not slow and not workflow) starts no Snakemake
process; conftest's guard fails a unit test that does, naming the mark it lacks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import starts_snakemake


def test_a_unit_test_that_starts_snakemake_fails_naming_the_mark() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"Snakemake: mark it @pytest\.mark\.workflow"):
        subprocess.run([sys.executable, "-m", "snakemake", "--version"], capture_output=True)


@pytest.mark.workflow
def test_a_workflow_test_may_start_snakemake() -> None:
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--version"], capture_output=True)
    assert proc.returncode == 0


def test_the_guard_reads_snakemake_command_lines() -> None:
    assert starts_snakemake(["snakemake", "-n"])
    assert starts_snakemake(["/venv/bin/snakemake", "--cores", "2"])
    assert starts_snakemake(["unshare", "-rn", sys.executable, "-m", "snakemake", "-n"])
    assert starts_snakemake("python -m snakemake -n")
    # Snakemake named as data (a lock holder's recorded command, a path) is not a Snakemake run.
    assert not starts_snakemake([sys.executable, "-c", "pass", "--command", "snakemake -n"])
    assert not starts_snakemake([sys.executable, "holder.py", "snakemake"])
    assert not starts_snakemake(["git", "log", "--", "workflow/snakemake.log"])
