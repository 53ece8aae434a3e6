"""End-to-end smoke run of the Snakemake pipeline on config/smoke.yaml (the slowest test)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def _snakemake(results: Path, *targets: str, dry_run: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    # The rules call `rpb`; make the current interpreter's scripts visible.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [
        *SNAKEMAKE,
        *targets,
        "--cores",
        "2",
        "--configfile",
        "config/smoke.yaml",
        "--config",
        f"results_dir={results}",
    ]
    if dry_run:
        cmd.append("--dry-run")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory) -> Path:
    results = tmp_path_factory.mktemp("smoke") / "results"
    proc = _snakemake(results, f"{results}/table1.csv")
    if proc.returncode != 0:
        logs = "\n".join(
            f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(results.glob("logs/**/*.log"))
        )
        pytest.fail(f"smoke pipeline failed:\n{proc.stderr[-4000:]}\n{logs}")
    return results


@pytest.mark.slow
def test_table1_shape_and_finite(smoke_results: Path) -> None:
    table = pd.read_csv(smoke_results / "table1.csv")
    assert list(table["method"]) == ["base", "none", "lbl", "rpb"]
    ood = ["addition", "facts", "reverse", "sort", "grammar"]
    expected = [
        "model",
        "method",
        "n_seeds",
        "in_domain",
        "in_domain_ci_low",
        "in_domain_ci_high",
        *[f"ood_{t}" for t in ood],
        "ood_mean",
        "modularity",
        "community_nmi",
        "coact_cosine",
        "paper_in_domain",
    ]
    assert list(table.columns) == expected
    assert list(table["n_seeds"]) == [1, 2, 2, 2]
    measured = table[[c for c in expected[3:-1] if c != "community_nmi"]]
    assert measured.map(math.isfinite).all().all(), measured
    assert (
        (table["in_domain_ci_low"] <= table["in_domain"])
        & (table["in_domain"] <= table["in_domain_ci_high"])
    ).all()
    # The paper's numbers appear only where the paper reports them.
    paper = dict(zip(table["method"], table["paper_in_domain"], strict=True))
    assert paper["rpb"] == 45.77 and paper["lbl"] == 31.91 and paper["none"] == 29.44
    assert math.isnan(paper["base"])
    assert (smoke_results / "figures" / "table1_coactivation.png").stat().st_size > 0
    # The base compared with itself retains its co-activation structure exactly.
    assert table.loc[0, "coact_cosine"] == pytest.approx(1.0)


@pytest.mark.slow
def test_mlflow_has_one_finished_run_per_job(smoke_results: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{smoke_results / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rpb")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    names = sorted(r.info.run_name for r in runs)
    assert all(r.info.status == "FINISHED" for r in runs), [
        (r.info.run_name, r.info.status) for r in runs
    ]
    assert len(names) == len(set(names)), "a job was recorded twice"
    seeds, methods = (0, 1), ("none", "lbl", "rpb")
    expected = {
        "corpora/-/-/seed-",
        "pretrain/tinyA/lbl/seed0",
        "prior/tinyA/-/seed-",
        "table1/tinyA/-/seed-",
        "eval/tinyA/base/seed0",
        "analysis/tinyA/base/seed0",
    }
    for m in methods:
        for s in seeds:
            expected |= {
                f"train/tinyA/{m}/seed{s}",
                f"eval/tinyA/{m}/seed{s}",
                f"analysis/tinyA/{m}/seed{s}",
            }
    assert set(names) == expected
    train = next(r for r in runs if r.info.run_name == "train/tinyA/rpb/seed0")
    # Lineage: the training run names the base and prior runs it consumed.
    assert train.data.tags["parent.base"] and train.data.tags["parent.prior"]
    assert train.data.tags["stage"] == "train" and train.data.tags["method"] == "rpb"
    history = client.get_metric_history(train.info.run_id, "task_loss")
    assert len(history) >= 2, "training should log its loss as it goes"


@pytest.mark.slow
def test_second_invocation_has_nothing_to_do(smoke_results: Path) -> None:
    proc = _snakemake(smoke_results, f"{smoke_results}/table1.csv", dry_run=True)
    assert proc.returncode == 0, proc.stderr
    assert "Nothing to be done" in proc.stdout + proc.stderr
