"""rpb.report.run_records, reading a run's outputs: paths from the results layout, per-item scores
of our eval sets and of standard tasks, run scores that weigh each benchmark the same, per-run
records, training histories and co-activation counts; every missing file or entry is an error
naming the file."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from result_worlds import PAPER_WORLD, write_json, write_run

from rpb.report.run_records import (
    base_analysis,
    base_runs,
    coactivation_counts,
    exact_match_items,
    in_domain_items,
    in_domain_tasks,
    metric_tasks,
    read_json,
    run_record,
    run_score,
    run_scores,
    runs_text,
    training_history,
)
from rpb.specs import Run, analysis_path, eval_path, results_path, runs_on

SPEC = {"ood": ["addition", "facts"]}
WHERE = Path("eval.json")


def _eval(**tasks: list[int]) -> dict:
    return {"tasks": {name: {"items": items} for name, items in tasks.items()}}


def test_paths_name_a_run_by_its_base_and_seed(tmp_path: Path) -> None:
    # Seed 2 on base 1 (tinyA's first replicate), in every path of the run.
    assert eval_path(tmp_path, "tinyA", "math", "rpb", Run(1, 2)) == (
        tmp_path / "eval/tinyA/math/rpb/base1/seed2.json"
    )
    assert analysis_path(tmp_path, "tinyA", "math", "rpb", Run(0, 2)) == (
        tmp_path / "analysis/tinyA/math/rpb/base0/seed2.json"
    )
    fields = {"model": "tinyA", "corpus": "math", "method": "rpb"}
    assert results_path("model", **fields, run=Run(1, 2)) == "runs/tinyA/math/rpb/base1/seed2/model"
    assert results_path("base_model", model="tinyA", base=1) == "models/tinyA/base1/model"


def test_notes_name_runs_by_base_and_seed() -> None:
    assert runs_text(runs_on(2, [0, 1])) == "seeds [0, 1] on bases [0, 1]"
    assert runs_text([Run(0, 0), Run(1, 2)]) == "runs base0/seed0, base1/seed2"
    # Each base is evaluated (label `base`) as its run base<b>/seed0.
    assert base_runs([Run(1, 2), Run(0, 1), Run(1, 0)]) == [Run(0, 0), Run(1, 0)]


def test_items_of_our_eval_sets_and_of_standard_tasks() -> None:
    result = _eval(rpb_math=[1, 0, 1], gsm8k=[0, 0, 1, 1])
    np.testing.assert_array_equal(exact_match_items(result, "math", WHERE), [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(exact_match_items(result, "gsm8k", WHERE), [0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"^eval\.json: no task 'rpb_mmlu' or 'mmlu' in the eval"):
        exact_match_items(result, "mmlu", WHERE)


def test_in_domain_tasks_of_a_corpus() -> None:
    assert in_domain_tasks(SPEC, "math") == ["math"]
    spec = SPEC | {"corpus_tasks": {"math": ["gsm8k", "minerva"]}}
    assert in_domain_tasks(spec, "math") == ["gsm8k", "minerva"]
    assert in_domain_tasks(spec, "math2") == ["math2"]
    assert metric_tasks(spec, "math", "ood") == ["addition", "facts"]
    with pytest.raises(ValueError, match="unknown comparison metric 'accuracy'"):
        metric_tasks(spec, "math", "accuracy")
    result = _eval(gsm8k=[1, 0], minerva=[1])
    np.testing.assert_array_equal(in_domain_items(result, spec, "math", WHERE), [1, 0, 1])


def test_a_run_score_weighs_each_benchmark_the_same() -> None:
    result = _eval(rpb_a=[1, 0, 1, 0], rpb_b=[1, 1])
    score, per_task, n_items = run_score(result, ["a", "b"], WHERE)
    assert per_task == {"a": 50.0, "b": 100.0}
    assert score == 75.0 and n_items == 6  # pooled items would give 66.7


def test_a_non_finite_item_score_names_its_file() -> None:
    """Issue 47: a NaN score stopped table1 with `per-run values must be finite`, naming no
    file."""
    result = _eval(rpb_math=[1, 0], rpb_addition=[1, float("nan"), float("inf")])
    with pytest.raises(ValueError) as raised:
        run_score(result, ["math", "addition"], WHERE)
    assert str(raised.value) == (
        "eval.json: task addition: 2 of 3 item scores are not finite (NaN or inf); delete the "
        "file and rerun the pipeline to evaluate the run again"
    )


def test_run_scores_are_per_run_and_must_pair_item_by_item(tmp_path: Path) -> None:
    runs = [Run(0, 0), Run(1, 0)]
    for run, items in zip(runs, ([1, 1, 0, 0], [1, 1, 1, 0]), strict=True):
        write_json(eval_path(tmp_path, "m", "math", "rpb", run), _eval(rpb_math=items))
    scores, n_items = run_scores(tmp_path, SPEC, "m", "math", "rpb", runs, "in_domain")
    np.testing.assert_array_equal(scores, [50.0, 75.0])
    assert n_items == 4
    write_json(eval_path(tmp_path, "m", "math", "rpb", runs[1]), _eval(rpb_math=[1, 0]))
    with pytest.raises(
        ValueError, match=r"rpb/base1/seed0\.json: 2 items, but run base0/seed0 has 4"
    ):
        run_scores(tmp_path, SPEC, "m", "math", "rpb", runs, "in_domain")


def test_a_run_record_is_accuracy_and_the_layer_means(tmp_path: Path) -> None:
    run = Run(0, 1)
    write_run(tmp_path, "m", "math", "rpb", run, PAPER_WORLD["rpb"])
    record = run_record(tmp_path, SPEC, "m", "math", "rpb", run)
    u = np.random.default_rng(1001).random(40)  # write_run's item draw for seed 1 on base 0
    assert record["in_domain"] == pytest.approx(100 * np.mean(u < 0.8))
    assert record["ood_mean"] == pytest.approx(100 * np.mean(u < 0.8))
    assert record["community_nmi"] == pytest.approx(0.71)
    assert list(record)[:5] == ["model", "corpus", "method", "base", "seed"]
    assert {k: record[k] for k in ("model", "corpus", "method", "base", "seed")} == {
        "model": "m",
        "corpus": "math",
        "method": "rpb",
        "base": 0,
        "seed": 1,
    }
    path = analysis_path(tmp_path, "m", "math", "rpb", run)
    write_json(path, {"mean": {"modularity": 0.3}})
    assert math.isnan(run_record(tmp_path, SPEC, "m", "math", "rpb", run)["kl_to_base"])
    write_json(path, {"layers": []})
    with pytest.raises(ValueError, match=re.escape(f"{path}: no 'mean' entry")):
        run_record(tmp_path, SPEC, "m", "math", "rpb", run)


def test_a_missing_output_names_the_file_and_who_needs_it(tmp_path: Path) -> None:
    path = tmp_path / "eval" / "x.json"
    with pytest.raises(FileNotFoundError, match=re.escape(f"missing input for the table: {path}")):
        read_json(path)
    with pytest.raises(FileNotFoundError, match="missing input for the router-swap table: "):
        read_json(path, "the router-swap table")


def test_a_rewritten_output_is_read_again(tmp_path: Path) -> None:
    """read_json parses each file once; a file rewritten in place (same size) or replaced by a
    rename is read anew, never from the earlier parse."""
    path = tmp_path / "eval.json"
    path.write_text('{"score": 1}')
    assert read_json(path) == {"score": 1}
    assert read_json(path) is read_json(path)  # parsed once
    with path.open("r+") as fh:
        fh.write('{"score": 2}')
    assert read_json(path) == {"score": 2}
    replacement = tmp_path / "new.json"
    replacement.write_text('{"score": 3}')
    replacement.replace(path)
    assert read_json(path) == {"score": 3}


def test_training_history(tmp_path: Path) -> None:
    run = Run(0, 0)
    fields = {"model": "m", "corpus": "math", "method": "none", "run": run}
    path = tmp_path / results_path("train_history", **fields)
    write_json(path, {"history": [{"step": 2, "task_loss": 1.5}]})
    assert training_history(tmp_path, "m", "math", "none", run) == [{"step": 2, "task_loss": 1.5}]
    write_json(path, {"history": []})
    with pytest.raises(ValueError, match=re.escape(f"{path}: no 'history' entries")):
        training_history(tmp_path, "m", "math", "none", run)


def test_coactivation_counts_of_the_base_and_each_method(tmp_path: Path) -> None:
    run = Run(0, 0)
    for label in ("base", "none", "rpb"):
        write_run(tmp_path, "m", "math", label, run, PAPER_WORLD[label])
    named = coactivation_counts(tmp_path, "m", "math", ["none", "rpb"], run)
    assert list(named) == ["base", "none (base0/seed0)", "rpb (base0/seed0)"]
    summary, base = base_analysis(tmp_path, "m", "math")
    np.testing.assert_array_equal(named["base"], base)
    assert summary["probe"]["tokens"] == 600 and base.shape == (2, 4, 4)
    assert not np.array_equal(named["none (base0/seed0)"], base)
    # A corpus without a base analysis: the base counts stored beside the first method's.
    analysis_path(tmp_path, "m", "math", "base", run).with_suffix(".safetensors").unlink()
    fallback = coactivation_counts(tmp_path, "m", "math", ["none", "rpb"], run)
    np.testing.assert_array_equal(fallback["base"], base)
    with pytest.raises(
        FileNotFoundError, match=r"missing input for the figure: .*hard/base0/seed0"
    ):
        coactivation_counts(tmp_path, "m", "math", ["none", "hard"], run)
