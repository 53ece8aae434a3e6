"""The premise screen's rules (docs/records/premise_screen.md, "Testbed v2") on synthetic records
with known answers: the gates, the pruning of the walk and the seed count."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import screen

OOD = screen.OOD


def _run(dev: float, ood: float, swapped: float, overlap: float) -> dict:
    return {
        "dev_p": dev,
        "ood_p": dict.fromkeys(OOD, ood),
        "ood_p_base_routers": dict.fromkeys(OOD, swapped),
        "overlap": overlap,
    }


BASE = {"ood_p": dict.fromkeys(OOD, 0.8)}


def test_a_point_with_the_premise_passes_every_gate() -> None:
    # none loses 0.16 of 0.8 OOD (retention 0.8); base routers undo 0.03-0.05 of it (~25%).
    runs = [_run(0.7, 0.64, 0.64 + u, 0.8) for u in (0.03, 0.04, 0.05)]
    g = screen.judge(runs, BASE)
    assert g.passes
    assert g.retention == pytest.approx(0.8)
    assert g.r_share == pytest.approx(0.04 / 0.16)


@pytest.mark.parametrize(
    ("runs", "failed"),
    [
        ([_run(0.97, 0.64, 0.68, 0.8)] * 3, "l_ok"),  # at the ceiling
        ([_run(0.7, 0.5, 0.54, 0.8)] * 3, "f_ok"),  # forgets too much (0.625)
        ([_run(0.7, 0.79, 0.795, 0.8)] * 3, "f_ok"),  # forgets nothing worth measuring
        ([_run(0.7, 0.64, 0.68, 0.95)] * 3, "d_ok"),  # the router did not move
        ([_run(0.7, 0.64, 0.641, 0.8)] * 3, "r_ok"),  # routing carries < 10%
    ],
)
def test_each_gate_fails_on_its_own(runs: list[dict], failed: str) -> None:
    g = screen.judge(runs, BASE)
    assert not getattr(g, failed)
    assert not g.passes


def test_r_needs_its_interval_above_zero() -> None:
    """A large mean share from one seed, with others undoing nothing or worse, fails R."""
    runs = [_run(0.7, 0.64, 0.64 + u, 0.8) for u in (0.12, -0.05, -0.04)]
    g = screen.judge(runs, BASE)
    assert g.r_share == pytest.approx(0.01 / 0.16)
    runs = [_run(0.7, 0.64, 0.64 + u, 0.8) for u in (0.10, 0.0, -0.01)]
    g = screen.judge(runs, BASE)
    assert g.r_share >= screen.R_MIN_SHARE and g.r_undone_low < 0 and not g.r_ok


def test_walk_order_is_cost_then_level_then_lr() -> None:
    grid = screen.grid()
    assert len(grid) == 36
    assert grid[0] == screen.Point(400, 1, 1 / 30)
    assert grid[1] == screen.Point(400, 1, 1 / 10)
    assert grid[3] == screen.Point(400, 2, 1 / 30)
    assert grid[-1] == screen.Point(1600, 4, 1 / 3)


def test_ceiling_rules_out_more_learning_at_that_level_only() -> None:
    point = screen.Point(800, 1, 1 / 10)
    g = screen.judge([_run(0.99, 0.7, 0.72, 0.8)] * 3, BASE)
    out = screen.ruled_out(point, g)
    assert screen.Point(1600, 1, 1 / 3) in out and screen.Point(800, 1, 1 / 3) in out
    assert screen.Point(1600, 1, 1 / 30) not in out  # a lower lr may stay below the ceiling
    assert screen.Point(400, 1, 1 / 3) not in out  # fewer steps
    assert not any(p.level != 1 for p in out)


def test_floor_rules_out_harder_levels_at_the_same_lr_and_steps() -> None:
    point = screen.Point(400, 2, 1 / 10)
    g = screen.judge([_run(0.2, 0.7, 0.72, 0.8)] * 3, BASE)
    out = screen.ruled_out(point, g)
    assert set(out) == {screen.Point(400, 3, 1 / 10), screen.Point(400, 4, 1 / 10)}


def test_seed_count_reaches_the_margin_and_flags_missing_headroom() -> None:
    # In-domain runs spread by 4 points, OOD by 1: the in-domain spread sets n.
    base0 = [_run(d, o, o, 0.8) for d, o in ((0.60, 0.70), (0.64, 0.71), (0.68, 0.72))]
    base1 = [_run(d, o, o, 0.8) for d, o in ((0.60, 0.70), (0.64, 0.71), (0.68, 0.72))]
    sc = screen.seed_count([base0, base1], ood_loss_points=10.0, r_share=0.05)
    assert sc["sd_in_domain"] == pytest.approx(4.0)
    n = sc["seeds_per_base"] * 2
    assert sc["in_domain_mde"] <= screen.MARGIN
    assert screen.mde(math.sqrt(2) * 4.0, n - 2) > screen.MARGIN  # one seed per base fewer fails
    # Headroom 0.5 points, below the OOD MDE at that n: OOD is underpowered by design.
    assert sc["headroom_points"] == pytest.approx(0.5)
    assert sc["ood_mde"] > 0.5 and sc["ood_underpowered_by_design"]
    roomy = screen.seed_count([base0, base1], ood_loss_points=10.0, r_share=0.5)
    assert not roomy["ood_underpowered_by_design"]


def test_the_configs_premise_record_quotes_the_screens_measurements() -> None:
    """config.yaml's `calibration.premise_not_met` (what the claims print for check M0) lists
    exactly the families the committed v3 screen record failed, and quotes only statistics that
    record measured, to the printed 3 decimals."""
    import json

    import yaml

    root = Path(__file__).resolve().parents[2]
    record = json.loads((Path(__file__).parent / "results" / "screen_v3.json").read_text())
    config = yaml.safe_load((root / "config" / "config.yaml").read_text())
    reasons = config["calibration"]["premise_not_met"]
    failed = {
        next(iter(fam["bases"])): fam
        for fam in record["families"].values()
        if fam["outcome"] == "premise not met"
    }
    assert set(reasons) == set(failed)
    for model, fam in failed.items():
        measured = {
            f"{value:.3f}"
            for base in fam["bases"].values()
            for entry in base["history"]
            for value in (entry["L"], entry["F"])
        }
        quoted = re.findall(r"\b\d\.\d{3}\b", reasons[model])
        assert quoted, reasons[model]
        assert set(quoted) - {"0.950"} <= measured, set(quoted) - measured  # 0.95: a gate


# --- testbed v3's walk (docs/testbed.md, "Testbed v3") ------------------------------------------

import screen_v3  # noqa: E402


@pytest.mark.parametrize(
    ("learnt", "kept", "step"),
    [
        (0.59, 0.90, "continue"),  # learns too little: a higher rate
        (0.60, 0.96, "continue"),  # learns but forgets nothing yet: a higher rate
        (0.60, 0.95, "chosen"),  # both bounds inclusive
        (0.95, 0.70, "chosen"),
        (0.951, 0.90, "overshoot"),  # learns everything before the band is met
        (0.80, 0.699, "overshoot"),  # forgets too much
        (0.30, 0.60, "overshoot"),  # forgetting overshoots even when nothing is learnt
    ],
)
def test_the_v3_walk_stops_chooses_or_fails_by_the_written_rule(learnt, kept, step):
    assert screen_v3.calibration_step(learnt, kept) == step


def test_v3_L_and_F_are_v2s_statistics():
    runs = [_run(0.7, 0.72, 0.75, 0.8), _run(0.5, 0.64, 0.70, 0.8)]
    learnt, kept = screen_v3.learning_and_retention(runs, BASE)
    gates = screen.judge(runs, BASE)
    assert (learnt, kept) == pytest.approx((gates.dev_p, gates.retention))
    assert (learnt, kept) == pytest.approx((0.6, 0.85))


def test_v3_rates_are_the_registered_ones_lowest_first_and_labelled_as_written():
    labels = [p.label for p in screen_v3.points()]
    assert labels == [f"S1600-L1-lr1of{x}" for x in ("10", "8", "6.5", "5", "4", "3")]
    # v2's cache labels are unchanged by the v3 spelling
    assert screen.Point(400, 2, 1 / 30).label == "S400-L2-lr1of30"
    assert screen_v3.MAX_RUNS_PER_FAMILY >= 2 * (6 * 3 + 2)


def test_the_configs_ood_design_is_what_the_v3_record_gives() -> None:
    """config.yaml's `claims.ood_margin` is the committed v3 screen record's headroom, not a copy
    that can drift from it; the design sd that replaced the hand-set design MDE (2026-12-07,
    `claims.design_sd`) is no smaller than the screen's paired sds, and at the configured seeds
    it powers both margins (docs/testbed.md, "Seeds from power")."""
    import json

    import yaml

    from rpb.report.stats import mde

    root = Path(__file__).resolve().parents[2]
    record = json.loads((Path(__file__).parent / "results" / "screen_v3.json").read_text())
    config = yaml.safe_load((root / "config" / "config.yaml").read_text())
    count = record["families"]["A"]["seed_count"]
    runs = 2 * len(config["seeds"])  # two bases of family A
    claims = config["claims"]
    assert claims["ood_margin"] == round(count["headroom_points"], 2)
    design = claims["design_sd"]
    assert design["ood"] >= math.sqrt(2) * count["sd_ood"]
    assert design["in_domain"] >= math.sqrt(2) * count["sd_in_domain"]
    assert mde(design["ood"], runs) <= claims["ood_margin"]
    assert mde(design["in_domain"], runs) <= claims["margin"]
