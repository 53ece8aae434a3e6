"""rpb.pipeline.relayout: a results folder of the first layout (run ids in paths, replicate bases
as models of their own) moves to `base{b}/seed{s}` paths, and the move is the whole difference
between the two layouts' plans."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from test_plan_snapshot import CASES, RESULTS_TOKEN, snapshot_path

from rpb.pipeline.cli import main
from rpb.pipeline.relayout import (
    apply_moves,
    current_path,
    legacy_bases,
    misread_diagnostics,
    moves,
)

# Each pretrained model of the shipped configs with one replicate (pretraining seed 1).
MODELS = {"tinyA": {"replicates": [1]}, "tinyB": {"replicates": [1]}, "moonlight": {}, "qwen3": {}}
BASES = legacy_bases(MODELS | {"q": {}})
# The job lists of the default, smoke and paper `all` as the first layout planned them (rule,
# outputs, inputs; tests/test_plan_snapshot.py's format at commit 26ce7c7).
LEGACY_PLANS = Path(__file__).parent / "data" / "plan_snapshot" / "layout_v1.json.gz"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("models/tinyA/base/model", "models/tinyA/base0/model"),
        ("models/tinyA_p1/base", "models/tinyA/base1"),
        ("models/q/base/model/config.json", "models/q/base0/model/config.json"),
        ("priors/tinyA_p1/math.safetensors", "priors/tinyA/base1/math.safetensors"),
        ("priors/tinyB/math2.run/mlflow_run.json", "priors/tinyB/base0/math2.run/mlflow_run.json"),
        ("priors/tinyA/permuted", "priors/tinyA/base0/permuted"),
        ("runs/tinyA/math/rpb/seed1002", "runs/tinyA/math/rpb/base1/seed2"),
        ("eval/tinyA/math/base/seed1000.json", "eval/tinyA/math/base/base1/seed0.json"),
        ("eval/tinyA/math/rpb/seed3.run", "eval/tinyA/math/rpb/base0/seed3.run"),
        (
            "analysis/tinyB/math/none/seed1.safetensors",
            "analysis/tinyB/math/none/base0/seed1.safetensors",
        ),
        (
            "diagnostic/router_swap/models/tinyA/math/base_with_none_trunk/seed0",
            "diagnostic/router_swap/models/tinyA/math/base_with_none_trunk/base0/seed0",
        ),
        ("diagnostic/runs/tinyA/math/rpb/seed1001", "diagnostic/runs/tinyA/math/rpb/base1/seed1"),
        (
            "figures/table1_coactivation_runs/math_seed1001.png",
            "figures/table1_coactivation_runs/math_base1_seed1.png",
        ),
        (
            ".integrity/eval/tinyA/math/rpb/seed1.json.json",
            ".integrity/eval/tinyA/math/rpb/base0/seed1.json.json",
        ),
    ],
)
def test_first_layout_paths_get_their_current_names(old: str, new: str) -> None:
    assert current_path(old, BASES) == new
    assert current_path(new, BASES) is None  # a current name stays: moving twice moves nothing


@pytest.mark.parametrize(
    "path",
    ["table1.csv", "data/post/math.jsonl", "logs/eval/x.log", "models/unknown/base/model"],
)
def test_everything_else_keeps_its_name(path: str) -> None:
    assert current_path(path, BASES) is None


def test_a_replicate_is_named_by_its_place_not_its_pretraining_seed() -> None:
    names = legacy_bases({"m": {"replicates": [7, 3]}})
    assert names == {"m": ("m", 0), "m_p7": ("m", 1), "m_p3": ("m", 2)}


def _write(root: Path, relative: str, text: str = "{}") -> None:
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_text(text)


def test_the_command_moves_a_results_folder_once_and_keeps_every_byte(tmp_path: Path) -> None:
    results = tmp_path / "results"
    old = {
        "models/tinyA_p1/base/model/config.json": "base 1",
        "runs/tinyA/math/rpb/seed1001/train_history.json": "history",
        "eval/tinyA/math/rpb/seed1001.json": "eval",
        ".integrity/eval/tinyA/math/rpb/seed1001.json.json": "record",
        "table1.csv": "table",
    }
    for relative, text in old.items():
        _write(results, relative, text)
    config = tmp_path / "config.yaml"
    config.write_text(f"results_dir: {results}\nmodels:\n  tinyA:\n    replicates: [1]\n")
    main(["relayout", "--configfile", str(config)])  # prints only
    assert (results / "eval/tinyA/math/rpb/seed1001.json").is_file()
    main(["relayout", "--configfile", str(config), "--apply"])
    new = {
        "models/tinyA/base1/model/config.json": "base 1",
        "runs/tinyA/math/rpb/base1/seed1/train_history.json": "history",
        "eval/tinyA/math/rpb/base1/seed1.json": "eval",
        ".integrity/eval/tinyA/math/rpb/base1/seed1.json.json": "record",
        "table1.csv": "table",
    }
    found = {
        p.relative_to(results).as_posix(): p.read_text() for p in results.rglob("*") if p.is_file()
    }
    assert found == new
    assert misread_diagnostics(
        [(Path("a"), results / "diagnostic/eval/m/math/base/base1/seed0.json")]
    )
    assert not misread_diagnostics([(Path("a"), results / "eval/m/math/base/base1/seed0.json")])
    assert not (results / "models/tinyA_p1").exists()  # the emptied folders are gone
    assert moves(results, legacy_bases({"tinyA": {"replicates": [1]}})) == []


def test_a_move_onto_an_existing_path_moves_nothing(tmp_path: Path) -> None:
    _write(tmp_path, "eval/m/math/rpb/seed0.json", "old")
    _write(tmp_path, "eval/m/math/rpb/seed1.json", "old")
    _write(tmp_path, "eval/m/math/rpb/base0/seed1.json", "new")
    planned = moves(tmp_path, legacy_bases({"m": {}}))
    assert len(planned) == 2
    with pytest.raises(ValueError, match=r"seed1\.json -> .*base0/seed1\.json: the target exists"):
        apply_moves(tmp_path, planned)
    assert (tmp_path / "eval/m/math/rpb/seed0.json").read_text() == "old"  # nothing moved
    assert (tmp_path / "eval/m/math/rpb/base0/seed1.json").read_text() == "new"


def _relaid(paths: list[str]) -> list[str]:
    """A snapshot's paths (`<results>/...`) as the move names them."""
    prefix = f"{RESULTS_TOKEN}/"
    out = []
    for path in paths:
        relative = path.removeprefix(prefix)
        moved = current_path(relative, BASES) if path.startswith(prefix) else None
        out.append(path if moved is None else prefix + moved)
    return sorted(out)


