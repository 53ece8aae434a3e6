"""The rule that picks the default RPB reading (docs/methods.md): positions between the bounds,
both metrics required, order of preference, the undetermined case, and no say for accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from test_tables import write_run

from rpb.exploratory import build_readings

SEEDS = [0, 1]


def _spec(methods: list[str]) -> dict:
    return {
        "model": "m",
        "corpus": "math",
        "methods": methods,
        "lower": "none",
        "upper": "hard",
        "min_gain": 0.25,
        "seeds": SEEDS,
        "ood": ["addition", "facts"],
        "scale": "test",
    }


def _world(root: Path, nmi: dict[str, float], accuracy: float = 0.5) -> None:
    for label, value in nmi.items():
        for seed in SEEDS:
            write_run(root, "m", "math", label, seed, (accuracy, accuracy, value))


def _set_overlap(root: Path, label: str, value: float) -> None:
    for seed in SEEDS:
        path = root / "analysis" / "m" / "math" / label / f"seed{seed}.json"
        payload = json.loads(path.read_text())
        payload["mean"]["topk_overlap_with_base"] = value
        path.write_text(json.dumps(payload))


def _by_method(table: pd.DataFrame) -> dict[str, dict]:
    return {row["method"]: row for row in table.to_dict("records")}


def test_positions_verdicts_and_the_first_anchoring_reading_wins(tmp_path: Path) -> None:
    _world(tmp_path, {"none": 0.2, "hard": 1.0, "weak": 0.25, "strong": 0.5, "split": 0.6})
    _set_overlap(tmp_path, "split", 0.21)  # structure retained, routing not held: not anchoring
    out = tmp_path / "out" / "rpb_readings.csv"
    table = build_readings(tmp_path, _spec(["weak", "split", "strong"]), out)
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
    assert (out.parent / "figures" / "rpb_readings.png").is_file()
    assert len(pd.read_csv(out.parent / "rpb_readings_runs.csv")) == 5 * len(SEEDS)


def test_order_of_preference_decides_between_anchoring_readings(tmp_path: Path) -> None:
    _world(tmp_path, {"none": 0.2, "hard": 1.0, "a": 0.5, "b": 0.9})
    table = build_readings(tmp_path, _spec(["b", "a"]), tmp_path / "r.csv")
    assert table.loc[table["default_by_rule"], "method"].tolist() == ["b"]


def test_no_gap_between_the_bounds_is_undetermined(tmp_path: Path) -> None:
    _world(tmp_path, {"none": 0.6, "hard": 0.6, "a": 0.9})
    table = build_readings(tmp_path, _spec(["a"]), tmp_path / "r.csv")
    assert _by_method(table)["a"]["anchors"] == "undetermined"
    assert not table["default_by_rule"].any()
    assert "no reading anchors" in (tmp_path / "r.md").read_text()


@pytest.mark.parametrize("accuracy", [0.1, 0.9])
def test_accuracy_has_no_say(tmp_path: Path, accuracy: float) -> None:
    _world(tmp_path, {"none": 0.2, "hard": 1.0}, accuracy=0.5)
    _world(tmp_path, {"a": 0.3, "b": 0.7}, accuracy=accuracy)
    table = build_readings(tmp_path, _spec(["a", "b"]), tmp_path / "r.csv")
    rows = _by_method(table)
    assert rows["a"]["in_domain"] == pytest.approx(100 * accuracy, abs=15)
    assert (rows["a"]["anchors"], rows["b"]["anchors"]) == ("no", "yes")


def test_configured_readings_are_the_documented_ones_in_the_documented_order() -> None:
    """The order of preference is part of the rule: configs and docs/methods.md must agree."""
    import re

    import yaml

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "methods.md").read_text()
    section = docs.split("## Choosing the default RPB reading")[1].split("The rule, fixed")[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    for name in ("config.yaml", "paper.yaml"):
        config = yaml.safe_load((root / "config" / name).read_text())
        readings = config["tables"]["readings"]
        assert readings["methods"] == documented, name
        assert all(label in config["methods"] for label in documented), name
