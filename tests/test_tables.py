"""The seeds x items bootstrap CI and table 1 built from synthetic pipeline outputs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from scipy import stats

from rpb.stats import two_way_bootstrap_ci
from rpb.tables import PAPER_TABLE1, build_table1

# --- two_way_bootstrap_ci ---------------------------------------------------------------------


def test_mean_is_exact_and_ci_brackets_it() -> None:
    scores = np.random.default_rng(0).random((3, 40))
    mean, low, high = two_way_bootstrap_ci(scores, n_resamples=500)
    assert mean == scores.mean()
    assert low < mean < high


def test_one_seed_is_the_item_bootstrap_of_scipy() -> None:
    items = np.random.default_rng(1).normal(0.6, 0.2, size=300)
    _, low, high = two_way_bootstrap_ci(items[None, :], n_resamples=4000, seed=3)
    ref = stats.bootstrap(
        (items,),
        np.mean,
        confidence_level=0.95,
        n_resamples=4000,
        method="percentile",
        random_state=np.random.default_rng(4),
    ).confidence_interval
    width = ref.high - ref.low
    # Different random draws: agreement to a few percent of the width is what Monte Carlo allows.
    assert low == pytest.approx(ref.low, abs=0.06 * width)
    assert high == pytest.approx(ref.high, abs=0.06 * width)


def test_ci_narrows_with_more_items() -> None:
    rng = np.random.default_rng(2)
    few = two_way_bootstrap_ci(rng.random((2, 50)), n_resamples=1000)
    many = two_way_bootstrap_ci(rng.random((2, 800)), n_resamples=1000)
    # Width scales as 1/sqrt(items): 16x the items, about 1/4 the width.
    assert (many[2] - many[1]) < 0.4 * (few[2] - few[1])


def test_seed_to_seed_variation_widens_the_ci() -> None:
    """Resampling seeds, not only items: rows that disagree must widen the interval."""
    items = np.random.default_rng(5).random(200)
    same = np.stack([items] * 4)
    spread = same + np.array([-0.2, -0.1, 0.1, 0.2])[:, None]
    _, low_same, high_same = two_way_bootstrap_ci(same, n_resamples=1000)
    mean, low_spread, high_spread = two_way_bootstrap_ci(spread, n_resamples=1000)
    assert mean == pytest.approx(same.mean())
    assert (high_spread - low_spread) > 2 * (high_same - low_same)


def test_bootstrap_is_deterministic_per_seed() -> None:
    scores = np.random.default_rng(6).random((3, 30))
    assert two_way_bootstrap_ci(scores, seed=7) == two_way_bootstrap_ci(scores, seed=7)
    assert two_way_bootstrap_ci(scores, seed=7) != two_way_bootstrap_ci(scores, seed=8)


@pytest.mark.parametrize("bad", [np.zeros(5), np.zeros((0, 4)), np.zeros((2, 3, 4))])
def test_bootstrap_rejects_non_matrices(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="seeds x items"):
        two_way_bootstrap_ci(bad)


# --- build_table1 -----------------------------------------------------------------------------

OOD = ["addition", "facts"]
SPEC: dict[str, Any] = {
    "model": "tinyA",
    "corpus": "math",
    "methods": ["none", "lbl", "rpb"],
    "seeds": [0, 1],
    "in_domain": ["math"],
    "ood": OOD,
    "scale": "smoke",
}
# Per label: probability of a correct in-domain item, of a correct OOD item, and a modularity.
LEVELS = {"base": (0.0, 0.9, 0.30), "none": (0.7, 0.3, 0.20), "lbl": (0.6, 0.4, 0.22)}
LEVELS["rpb"] = (0.8, 0.6, 0.28)


def _write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def _fake_results(root: Path, spec: dict) -> dict[str, dict[int, dict]]:
    """Eval and analysis JSONs laid out as the pipeline writes them; returns what was written."""
    rng = np.random.default_rng(0)
    written: dict[str, dict[int, dict]] = {}
    for label in ["base", *spec["methods"]]:
        p_in, p_ood, modularity = LEVELS[label]
        written[label] = {}
        for seed in [0] if label == "base" else spec["seeds"]:
            tasks = {"math": (rng.random(25) < p_in).astype(int).tolist()}
            tasks |= {t: (rng.random(10) < p_ood).astype(int).tolist() for t in spec["ood"]}
            mean = {
                "modularity": modularity + 0.01 * seed,
                "community_nmi": 0.5 + 0.1 * seed,
                "coact_cosine": 0.9 - 0.05 * seed,
            }
            where = Path(spec["model"], spec["corpus"], label, f"seed{seed}.json")
            payload = {f"rpb_{t}": {"items": v, "metric": "exact_match"} for t, v in tasks.items()}
            _write(root / "eval" / where, {"tasks": payload})
            _write(root / "analysis" / where, {"mean": mean})
            # The analysis job's co-activation counts [layers, experts, experts] beside its JSON.
            counts = rng.integers(0, 50, size=(2, 4, 4))
            counts = torch.from_numpy(counts + counts.transpose(0, 2, 1))
            counts_path = (root / "analysis" / where).with_suffix(".safetensors")
            save_file({"counts": counts}, str(counts_path))
            written[label][seed] = {"tasks": tasks, "mean": mean}
    return written


@pytest.fixture
def table(tmp_path: Path) -> tuple[pd.DataFrame, dict, Path]:
    written = _fake_results(tmp_path / "results", SPEC)
    out = tmp_path / "results" / "table1.csv"
    return build_table1(tmp_path / "results", SPEC, out), written, out


def test_table1_columns_and_rows(table: tuple[pd.DataFrame, dict, Path]) -> None:
    df, _, out = table
    assert list(df.columns) == [
        "model",
        "method",
        "n_seeds",
        "in_domain",
        "in_domain_ci_low",
        "in_domain_ci_high",
        "ood_addition",
        "ood_facts",
        "ood_mean",
        "modularity",
        "community_nmi",
        "coact_cosine",
        "paper_in_domain",
    ]
    assert list(df["method"]) == ["base", "none", "lbl", "rpb"]
    assert list(df["n_seeds"]) == [1, 2, 2, 2]
    assert set(df["model"]) == {"tinyA"}
    on_disk = pd.read_csv(out)
    assert list(on_disk.columns) == list(df.columns)
    np.testing.assert_allclose(on_disk["in_domain"], df["in_domain"], atol=1e-4)
    assert "Table 1" in out.with_suffix(".md").read_text()
    assert json.loads(out.with_suffix(".meta.json").read_text())["seeds"] == [0, 1]
    assert list((out.parent / "figures").glob("table1_coactivation*"))


def test_table1_numbers_are_percentages_of_the_inputs(
    table: tuple[pd.DataFrame, dict, Path],
) -> None:
    df, written, _ = table
    for label, per_seed in written.items():
        row = df.set_index("method").loc[label]
        math_items = np.concatenate([np.array(s["tasks"]["math"]) for s in per_seed.values()])
        assert row["in_domain"] == pytest.approx(100 * math_items.mean())
        ood = {t: 100 * np.mean([np.mean(s["tasks"][t]) for s in per_seed.values()]) for t in OOD}
        for task, value in ood.items():
            assert row[f"ood_{task}"] == pytest.approx(value)
        assert row["ood_mean"] == pytest.approx(np.mean(list(ood.values())))
        for key in ("modularity", "community_nmi", "coact_cosine"):
            assert row[key] == pytest.approx(np.mean([s["mean"][key] for s in per_seed.values()]))
        assert row["in_domain_ci_low"] <= row["in_domain"] <= row["in_domain_ci_high"]
        assert row["in_domain_ci_low"] >= 0 and row["in_domain_ci_high"] <= 100


def test_paper_numbers_only_for_family_a(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    df_a = build_table1(tmp_path, SPEC, tmp_path / "a.csv").set_index("method")
    for label, paper in PAPER_TABLE1.items():
        assert df_a.loc[label, "paper_in_domain"] == paper
    assert math.isnan(df_a.loc["base", "paper_in_domain"])
    df_b = build_table1(tmp_path, {**SPEC, "family": "B"}, tmp_path / "b.csv")
    assert df_b["paper_in_domain"].isna().all()


def test_missing_input_names_the_file(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    missing = tmp_path / "analysis" / "tinyA" / "math" / "rpb" / "seed1.json"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        build_table1(tmp_path, SPEC, tmp_path / "t.csv")


def test_missing_task_names_file_and_task(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    path = tmp_path / "eval" / "tinyA" / "math" / "lbl" / "seed0.json"
    result = json.loads(path.read_text())
    del result["tasks"]["rpb_facts"]
    path.write_text(json.dumps(result))
    with pytest.raises(ValueError, match=re.escape(f"{path}: no task 'rpb_facts'")):
        build_table1(tmp_path, SPEC, tmp_path / "t.csv")
