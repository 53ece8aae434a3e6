"""The router-swap table (rpb.report.router_swap_table) on planted cells: every cell of the
factorial written as an evaluation output whose scores follow planted effects, per seed, task and
metric (exact match, p(target), the log-likelihood); the table recovers the effects, the exact
Shapley values and the put-back shares, its OOD mean adds up cell by cell, its summary recomputes
the shares from the means over seeds, and a missing or unscored cell is named. The swap itself and
the decomposition: tests/test_router_swap.py."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from result_worlds import PLANTED, R, T, planted_values, run_names_on, shapley_by_orders

from rpb.report.router_swap_table import build_router_swap_table
from rpb.router_swap import PARTS, cell_eval_paths, cells, decompose, table_inputs
from rpb.specs import Run


def _eval_json(path: Path, em: dict[str, float], p: dict[str, float], ll: float) -> None:
    """An evaluation output: per task 8 exact-match items scoring `em` (percent) and 8 items of
    p(target) whose mean is `p` (a fraction; spread so that only the mean is right)."""
    tasks = {}
    for task in em:
        hits = round(8 * em[task] / 100)
        items = [p[task] + d for d in (-0.01, 0.01) * 4]
        tasks[f"rpb_{task}"] = {"metric": "exact_match", "items": [1.0] * hits + [0.0] * (8 - hits)}
        tasks[f"rpb_{task}_ll"] = {
            "metric": "ll_per_token",
            "score": ll,
            "items": [ll] * 8,
            "p_target": items,
            "p_target_mean": sum(items) / 8,
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tasks": tasks}))


SPEC = {
    "models": ["tinyA"],
    "corpus": "math",
    "method": "none",
    "runs": run_names_on([0, 1]),
    "in_domain": ["math"],
    "ood": ["addition", "facts"],
    "swap_tree": "diagnostic/router_swap",
    "scale": "smoke",
    "parts": list(PARTS),
}


def _world(tmp_path: Path) -> dict:
    """Planted cells on disk: facts follows PLANTED, addition other effects, math's scores are
    fixed; seed 1's effects are seed 0's doubled (the base is shared)."""
    truth = {}
    for seed, k in ((0, 1.0), (1, 2.0)):
        for metric, (base, effects) in PLANTED.items():
            scaled = {u: k * e for u, e in effects.items()}
            truth[(seed, "facts", metric)] = planted_values(base, scaled)
            # addition: half of facts' p(target) effects; on exact match the trunk and its
            # interaction with the routers only (8 items resolve 12.5 points)
            halved = {u: e / 2 for u, e in scaled.items()}
            em = {(T,): -25.0 * k, (R, T): 12.5 * k}
            truth[(seed, "addition", metric)] = planted_values(
                base, halved if metric == "p_target" else em
            )
        for cell, path in cell_eval_paths(tmp_path, SPEC, "tinyA", Run(0, seed)).items():
            s = cells(PARTS)[cell]
            em = {
                "math": 50.0,
                **{t: truth[(seed, t, "exact_match")][s] for t in ("addition", "facts")},
            }
            p = {"math": 0.5, **{t: truth[(seed, t, "p_target")][s] for t in ("addition", "facts")}}
            ll = -1.0 - len(s)  # three factors at -1 nat each, no interaction
            if seed == 1 and cell == "base":
                continue  # shared with seed 0
            _eval_json(path, em, p, ll)
    return truth


def test_table_recovers_planted_effects_per_seed_and_metric(tmp_path: Path) -> None:
    truth = _world(tmp_path)
    rows = build_router_swap_table(tmp_path, SPEC, tmp_path / "router_swap.csv")
    # seeds x (3 tasks + in_domain + ood_mean) x (exact match, p(target), ll per token)
    assert len(rows) == 2 * 5 * 3
    assert sorted(set(rows.metric)) == ["exact_match", "ll_per_token", "p_target"]
    for seed in (0, 1):
        for task in ("facts", "addition"):
            for metric, scale in (("exact_match", 1.0), ("p_target", 100.0)):
                row = rows[(rows.task == task) & (rows.metric == metric) & (rows.seed == seed)]
                row = row.iloc[0]
                v = {s: scale * x for s, x in truth[(seed, task, metric)].items()}
                expected = decompose(v, list(PARTS))
                for key, value in expected.items():
                    assert row[key] == pytest.approx(value, abs=1e-9), (seed, task, metric, key)
                shapley = shapley_by_orders(v, list(PARTS))
                for f in PARTS:
                    assert row[f"shapley_{f}"] == pytest.approx(shapley[f], abs=1e-9)
    # The planted numbers themselves, for p(target) on facts, seed 0, in points.
    facts = rows[(rows.task == "facts") & (rows.metric == "p_target") & (rows.seed == 0)].iloc[0]
    assert facts.base == pytest.approx(80.0) and facts.trained == pytest.approx(49.0)
    assert facts.main_routed_experts == pytest.approx(-20.0)
    assert facts.interaction_routers_x_routed_experts == pytest.approx(3.0)
    assert facts.put_back_share_routers == pytest.approx(3.0 / 31.0)
    # The OOD group is the mean of its tasks, cell by cell, and its effects add up too.
    ood = rows[(rows.task == "ood_mean") & (rows.metric == "p_target") & (rows.seed == 0)].iloc[0]
    assert ood.total == pytest.approx((-31.0 - 15.5) / 2)
    effects = [c for c in rows.columns if c.startswith(("main_", "interaction_"))]
    assert len(effects) == 7
    assert (rows["total"] - rows[effects].sum(axis=1)).abs().max() < 1e-9
    ll = rows[(rows.task == "math") & (rows.metric == "ll_per_token")]
    assert list(ll.total) == [-3.0, -3.0]
    assert list(ll.shapley_share_trunk) == pytest.approx([1 / 3, 1 / 3])
    # The summary: cells averaged over seeds, shares recomputed as ratios of the means.
    summary = pd.read_csv(tmp_path / "router_swap_summary.csv")
    assert set(summary.n_seeds) == {2}
    s = summary[(summary.task == "facts") & (summary.metric == "p_target")].iloc[0]
    per_seed = rows[(rows.task == "facts") & (rows.metric == "p_target")]
    assert s.put_back_share_routers == pytest.approx(
        per_seed.put_back_routers.mean() / -per_seed.total.mean(), rel=1e-5
    )
    md = (tmp_path / "router_swap.md").read_text()
    assert "none_with_base_routers" in md and "routers put-back share" in md
    assert "p(target), percent, by part" in md


def test_table_names_a_missing_cell_and_refuses_mixed_metrics(tmp_path: Path) -> None:
    _world(tmp_path)
    paths = cell_eval_paths(tmp_path, SPEC, "tinyA", Run(0, 1))
    assert set(table_inputs(tmp_path, SPEC)) == {
        str(p)
        for seed in (0, 1)
        for p in cell_eval_paths(tmp_path, SPEC, "tinyA", Run(0, seed)).values()
    }
    result = json.loads(paths["trained_with_base_trunk"].read_text())
    for entry in result["tasks"].values():
        entry.pop("p_target", None)  # an output from before p(target) was recorded
    paths["trained_with_base_trunk"].write_text(json.dumps(result))
    with pytest.raises(
        ValueError, match="cell trained_with_base_trunk of tinyA run base0/seed1 scores"
    ):
        build_router_swap_table(tmp_path, SPEC, tmp_path / "t.csv")
    paths["trained_with_base_trunk"].unlink()
    with pytest.raises(FileNotFoundError, match=r"none_with_base_trunk/base0/seed1.json"):
        build_router_swap_table(tmp_path, SPEC, tmp_path / "t.csv")
