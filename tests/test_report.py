"""End-to-end: the smoke configuration builds `all` (every table, the claims audit, the sweep, the
RPB readings, the figures) and `snakemake --report` bundles them (slow: runs the whole tiny DAG).
It extends the suite's shared smoke run (conftest.smoke_run), so table 1's jobs are not repeated.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import smoke_pipeline

ROOT = Path(__file__).resolve().parents[1]
# The smoke `all` extends the shared one-seed run by about 50 jobs: a few minutes on the 2-core
# machine lightly loaded, but up to 15 heavily loaded, past the suite's 600 s default per test.
VERDICTS = {"supported", "not supported", "inconclusive", "not testable"}


@pytest.fixture(scope="module")
def smoke_all(smoke_run: Path) -> Path:
    smoke_pipeline.run_or_fail(smoke_run, "all", "--cores", "2")
    return smoke_run


def _plan_cost_module():
    spec = importlib.util.spec_from_file_location("plan_cost", ROOT / "bench" / "plan_cost.py")
    plan_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_cost)
    return plan_cost


def test_plan_cost_estimates_a_job_from_the_rules_that_do_the_same_work(tmp_path: Path) -> None:
    """A rule none of whose jobs ran (the diagnostics' evaluations, after `make table1`) is
    estimated at its pool's median, not counted as 0 s; a rule with no pool and no measured job
    is 0 s."""
    plan_cost = _plan_cost_module()
    folder = tmp_path / "benchmarks" / "eval"
    folder.mkdir(parents=True)
    (folder / "tinyA_math_base_base0_seed0.tsv").write_text("s\th:m:s\n10.0\t0:00:10\n")
    cost = plan_cost.plan_cost("default-all", tmp_path)
    assert cost["evaluate"]["measured"] == 1 and cost["evaluate"]["median_s"] == 10.0
    for rule in ("diagnostic_evaluate", "router_swap_evaluate"):
        assert cost[rule]["estimated_s"] == 10.0 * cost[rule]["planned"] > 0, rule
    assert cost["router_swap"]["estimated_s"] == 0.0
    assert cost["posttrain_run"]["estimated_s"] == 0.0  # no training measured


@pytest.mark.slow
def test_plan_cost_finds_every_rules_benchmarks(smoke_all: Path) -> None:
    """bench/plan_cost.py names each rule's benchmark files as the rules write them: the narrowed
    smoke `all` ran at least one job of every benchmarked rule of the smoke plan, and each is found
    (a wrong name would read "0 measured" and be estimated instead)."""
    plan_cost = _plan_cost_module()
    cost = plan_cost.plan_cost("smoke-all", smoke_all)
    assert set(cost) == set(plan_cost.BENCHMARK_DIRS)
    for rule, c in cost.items():
        assert c["measured"] >= 1 and c["measured_s"] > 0, rule


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_all_builds_every_table(smoke_all: Path) -> None:
    names = ("table1", "table2", "table3", "table4", "table5", "sweep", "claims", "rpb_readings")
    for name in names:
        assert (smoke_all / f"{name}.csv").stat().st_size > 0, name
        assert (smoke_all / f"{name}.md").stat().st_size > 0, name
    table2 = pd.read_csv(smoke_all / "table2.csv")
    assert list(table2["method"]) == ["base", "none", "lbl", "rpb"]
    assert set(table2["model"]) == {"tinyB"} and table2["paper_in_domain"].isna().all()
    table3 = pd.read_csv(smoke_all / "table3.csv")
    assert list(table3["model"]) == ["tinyA", "tinyA"]  # smoke: family A only
    assert set(table3["corpus"]) == {"math2"}
    finite = table3[["method_score", "reference_score", "diff", "diff_ci_low", "diff_ci_high"]]
    assert finite.map(math.isfinite).all().all()
    assert (table3["diff_ci_low"] <= table3["diff_ci_high"]).all()
    assert table3["p_value"].between(0, 1).all()
    table4 = pd.read_csv(smoke_all / "table4.csv")
    assert set(table4["method"]) == {"rpb", "anchor_weight", "anchor_logit", "anchor_kl"}
    assert table4["rank_in_domain"].between(1, 4).all()
    consistency = pd.read_csv(smoke_all / "table4_consistency.csv")
    assert list(consistency["metric"]) == ["in_domain", "in_domain_p", "ood_mean", "ood_mean_p"]
    table5 = pd.read_csv(smoke_all / "table5.csv")
    assert list(table5["method"]) == ["base", "none", "lbl", "rpb", "hard"]
    # The base against itself retains its co-activation structure exactly.
    assert table5.loc[0, "coact_cosine"] == pytest.approx(1.0)
    base = pd.read_csv(smoke_all / "table5_base.csv")
    assert "mean" in set(base["layer"].astype(str)) and (base["top_k"] == 2).all()
    sweep = pd.read_csv(smoke_all / "sweep.csv")
    assert set(sweep["curve"]) == {"rpb", "anchor_kl"}
    assert sweep.groupby("curve")["strength"].min().eq(0).all()
    assert sweep.groupby("curve")["strength"].max().map(math.isinf).all()
    readings = pd.read_csv(smoke_all / "rpb_readings.csv").set_index("method")
    assert list(readings.index) == ["none", "rpb_select", "rpb_keep", "hard"]
    # hard is analysed with the base selection it was trained with (eval_routing re-attached).
    assert readings.loc["hard", "topk_overlap_with_base"] == pytest.approx(1.0)
    assert readings.loc["rpb_keep", "anchors"] in {"yes", "no", "undetermined"}
    drift = pd.read_csv(smoke_all / "drift.csv")
    assert drift["kl_to_base"].notna().any() and drift["step"].max() == 10


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_claims_and_figures(smoke_all: Path) -> None:
    claims = pd.read_csv(smoke_all / "claims.csv")  # one row per part of each claim and control
    assert list(dict.fromkeys(claims["claim"])) == ["C1", "C2", "C3", "C4", "C5", "C6", "P1", "P2"]
    # A verdict may carry its reason: "inconclusive (underpowered: ...)", "not testable: ...".
    for column in ("verdict", "claim_verdict"):
        assert {v.split(":")[0].split(" (")[0] for v in claims[column]} <= VERDICTS, column
    assert claims["evidence"].str.len().gt(20).all()
    assert "45.77" in claims[claims["claim"] == "C1"]["paper"].iloc[0]
    figures = smoke_all / "figures"
    for stem in (
        "table1_coactivation",
        "table2_coactivation",
        "table4_coactivation",
        "table5_coactivation",
        "retention_vs_in_domain",
        "retention_vs_ood_mean",
        "sweep",
        "drift",
    ):
        for ext in (".png", ".pdf"):
            assert (figures / f"{stem}{ext}").stat().st_size > 1000, stem + ext


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_report_bundles_tables_and_figures(smoke_all: Path) -> None:
    report = smoke_all / "report.html"
    proc = smoke_pipeline.run(smoke_all, "all", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = report.read_text(errors="replace")
    for name in ("claims.csv", "table3.csv", "table5_correlation.csv", "sweep.png", "drift.png"):
        assert name in html, name
    # Nothing left to do: the report did not rerun anything and `all` is complete.
    dry = smoke_pipeline.run(smoke_all, "all", "--dry-run")
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr


# The report checks themselves are unit-tested in tests/test_config_check.py; this checks that a bad
# report config stops a Snakemake invocation with one line and no traceback.
@pytest.mark.workflow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "tables:\n  table2: {model: tinyB, corpus: math, methods: [none, rbp]}\n",
            "config error: tables.table2.methods: 'rbp' is not a key of methods",
        ),
    ],
)
def test_bad_report_config_is_one_line(tmp_path: Path, override: str, message: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(override)
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    cmd = [sys.executable, "-m", "snakemake", "-n", "--configfile", "config/smoke.yaml", str(bad)]
    cmd += ["--config", f"results_dir={tmp_path / 'results'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