# default-all is not among them: testbed v3 changed the default's seeds and sweep (other jobs, not
# other names), so the first layout's default plan is not today's; smoke and paper still are.
@pytest.mark.parametrize("name", ["smoke-all", "paper-all"])
def test_the_move_maps_the_first_layouts_plan_onto_the_current_one(name: str) -> None:
    """Every job of the first layout's plan is a job of the current plan once its outputs and
    inputs are moved, and no job is added: the layouts differ in names alone. One fix rides
    along: the routing-regime diagnostic evaluates a replicate base's `base` row on that base,
    and analyses its runs against that base's model and prior (the first layout read base 0's
    for both); and a pretraining job now also reads its committed fixed base (bases/). Two later
    changes add jobs or inputs, each checked to be only that: the damped-trunk arm's lbl runs in
    the diagnostic regime, and table 1's inputs gaining the hard runs its check M2 reads; one
    drops inputs: the sweep reads base 0's runs alone."""
    assert any(case.name == name for case in CASES)
    legacy = json.loads(gzip.decompress(LEGACY_PLANS.read_bytes()))[name]
    current = json.loads(snapshot_path(next(c for c in CASES if c.name == name)).read_text())
    now = {(j["rule"], tuple(j["output"])): j for j in current["jobs"]}
    fixed = []
    for job in legacy:
        key = (job["rule"], tuple(_relaid(job["output"])))
        assert key in now, f"{name}: {key} has no job in the current plan"
        inputs, before = set(now.pop(key)["input"]), set(_relaid(job["input"]))
        if inputs != before:
            fixed.append((key, sorted(before - inputs), sorted(inputs - before)))
    # Since the layouts, the damped-trunk arm added lbl to the diagnostic regime's methods.
    added_jobs = [k for k in now if not (k[0].startswith("diagnostic_") and "/lbl/" in k[1][0])]
    assert added_jobs == [], f"{name}: jobs only the current plan has: {added_jobs[:3]}"
    for (rule, outputs), dropped, added in fixed:
        if rule == "pretrain_base":  # since the layouts: the committed fixed bases as inputs
            assert not dropped and added, (rule, outputs)
            assert all(p.startswith("<repo>/bases/") for p in added), added
            continue
        if rule == "table1":  # since the layouts: the runs of its check M2 (hard, the upper end)
            assert not dropped and added and all("/hard/" in p for p in added), added
            continue
        if rule == "diagnostic_table1":  # since the layouts: the damped-trunk arm's lbl runs
            assert not dropped and added and all("/lbl/" in p for p in added), added
            continue
        if rule == "sweep":  # since 2026-12-05: the sweep reads base 0 alone (sweep.bases: 1)
            assert dropped and not added and all("/base1/" in p for p in dropped), dropped
            continue
        assert rule in ("diagnostic_evaluate", "diagnostic_analyze"), (rule, outputs)
        assert outputs[0].startswith("<results>/diagnostic/") and "/base1/" in outputs[0]
        assert all("/base0/" in p for p in dropped)
        assert added == [p.replace("/base0/", "/base1/") for p in dropped]
