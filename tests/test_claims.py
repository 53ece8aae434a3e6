"""The claims audit: each verdict rule on synthetic intervals, and every claim's verdict on
synthetic pipeline outputs of a world where the paper holds, one where it is reversed, and one
where the evidence cannot decide."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
from test_tables import OOD_ALL, PAPER_WORLD, write_world

from rpb.claims import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    build_claims,
    combine,
    direction_verdict,
    equivalence_verdict,
    exceeds_verdict,
)

NAN = float("nan")

# --- the rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0.5, 9.0, SUPPORTED),  # above zero, however small
        (-9.0, -0.5, NOT_SUPPORTED),  # the other direction
        (-3.0, 4.0, NOT_SUPPORTED),  # inside (-5, 5): no effect of a claimable size
        (-3.0, 7.0, INCONCLUSIVE),  # could be zero, could be large
        (-7.0, 3.0, INCONCLUSIVE),
        (0.0, 6.0, INCONCLUSIVE),  # touching zero is not excluding it
        (NAN, NAN, INCONCLUSIVE),
    ],
)
def test_direction_verdict(low: float, high: float, expected: str) -> None:
    assert direction_verdict(low, high, margin=5.0) == expected


def test_direction_without_margin_is_the_sign_rule() -> None:
    assert direction_verdict(-0.1, 0.1, margin=0.0) == INCONCLUSIVE
    assert direction_verdict(0.1, 0.2, margin=0.0) == SUPPORTED


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (-4.0, 4.0, SUPPORTED),
        (5.0, 9.0, NOT_SUPPORTED),  # wholly outside the margin
        (-12.0, -6.0, NOT_SUPPORTED),
        (-2.0, 6.0, INCONCLUSIVE),  # straddles the margin
        (-8.0, 8.0, INCONCLUSIVE),
        (NAN, 1.0, INCONCLUSIVE),
    ],
)
def test_equivalence_verdict(low: float, high: float, expected: str) -> None:
    assert equivalence_verdict(low, high, margin=5.0) == expected


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(6.0, 20.0, SUPPORTED), (-1.0, 4.0, NOT_SUPPORTED), (3.0, 8.0, INCONCLUSIVE)],
)
def test_exceeds_verdict(low: float, high: float, expected: str) -> None:
    assert exceeds_verdict(low, high, threshold=5.0) == expected


def test_combine_and_bad_input() -> None:
    assert combine([SUPPORTED, SUPPORTED]) == SUPPORTED
    assert combine([SUPPORTED, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([SUPPORTED, INCONCLUSIVE, NOT_SUPPORTED]) == NOT_SUPPORTED
    with pytest.raises(ValueError, match="at least one"):
        combine([])
    with pytest.raises(ValueError, match="unknown verdict 'maybe'"):
        combine([SUPPORTED, "maybe"])
    with pytest.raises(ValueError, match="exceeds high"):
        direction_verdict(2.0, 1.0, 5.0)
    with pytest.raises(ValueError, match="margin"):
        equivalence_verdict(-1.0, 1.0, 0.0)


# --- every claim on synthetic worlds ----------------------------------------------------------

SEEDS = [0, 1]
ANCHORS = ["anchor_weight", "anchor_logit", "anchor_kl"]
SOFT = ["none", "lbl", "rpb", *ANCHORS]


def _spec() -> dict:
    return {
        "scale": "smoke",
        "ood": OOD_ALL,
        "method": "rpb",
        "reference": "lbl",
        "margin": 5.0,
        "nmi_margin": 0.05,
        "confidence": 0.95,
        "n_resamples": 300,
        "table1": {"model": "tinyA", "corpus": "math", "methods": ["none", "lbl", "rpb"]}
        | {"seeds": SEEDS},
        "table2": {"model": "tinyB", "corpus": "math", "methods": ["none", "lbl", "rpb"]}
        | {"seeds": SEEDS},
        "table3": {"models": ["tinyA", "tinyB"], "corpus": "math2", "seeds": SEEDS},
        "table4": {"model": "tinyA", "corpora": ["math", "math2"], "seeds": SEEDS}
        | {"methods": ["rpb", *ANCHORS]},
        "table5": {"model": "tinyA", "corpus": "math", "seeds": SEEDS, "correlate": SOFT}
        | {"methods": ["none", "lbl", "rpb", "hard"], "kinds": {"hard": "hard"}},
    }


def _verdicts(tmp_path: Path, world: dict, **kwargs) -> dict[str, str]:
    write_world(tmp_path, world, seeds=tuple(SEEDS), **kwargs)
    table = build_claims(tmp_path, _spec(), tmp_path / "claims.csv")
    on_disk = pd.read_csv(tmp_path / "claims.csv")
    assert list(on_disk.columns) == [
        "claim",
        "statement",
        "verdict",
        "evidence",
        "paper",
        "measured_by",
    ]
    assert list(on_disk["claim"]) == ["C1", "C2", "C3", "C4", "C5", "C6"]
    return dict(zip(table["claim"], table["verdict"], strict=True))


def test_paper_world_supports_every_claim(tmp_path: Path) -> None:
    assert set(_verdicts(tmp_path, PAPER_WORLD).values()) == {SUPPORTED}
    table = pd.read_csv(tmp_path / "claims.csv").set_index("claim")
    # The evidence carries the measured numbers; the paper's own appear only for C1.
    assert re.search(
        r"tinyA/math in_domain rpb - lbl: [\d.]+ vs [\d.]+, diff \+", table.loc["C1", "evidence"]
    )
    assert "45.77" in table.loc["C1", "paper"] and pd.isna(table.loc["C3", "paper"])
    assert "## C5: supported" in (tmp_path / "claims.md").read_text()


REVERSED_WORLD = {
    "base": (0.0, 0.9, 1.0),
    "none": (0.70, 0.60, 0.75),
    "lbl": (0.60, 0.50, 0.60),
    "rpb": (0.20, 0.20, 0.90),
    # A fixed order weight > logit > kl > rpb, far apart: neither comparable nor unordered.
    "anchor_weight": (0.90, 0.80, 0.20),
    "anchor_logit": (0.60, 0.60, 0.40),
    "anchor_kl": (0.40, 0.40, 0.50),
    "hard": (0.80, 0.60, 0.30),  # loses structure, gains accuracy
}


def test_reversed_world_supports_no_claim(tmp_path: Path) -> None:
    assert set(_verdicts(tmp_path, REVERSED_WORLD).values()) == {NOT_SUPPORTED}


def test_undecided_world_is_inconclusive(tmp_path: Path) -> None:
    """Few items and differences near the margin: no interval can decide."""
    world = {
        "base": (0.0, 0.9, 1.0),
        "none": (0.45, 0.45, 0.50),
        "lbl": (0.45, 0.45, 0.50),
        "rpb": (0.55, 0.55, 0.50),
        "anchor_weight": (0.55, 0.55, 0.50),
        "anchor_logit": (0.50, 0.50, 0.50),
        "anchor_kl": (0.60, 0.60, 0.50),
        "hard": (0.40, 0.55, 0.50),
    }
    verdicts = _verdicts(tmp_path, world, n_items=12)
    assert verdicts["C1"] == verdicts["C2"] == verdicts["C3"] == verdicts["C4"] == INCONCLUSIVE
    assert verdicts["C5"] == INCONCLUSIVE
    assert verdicts["C6"] == INCONCLUSIVE


def test_c6_needs_a_non_uniform_base(tmp_path: Path) -> None:
    verdicts = _verdicts(tmp_path, PAPER_WORLD, structured_base=False)
    assert verdicts["C6"] == INCONCLUSIVE
    assert verdicts["C1"] == SUPPORTED
    evidence = pd.read_csv(tmp_path / "claims.csv").set_index("claim").loc["C6", "evidence"]
    assert "NOT measurably non-uniform" in evidence


def test_unknown_method_is_named(tmp_path: Path) -> None:
    write_world(tmp_path, PAPER_WORLD, seeds=tuple(SEEDS))
    spec = _spec() | {"method": "rbp"}
    with pytest.raises(ValueError, match=r"claims\.method 'rbp'"):
        build_claims(tmp_path, spec, tmp_path / "claims.csv")


# Retention falls as accuracy rises across the soft methods; hard keeps structure and falls.
ANTI_TRACKING_WORLD = {
    **PAPER_WORLD,
    "none": (0.30, 0.40, 0.80),
    "lbl": (0.40, 0.50, 0.65),
    "anchor_weight": (0.55, 0.60, 0.50),
    "anchor_logit": (0.65, 0.70, 0.40),
    "anchor_kl": (0.72, 0.75, 0.30),
    "rpb": (0.80, 0.80, 0.20),
}


@pytest.mark.parametrize(("structured", "expected"), [(True, NOT_SUPPORTED), (False, INCONCLUSIVE)])
def test_c6_tracking_counts_only_where_the_base_is_non_uniform(
    tmp_path: Path, structured: bool, expected: str
) -> None:
    verdicts = _verdicts(tmp_path, ANTI_TRACKING_WORLD, structured_base=structured)
    assert verdicts["C6"] == expected
