"""End-to-end: the suite's smoke run of the pipeline (conftest.smoke_run, one seed) builds table 1,
records one MLflow run per job, and leaves nothing to do for a second invocation."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import smoke_pipeline
from smoke_pipeline import snakemake_in_repo


@pytest.fixture
def smoke_results(smoke_run: Path) -> Path:
    return smoke_run


def _dry_run(*args: str) -> str:
    """`snakemake -n -p` from the repository root with `args`; its whole output."""
    proc = snakemake_in_repo("-n", "-p", "--cores", "1", *args)
    return proc.stdout + proc.stderr


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
        "in_domain_p",
        "in_domain_p_ci_low",
        "in_domain_p_ci_high",
        *[c for t in ood for c in (f"ood_{t}", f"ood_{t}_p")],
        "ood_mean",
        "ood_mean_p",
        "modularity",
        "community_nmi",
        "coact_cosine",
        "paper_in_domain",
    ]
    assert list(table.columns) == expected
    assert list(table["n_seeds"]) == [1, 1, 1, 1]
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
    runs = [r for r in runs if r.data.tags.get("stage") != "invocation"]  # the parent run
    names = sorted(r.info.run_name for r in runs)
    assert all(r.info.status == "FINISHED" for r in runs), [
        (r.info.run_name, r.info.status) for r in runs
    ]
    assert len(names) == len(set(names)), "a job was recorded twice"
    # Table 1's methods, and hard: the readings rule's upper end, which its check M2 reads.
    seeds, methods = (0,), ("none", "lbl", "rpb", "hard")
    expected = {
        "corpora",
        "pretrain/tinyA/base0",
        "prior/tinyA/math/base0",
        "table1/tinyA/math",
        "eval/tinyA/math/base/base0/seed0",
        "analysis/tinyA/math/base/base0/seed0",
    }
    for m in methods:
        for s in seeds:
            expected |= {
                f"train/tinyA/math/{m}/base0/seed{s}",
                f"eval/tinyA/math/{m}/base0/seed{s}",
                f"analysis/tinyA/math/{m}/base0/seed{s}",
            }
    assert set(names) == expected
    train = next(r for r in runs if r.info.run_name == "train/tinyA/math/rpb/base0/seed0")
    # Lineage: the training run names the base and prior runs it consumed.
    assert train.data.tags["parent.base"] and train.data.tags["parent.prior"]
    assert train.data.tags["stage"] == "train" and train.data.tags["method"] == "rpb"
    history = client.get_metric_history(train.info.run_id, "task_loss")
    assert len(history) >= 2, "training should log its loss as it goes"


@pytest.mark.slow
def test_every_job_ran_on_the_native_numeric_path(smoke_results: Path) -> None:
    """The smoke config computes on the default CPU numeric path (rpb.numerics' native): every
    job's MLflow run records it, and table 1's provenance names one path for all its trainings.
    Fails if a job ran without the pinning (an MKL mode set, oneDNN on, or more threads)."""
    import torch
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{smoke_results / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rpb")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    jobs = [r for r in runs if r.data.tags.get("stage") != "invocation"]
    assert jobs
    # This test process runs the suite's compatible kernels; a job runs the CPU's own widest.
    native = "AVX512" if "avx512f" in Path("/proc/cpuinfo").read_text() else None
    for run in jobs:
        params = run.data.params
        assert params["numerics.pinned"] == "True", run.info.run_name
        assert params["numerics.path"] == "native", run.info.run_name
        if native:
            assert params["numerics.capability"] == native, run.info.run_name
        assert params["numerics.mkl_cbwr"] == "unset", run.info.run_name
        assert params["numerics.onednn"] == "False", run.info.run_name
        assert params["numerics.threads"] == "1", run.info.run_name
        assert len(params["numerics.lock_sha256"]) == 64, run.info.run_name
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    meta = json.loads((smoke_results / "table1.meta.json").read_text())
    (path,) = meta["numeric_paths"]
    assert path["path"]["path"] == "native" and path["path"]["mkl_cbwr"] == "unset"
    assert path["trainings"] == 4  # the base and none, lbl, rpb on it


@pytest.mark.slow
def test_second_invocation_has_nothing_to_do(smoke_results: Path) -> None:
    proc = smoke_pipeline.run(smoke_results, f"{smoke_results}/table1.csv", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.workflow
def test_replicate_bases_train_their_own_runs_from_their_own_base(tmp_path: Path) -> None:
    """The smoke config's second base of tinyA: it is pretrained, and run base1/seed<s> is seed s
    trained from it, with its own prior, evaluated and pooled into table 1 (dry run)."""
    out = tmp_path / "results"
    text = _dry_run(
        *("--configfile", "config/smoke.yaml", "--config", f"results_dir={out}"),
        *("--", f"{out}/table1.csv"),
    )
    # The replicate is pretrained as tinyA's base 1, under the name its runs carry.
    assert "--name tinyA_base1 --model-type deepseek_v3" in text
    assert f"--out {out}/models/tinyA/base1 " in text
    runs = [line for line in text.splitlines() if "rpb pipeline run --name" in line]
    # Seed 0 on base 1, as its training spec names it.
    replica = [line for line in runs if '"base": 1,' in line and '"seed": 0,' in line]
    # 3 methods x 2 seeds x 2 bases, and hard (check M2's runs) at the readings' seed 0 per base
    assert len(replica) == 4 and len(runs) == 14
    for line in replica:
        assert f"--base {out}/models/tinyA/base1/model" in line
        assert f"--prior {out}/priors/tinyA/base1/math.safetensors" in line
        assert f"--out {out}/runs/tinyA/math/" in line and "/base1/seed0 " in line
    assert all("base1" not in line for line in runs if '"base": 1,' not in line)
    # The spec names the run by its base and seed; the torch seed is derived (TrainSpec).
    specs = [re.search(r"--spec '(.*?)'", line)[1] for line in replica]
    assert all("1000" not in spec and json.loads(spec)["seed"] == 0 for spec in specs)


@pytest.mark.workflow
def test_a_models_own_holdout_trains_and_reads_its_prior_from_its_own_corpora(
    tmp_path: Path,
) -> None:
    """models.<m>.holdout (a hold-out per family, docs/testbed.md): that model's prior and runs
    read the hold-out's corpus, written by its own job; the other model, and the shared eval
    sets, are unchanged (dry run)."""
    out = tmp_path / "results"
    extra = tmp_path / "holdout.yaml"
    extra.write_text("models:\n  tinyB:\n    holdout: below50\n")
    text = _dry_run(
        *("--configfile", "config/smoke.yaml", str(extra), "--config", f"results_dir={out}"),
        *(
            "--",
            f"{out}/eval/tinyB/math/none/base0/seed0.json",
            f"{out}/eval/tinyA/math/none/base0/seed0.json",
        ),
    )
    own = f"{out}/data/holdout/below50/post/math.jsonl"
    assert f"--out {out}/data/holdout/below50 --seed" in text and "--holdout below50" in text
    jobs = ("rpb pipeline run --name", "rpb pipeline prior --name")
    lines = [ln for ln in text.splitlines() if any(job in ln for job in jobs)]
    assert len(lines) == 4  # a prior and a run per model
    for line in lines:
        model = "tinyB" if "--name tinyB" in line else "tinyA"
        corpus = own if model == "tinyB" else f"{out}/data/post/math.jsonl"
        assert f"--corpus {corpus}" in line, line


@pytest.mark.workflow
def test_exploratory_tables_run_their_own_seeds(tmp_path: Path) -> None:
    """tables.readings.seeds and tables.drift.seeds (exploratory tables may run fewer seeds than
    the confirmatory ones, docs/claims.md): the readings' runs, the audit's M2 and the drift
    curves read those seeds on every base; table 2 keeps tables.seeds."""
    out = tmp_path / "results"
    extra = tmp_path / "seeds.yaml"
    extra.write_text("tables:\n  readings:\n    seeds: [0]\n  drift:\n    seeds: [1]\n")
    text = _dry_run(
        *("--configfile", "config/config.yaml", str(extra), "--config", f"results_dir={out}"),
        *("--", f"{out}/rpb_readings.csv", f"{out}/drift.csv", f"{out}/table2.csv"),
    )
    job = r"rpb pipeline {} --results \S+ --spec '(.*?)' --out"
    specs = {
        name: json.loads(re.search(job.format(name), text)[1])
        for name in ("readings", "drift", "table2")
    }
    # Seed 0 on each of tinyA's two bases; the entry's own seeds are spelled out as its runs.
    assert specs["readings"]["runs"] == ["base0/seed0", "base1/seed0"]
    assert specs["drift"]["runs"] == ["base0/seed1", "base1/seed1"]
    assert specs["table2"]["runs"] == ["base0/seed0", "base0/seed1", "base1/seed0", "base1/seed1"]
    assert not any("seeds" in spec for spec in specs.values())
    out_dir = r"--label (\w+) .*?--out \S+/runs/tinyA/math/\w+/(base\d+/seed\d+)"
    trained = set(re.findall(out_dir, text))
    only_readings = set(specs["readings"]["methods"]) - set(specs["drift"]["methods"])
    readings_runs = {s for m, s in trained if m in only_readings}
    assert only_readings and readings_runs == {"base0/seed0", "base1/seed0"}
    # M2 reads none, rpb and hard at the readings' seeds: they are scheduled there too.
    assert {("none", "base0/seed0"), ("hard", "base1/seed0"), ("rpb", "base1/seed1")} <= trained


@pytest.mark.workflow
def test_an_eval_only_set_is_evaluated_without_retraining_a_base(tmp_path: Path) -> None:
    """Naming an eval-only set (`addition3`) in evaluation.ood adds its own job and its scores to
    every evaluation; the corpora, the pretraining and the priors keep their commands (dry run)."""
    out = tmp_path / "results"
    extra = tmp_path / "eval_only.yaml"
    extra.write_text("evaluation:\n  ood: [addition, facts, reverse, sort, grammar, addition3]\n")
    args = ("--config", f"results_dir={out}", "--", f"{out}/table1.csv")
    before = _dry_run("--configfile", "config/smoke.yaml", *args)
    after = _dry_run("--configfile", "config/smoke.yaml", str(extra), *args)
    upstream = ("rpb pipeline corpora", "rpb pipeline pretrain", "rpb pipeline prior")

    def commands(text: str, jobs: tuple[str, ...]) -> list[str]:
        shell = (ln.removeprefix("Shell command: ") for ln in text.splitlines())
        return sorted(ln for ln in shell if ln.startswith(jobs))

    assert commands(before, upstream) and commands(after, upstream) == commands(before, upstream)
    assert f"rpb pipeline eval-set --data {out}/data --task addition3" in after
    runs = commands(after, ("rpb pipeline run ",))
    assert runs and all(",addition3 " in line for line in runs)


@pytest.mark.slow
def test_table1_stability_bench_judges_a_folder_like_table1s_caption(
    smoke_results: Path, tmp_path: Path
) -> None:
    """bench/table1_stability.py (docs/reproducibility.md) judges C1 and C2 of two table-1
    folders by the caption's rules: a folder against itself gives every verdict the caption's
    and no shift; its README block names the paper's gaps the intervals exclude."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]

    def bench(name: str):
        spec = importlib.util.spec_from_file_location(name, root / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    stability = bench("table1_stability")
    # The configs the smoke run was given (tests/smoke_pipeline.py writes the narrowing beside it).
    narrowing = smoke_results.parent / f"{smoke_results.name}.yaml"
    configs = [root / "config" / "config.yaml", root / "config" / "smoke.yaml", narrowing]
    out = tmp_path / "stability"
    stability.main(
        ["--a", str(smoke_results), "--b", str(smoke_results), "--out", str(out)]
        + [arg for c in configs for arg in ("--configfile", str(c))]
    )
    parts = json.loads(out.with_suffix(".json").read_text())["parts"]
    assert {p["claim"] for p in parts} == {"C1", "C2"} and len(parts) == 4
    caption = (smoke_results / "table1.md").read_text()
    for part in parts:
        assert part["verdict_a"] == part["verdict_b"]
        assert part["shift_in_mde"] == 0 or math.isnan(part["shift_in_mde"])
        assert f"{part['part']}: {part['verdict_a']} (" in caption
    block = bench("readme_table1").block(smoke_results)
    assert "The paper's in-domain gaps" in block and "| 45.77 |" in block
