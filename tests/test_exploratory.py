"""rpb.report.exploratory: the softness sweep (strength axis, protocols, table, figure), table 4 at
strengths matched on routing, the training-drift curves, and the rule that picks the default RPB
reading (positions between the bounds, both metrics required, order of preference, the
undetermined case, and no say for accuracy in either measure); p(target) beside exact match in
every table that shows accuracy."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib.image import imread
from result_worlds import OOD_ALL, PAPER_WORLD, run_names_on, write_run

from rpb.method_config import MethodConfig
from rpb.report.exploratory import (
    KEPT_AT_EVAL,
    OWN_ROUTER,
    build_drift,
    build_readings,
    build_sweep,
    eval_protocol,
    match_strengths,
    method_strength,
)
from rpb.specs import METHOD_SPECS, Run, analysis_path, results_path

METHODS = {
    "none": {"kind": "none"},
    # The own-router curve's points drop rpb's bias at evaluation (rpb keeps it by default).
    "rpb_l0p5": {"kind": "rpb", "strength": 0.5, "options": {"keep_bias_at_eval": False}},
    "rpb": {"kind": "rpb", "strength": 1.0, "options": {"keep_bias_at_eval": False}},
    "rpb_l4": {"kind": "rpb", "strength": 4.0, "options": {"keep_bias_at_eval": False}},
    "hard": {"kind": "hard"},
    "rpb_linf": {"kind": "hard", "options": {"keep_bias_at_eval": False}},
    "anchor_kl": {"kind": "anchor_kl"},  # the library's default strength
    "anchor_kl_s10": {"kind": "anchor_kl", "strength": 10.0},
}


def test_strength_axis() -> None:
    assert method_strength(MethodConfig("none")) == 0.0
    assert method_strength(MethodConfig("hard")) == math.inf
    assert method_strength(MethodConfig("rpb", 0.5)) == 0.5
    # The library's default, written into the value when it is made (the spec's, the one place).
    assert method_strength(MethodConfig("anchor_kl")) == METHOD_SPECS["anchor_kl"].default_strength
    with pytest.raises(ValueError, match="unknown router method 'rbp'"):
        MethodConfig.from_dict({"kind": "rbp"})


def test_evaluation_protocol_of_a_point() -> None:
    def protocol(entry: dict) -> str:
        return eval_protocol(MethodConfig.from_dict(entry))

    assert protocol({"kind": "hard"}) == KEPT_AT_EVAL  # hard's default
    assert protocol(METHODS["rpb_linf"]) == OWN_ROUTER
    assert protocol({"kind": "rpb"}) == KEPT_AT_EVAL  # rpb's default: table 1's reading
    assert protocol({"kind": "rpb", "options": {"keep_bias_at_eval": False}}) == OWN_ROUTER
    assert protocol({"kind": "rpb_marginal"}) == OWN_ROUTER  # its variants drop theirs
    assert protocol({"kind": "anchor_kl", "strength": 3.0}) == OWN_ROUTER


def _sweep_world(root: Path) -> None:
    # Accuracy rises with lambda up to 1 and falls at the hard limit; retention rises throughout.
    levels = {
        "none": (0.3, 0.4, 0.2),
        "rpb_l0p5": (0.5, 0.5, 0.4),
        "rpb": (0.8, 0.6, 0.6),
        "rpb_l4": (0.6, 0.6, 0.8),
        "hard": (0.1, 0.4, 0.95),
        "rpb_linf": (0.5, 0.4, 0.3),
        "anchor_kl": (0.7, 0.7, 0.5),
        "anchor_kl_s10": (0.6, 0.8, 0.7),
    }
    write_run(root, "tinyA", "math", "base", Run(0, 0), PAPER_WORLD["base"])
    for label, lv in levels.items():
        for seed in (0, 1):
            write_run(root, "tinyA", "math", label, Run(0, seed), lv)


def test_sweep_table_and_figure(tmp_path: Path) -> None:
    _sweep_world(tmp_path)
    spec = {
        "model": "tinyA",
        "corpus": "math",
        "runs": run_names_on([0, 1]),
        "ood": OOD_ALL,
        "methods": METHODS,
        "curves": {
            "rpb": ["none", "rpb_l0p5", "rpb", "rpb_l4", "rpb_linf", "hard"],
            "anchor_kl": ["none", "anchor_kl", "anchor_kl_s10", "hard"],
        },
    }
    df = build_sweep(tmp_path, spec, tmp_path / "sweep.csv")
    rpb = df[df["curve"] == "rpb"]
    assert list(rpb["strength"]) == [0.0, 0.5, 1.0, 4.0, math.inf, math.inf]
    assert list(rpb["label"]) == ["none", "rpb_l0p5", "rpb", "rpb_l4", "rpb_linf", "hard"]
    # One protocol per line: only hard keeps its steering at evaluation.
    assert list(rpb["protocol"]) == [OWN_ROUTER] * 5 + [KEPT_AT_EVAL]
    # Means over the two seeds (NMI carries a +0.01 * seed jitter).
    assert rpb.set_index("label").loc["rpb_l4", "community_nmi"] == pytest.approx(0.805)
    anchor = df[df["curve"] == "anchor_kl"].set_index("label")
    assert anchor.loc["anchor_kl", "strength"] == 1.0
    # p(target) beside exact match: the seed mean of each run's planted p_target items.
    assert [c for c in df.columns if c.startswith(("in_domain", "ood"))] == [
        "in_domain",
        "in_domain_p",
        "ood_mean",
        "ood_mean_p",
    ]
    planted = [
        np.mean(json.loads(path.read_text())["tasks"]["rpb_math_ll"]["p_target"])
        for path in sorted((tmp_path / "eval/tinyA/math/rpb_l4/base0").glob("seed*.json"))
    ]
    assert len(planted) == 2
    assert rpb.set_index("label").loc["rpb_l4", "in_domain_p"] == pytest.approx(
        100 * np.mean(planted)
    )
    assert (df["n_seeds"] == 2).all()
    runs = pd.read_csv(tmp_path / "sweep_runs.csv")
    assert len(runs) == (6 + 4) * 2 and set(runs["protocol"]) == {OWN_ROUTER, KEPT_AT_EVAL}
    assert np.isinf(pd.read_csv(tmp_path / "sweep.csv")["strength"]).sum() == 3
    assert "protocol" in (tmp_path / "sweep.md").read_text()
    # Exploratory tables say so (issue: seed counts from the power analysis for the confirmatory
    # tables only, docs/claims.md "Seeds per table").
    assert (tmp_path / "sweep.md").read_text().startswith("Softness sweep (exploratory).")
    # Table 4 at matched strengths, from the same runs: target overlap 0.2 + 0.5 * 0.75.
    matched = pd.read_csv(tmp_path / "sweep_table4_matched.csv").set_index("curve")
    assert matched.loc["rpb", "matched_label"] == "rpb"  # position 0.4 / 0.75
    assert matched.loc["anchor_kl", "matched_label"] == "anchor_kl"  # 0.3/0.75 beats 0.5/0.75
    assert matched.loc["rpb", "default_in_domain"] == pytest.approx(80, abs=15)
    assert matched.loc["rpb", "matched_rank_in_domain"] == 1.0  # 0.8 vs anchor_kl's 0.7
    assert matched.loc["rpb", "matched_rank_in_domain_p"] == 1.0  # p(target) the same order
    assert matched.loc["rpb", "default_in_domain_p"] == pytest.approx(
        rpb.set_index("label").loc["rpb", "in_domain_p"]
    )
    assert "are p(target)" in (tmp_path / "sweep.md").read_text()
    for side in ("consistency", "pairs"):
        assert set(pd.read_csv(tmp_path / f"sweep_table4_matched_{side}.csv")["strengths"]) == {
            "default",
            "matched",
        }
    assert (
        (tmp_path / "sweep_table4_matched.md")
        .read_text()
        .startswith("Table 4 at matched strengths (exploratory).")
    )
    png = imread(tmp_path / "figures" / "sweep.png")
    assert png.shape[0] > 300 and png.std() > 0.01
    assert (tmp_path / "figures" / "sweep.pdf").read_bytes().startswith(b"%PDF")


def test_sweep_names_a_label_that_is_not_a_method(tmp_path: Path) -> None:
    _sweep_world(tmp_path)
    spec = {"model": "tinyA", "corpus": "math", "runs": run_names_on([0]), "ood": OOD_ALL}
    spec |= {"methods": METHODS, "curves": {"rpb": ["none", "rpb_l9"]}}
    with pytest.raises(ValueError, match="label 'rpb_l9' is not a method"):
        build_sweep(tmp_path, spec, tmp_path / "sweep.csv")


def _sweep_means(overlap: dict[str, float], accuracy: float = 50.0) -> pd.DataFrame:
    """A sweep table (seed means) of two curves with the given top-k overlaps."""
    points = {
        "none": ("*", 0.0, OWN_ROUTER),
        "hard": ("*", math.inf, KEPT_AT_EVAL),
        "rpb_linf": ("rpb", math.inf, OWN_ROUTER),
        "rpb_l1": ("rpb", 1.0, OWN_ROUTER),
        "rpb": ("rpb", 2.0, OWN_ROUTER),
        "rpb_l4": ("rpb", 4.0, OWN_ROUTER),
        "anchor_kl_s0p1": ("anchor_kl", 0.1, OWN_ROUTER),
        "anchor_kl": ("anchor_kl", 1.0, OWN_ROUTER),
    }
    rows = []
    for curve in ("rpb", "anchor_kl"):
        for label, (owner, strength, protocol) in points.items():
            if owner in ("*", curve):
                rows.append(
                    {
                        "curve": curve,
                        "label": label,
                        "strength": strength,
                        "protocol": protocol,
                        "topk_overlap_with_base": overlap[label],
                        "in_domain": accuracy,
                    }
                )
    return pd.DataFrame(rows)


OVERLAP = {
    "none": 0.8,
    "hard": 1.0,
    "rpb_linf": 0.95,  # an infinite arm: never a candidate, even when it is closest
    "rpb_l1": 0.85,  # position 0.25
    "rpb": 0.88,  # 0.4
    "rpb_l4": 0.92,  # 0.6: as close as rpb, at a larger strength
    "anchor_kl_s0p1": 0.81,  # 0.05
    "anchor_kl": 0.84,  # 0.2: closest, but 0.3 from the target
}


def test_matched_strengths_by_the_rule() -> None:
    table = match_strengths(_sweep_means(OVERLAP)).set_index("curve")
    assert table.loc["rpb", "matched_label"] == "rpb"  # the tie goes to the smaller strength
    assert table.loc["rpb", "matched_position"] == pytest.approx(0.4)
    assert table.loc["rpb", "reached"] == "yes"
    assert table.loc["anchor_kl", "matched_label"] == "anchor_kl"
    assert table.loc["anchor_kl", "reached"] == "no"  # kept, and flagged
    assert table.loc["anchor_kl", "default_position"] == pytest.approx(0.2)
    assert table.loc["rpb", "default_strength"] == 2.0


@pytest.mark.parametrize("accuracy", [5.0, 95.0])
def test_matching_reads_routing_only(accuracy: float) -> None:
    got = match_strengths(_sweep_means(OVERLAP, accuracy))
    assert got.equals(match_strengths(_sweep_means(OVERLAP)))


def test_matching_without_a_gap_is_undetermined() -> None:
    flat = dict(OVERLAP, hard=0.8)
    table = match_strengths(_sweep_means(flat))
    assert (table["reached"] == "undetermined").all() and (table["matched_label"] == "").all()
    with pytest.raises(ValueError, match="no kept-at-evaluation hard point"):
        match_strengths(_sweep_means(OVERLAP).query("label != 'hard'"))


def test_drift_curves_from_training_histories(tmp_path: Path) -> None:
    for label, drift in (("none", 0.3), ("rpb", 0.1)):
        for seed in (0, 1):
            history = [
                {
                    "step": step,
                    "task_loss": 2.0 - step / 100,
                    "router_loss": 0.0,
                    "mean/kl_to_base": drift * step / 10,
                    "mean/topk_overlap_with_base": 1.0 - drift * step / 20,
                    "mean/usage_entropy": 0.9,
                    "layer1/kl_to_base": 9.0,
                }
                for step in (10, 20)
            ]
            fields = {"model": "tinyA", "corpus": "math", "method": label, "run": Run(0, seed)}
            path = tmp_path / results_path("train_history", **fields)
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps({"history": history}))
    spec = {"model": "tinyA", "corpus": "math", "methods": ["none", "rpb"]}
    spec["runs"] = run_names_on([0, 1])
    df = build_drift(tmp_path, spec, tmp_path / "drift.csv")
    assert len(df) == 2 * 2 * 2
    last = df[(df["method"] == "none") & (df["step"] == 20)]
    assert list(last["kl_to_base"]) == pytest.approx([0.6, 0.6])
    assert (tmp_path / "figures" / "drift.png").is_file()
    (tmp_path / "runs/tinyA/math/rpb/base0/seed1/train_history.json").write_text(
        json.dumps({"history": []})
    )
    with pytest.raises(ValueError, match=r"rpb/base0/seed1/train_history.json: no 'history'"):
        build_drift(tmp_path, spec, tmp_path / "drift.csv")


def test_a_sweep_without_the_bounds_writes_no_matched_table(tmp_path: Path) -> None:
    _sweep_world(tmp_path)
    spec = {"model": "tinyA", "corpus": "math", "runs": run_names_on([0]), "ood": OOD_ALL}
    spec |= {"methods": METHODS, "curves": {"rpb": ["rpb_l0p5", "rpb", "rpb_l4"]}}
    assert len(build_sweep(tmp_path, spec, tmp_path / "sweep.csv")) == 3
    assert not (tmp_path / "sweep_table4_matched.csv").exists()


# --- which RPB reading anchors (build_readings) -------------------------------------------------

READING_SEEDS = [0, 1]


def _readings_spec(methods: list[str]) -> dict:
    return {
        "model": "m",
        "corpus": "math",
        "methods": methods,
        "lower": "none",
        "upper": "hard",
        "min_gain": 0.25,
        "runs": run_names_on(READING_SEEDS),
        "ood": ["addition", "facts"],
        "scale": "test",
    }


def _readings_world(
    root: Path, nmi: dict[str, float], accuracy: float = 0.5, p_target: float | None = None
) -> None:
    p = accuracy if p_target is None else p_target
    for label, value in nmi.items():
        for seed in READING_SEEDS:
            write_run(root, "m", "math", label, Run(0, seed), (accuracy, accuracy, value, p, p))


def _set_overlap(root: Path, label: str, value: float) -> None:
    for seed in READING_SEEDS:
        path = analysis_path(root, "m", "math", label, Run(0, seed))
        payload = json.loads(path.read_text())
        payload["mean"]["topk_overlap_with_base"] = value
        path.write_text(json.dumps(payload))


def _by_method(table: pd.DataFrame) -> dict[str, dict]:
    return {row["method"]: row for row in table.to_dict("records")}


def test_positions_verdicts_and_the_first_anchoring_reading_wins(tmp_path: Path) -> None:
    _readings_world(tmp_path, {"none": 0.2, "hard": 1.0, "weak": 0.25, "strong": 0.5, "split": 0.6})
    _set_overlap(tmp_path, "split", 0.21)  # structure retained, routing not held: not anchoring
    out = tmp_path / "out" / "rpb_readings.csv"
    table = build_readings(tmp_path, _readings_spec(["weak", "split", "strong"]), out)
    rows = _by_method(table)
    assert list(table["method"]) == ["none", "weak", "split", "strong", "hard"]
    assert rows["strong"]["community_nmi_position"] == pytest.approx((0.5 - 0.2) / 0.8)
    assert rows["weak"]["topk_overlap_with_base_position"] == pytest.approx(0.05 / 0.8)
    assert rows["split"]["topk_overlap_with_base_position"] == pytest.approx(0.01 / 0.8)
    verdicts = {m: rows[m]["anchors"] for m in ("weak", "split", "strong")}
    assert verdicts == {"weak": "no", "split": "no", "strong": "yes"}
    assert [m for m, r in rows.items() if r["default_by_rule"]] == ["strong"]
    assert {rows["none"]["role"], rows["hard"]["role"]} == {"lower bound", "upper bound"}
    assert "default by the rule: `strong`" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".md").read_text().startswith("RPB readings (exploratory).")
    assert (out.parent / "figures" / "rpb_readings.png").is_file()
    assert len(pd.read_csv(out.parent / "rpb_readings_runs.csv")) == 5 * len(READING_SEEDS)


def test_order_of_preference_decides_between_anchoring_readings(tmp_path: Path) -> None:
    _readings_world(tmp_path, {"none": 0.2, "hard": 1.0, "a": 0.5, "b": 0.9})
    table = build_readings(tmp_path, _readings_spec(["b", "a"]), tmp_path / "r.csv")
    assert table.loc[table["default_by_rule"], "method"].tolist() == ["b"]


def test_no_gap_between_the_bounds_is_undetermined(tmp_path: Path) -> None:
    _readings_world(tmp_path, {"none": 0.6, "hard": 0.6, "a": 0.9})
    table = build_readings(tmp_path, _readings_spec(["a"]), tmp_path / "r.csv")
    assert _by_method(table)["a"]["anchors"] == "undetermined"
    assert not table["default_by_rule"].any()
    assert "no reading anchors" in (tmp_path / "r.md").read_text()


@pytest.mark.parametrize(("accuracy", "p_target"), [(0.1, 0.9), (0.9, 0.1)])
def test_accuracy_has_no_say(tmp_path: Path, accuracy: float, p_target: float) -> None:
    _readings_world(tmp_path, {"none": 0.2, "hard": 1.0}, accuracy=0.5)
    _readings_world(tmp_path, {"a": 0.3, "b": 0.7}, accuracy=accuracy, p_target=p_target)
    table = build_readings(tmp_path, _readings_spec(["a", "b"]), tmp_path / "r.csv")
    rows = _by_method(table)
    assert rows["a"]["in_domain"] == pytest.approx(100 * accuracy, abs=15)
    # p(target) is listed beside exact match (0.02 + 0.96 x the planted level), in neither rule.
    assert rows["a"]["in_domain_p"] == pytest.approx(100 * (0.02 + 0.96 * p_target), abs=15)
    assert list(table.columns[-4:]) == ["in_domain", "in_domain_p", "ood_mean", "ood_mean_p"]
    assert (rows["a"]["anchors"], rows["b"]["anchors"]) == ("no", "yes")


def test_configured_readings_are_the_documented_ones_in_the_documented_order() -> None:
    """The order of preference is part of the rule: configs and docs/methods.md must agree."""
    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "methods.md").read_text()
    section = docs.split("## Choosing the default RPB reading")[1].split("The rule, fixed")[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    for name in ("config.yaml", "paper.yaml"):
        config = yaml.safe_load((root / "config" / name).read_text())
        readings = config["tables"]["readings"]
        assert readings["methods"] == documented, name
        assert all(label in config["methods"] for label in documented), name
