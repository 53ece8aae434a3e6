"""The claims audit: every claim's verdict on synthetic pipeline outputs: a world where the paper
holds, one where it is reversed, one the evidence cannot decide (underpowered), worlds whose
premises fail (not testable), and the controls (a placebo identical to plain fine-tuning yields no
difference). At tiny scale accuracy is judged on p(target) with exact match's estimate required to
agree for "supported" (a world where the two disagree); at paper scale on exact match alone. Each
part's rule on synthetic intervals (with and without power, rpb.report.audit): tests/test_audit.py.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from result_worlds import OOD_ALL, PAPER_WORLD, run_names_on, write_world

from rpb.report.claims import PART_COLUMNS, build_claims, compare_claims
from rpb.report.run_records import read_json
from rpb.report.stats import run_interval
from rpb.report.verdicts import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    NOT_TESTABLE,
    PREMISE_NOT_MET,
    SUPPORTED,
)

NAN = float("nan")


# --- every claim on synthetic worlds ----------------------------------------------------------

SEEDS = [0, 1, 2, 3, 4]
N_ITEMS = 400  # with 5 seeds the paper world's differences are resolved at MDE < 5 pp
ANCHORS = ["anchor_weight", "anchor_logit", "anchor_kl"]
SOFT = ["none", "lbl", "rpb", *ANCHORS]
UNANCHORED = ("none", "lbl", "placebo", "rpb_permuted")


def _spec(seeds: list[int] = SEEDS, n_bases: int = 1, **extra: object) -> dict:
    runs = run_names_on(seeds, n_bases)
    return {
        "scale": "tiny",
        "ood": OOD_ALL,
        "method": "rpb",
        "reference": "lbl",
        "margin": 5.0,
        "nmi_margin": 0.05,
        "rho_margin": 0.5,
        "confidence": 0.95,
        "power": 0.8,
        "min_split_half_nmi": 0.5,
        "n_resamples": 300,
        "table1": {"model": "tinyA", "corpus": "math", "methods": ["none", "lbl", "rpb"]}
        | {"runs": runs},
        "table2": {"model": "tinyB", "corpus": "math", "methods": ["none", "lbl", "rpb"]}
        | {"runs": runs},
        "table3": {"models": ["tinyA", "tinyB"], "corpus": "math2", "runs": runs},
        "table4": {"model": "tinyA", "corpora": ["math", "math2"], "runs": runs}
        | {"methods": ["rpb", *ANCHORS]},
        "table5": {"model": "tinyA", "corpus": "math", "runs": runs, "correlate": SOFT}
        | {"methods": ["none", "lbl", "rpb", "hard"], "kinds": {"hard": "hard"}},
        "readings": {"model": "tinyA", "corpus": "math", "lower": "none", "upper": "hard"}
        | {"min_gain": 0.25},
    } | extra


def _routing(world: dict) -> dict[str, dict[str, float]]:
    """Routing statistics where every premise holds: lbl raises usage entropy, every anchor
    (and rpb, hard) halves the KL to the base router, hard selects exactly as the base; top-k
    overlap follows the label's NMI (so rpb anchors where its NMI lies between none and hard)."""
    out = {}
    for label, (_, _, nmi, *_) in world.items():
        out[label] = {
            "usage_entropy": 0.95 if label == "lbl" else 0.90,
            "kl_to_base": 0.6 if label in UNANCHORED else 0.3,
            "topk_overlap_with_base": 1.0 if label == "hard" else nmi,
        }
    return out


def _testbed(root: Path, split_half: float) -> None:
    layers = [{"layer": i, "split_half_nmi": split_half} for i in range(2)]
    entry = {"structure": {"layers": layers, "uniform": {"split_half_nmi": 0.1}}}
    (root / "testbed.json").write_text(json.dumps({"tinyA": entry, "tinyB": entry}))


def _build(
    tmp_path: Path,
    world: dict,
    *,
    seeds: list[int] = SEEDS,
    routing: dict | None = None,
    split_half: float = 0.8,
    spec: dict | None = None,
    **kwargs,
) -> pd.DataFrame:
    kwargs.setdefault("n_items", N_ITEMS)
    write_world(tmp_path, world, seeds=tuple(seeds), routing=routing or _routing(world), **kwargs)
    _testbed(tmp_path, split_half)
    return _audit(tmp_path, spec or _spec(seeds), tmp_path / "claims.csv")


def _audit(results: Path, spec: dict, out_csv: Path) -> pd.DataFrame:
    """build_claims of `results` (only read) into `out_csv` (claims.md and the pages beside it)."""
    build_claims(results, spec, out_csv)
    table = pd.read_csv(out_csv, keep_default_na=False)
    assert list(table.columns) == PART_COLUMNS
    # read_json hands every caller the same parse of a file: no part of the audit may change it.
    for path in results.glob("eval/**/*.json"):
        parsed = json.dumps(read_json(path), sort_keys=True)
        assert parsed == json.dumps(json.loads(path.read_bytes()), sort_keys=True), path
    return table


# Each of these builds or audits a synthetic world of its own (~5 s on the 2-core machines): end
# to end of the audit, so the unit tier keeps the shared paper world's tests (and one premise).
world_of_its_own = pytest.mark.slow


@pytest.fixture(scope="module")
def paper_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The paper world as `_build` writes it by default (every premise holds, split-half NMI
    0.8), shared: tests only read it, and audit into their own folders (`_audit`)."""
    root = tmp_path_factory.mktemp("paper_world")
    write_world(
        root, PAPER_WORLD, seeds=tuple(SEEDS), routing=_routing(PAPER_WORLD), n_items=N_ITEMS
    )
    _testbed(root, 0.8)
    return root


@pytest.fixture(scope="module")
def paper_audit(paper_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """claims.csv (and claims.md beside it) of the paper world under the default spec."""
    out = tmp_path_factory.mktemp("paper_audit") / "claims.csv"
    _audit(paper_world, _spec(), out)
    return out


def _paper_table(paper_audit: Path) -> pd.DataFrame:
    return pd.read_csv(paper_audit, keep_default_na=False)


def _copy(world: Path, tmp_path: Path) -> Path:
    """A copy of a shared world for a test that changes it."""
    return Path(shutil.copytree(world, tmp_path / "results"))


def _verdicts(table: pd.DataFrame) -> dict[str, str]:
    return table.groupby("claim", sort=False)["claim_verdict"].first().to_dict()


def test_paper_world_supports_every_claim(paper_audit: Path) -> None:
    table = _paper_table(paper_audit)
    verdicts = _verdicts(table)
    assert list(verdicts) == ["C1", "C2", "C3", "C4", "C5", "C6"]
    assert set(verdicts.values()) == {SUPPORTED}, table[["part", "verdict_detail"]]
    c1 = table[table["name"] == "tinyA/math in_domain rpb - lbl"].iloc[0]
    # Per part: the evidence with the measured numbers, estimate, interval, MDE and its checks.
    assert re.search(
        r"tinyA/math in_domain rpb - lbl \(p\(target\)\): [\d.]+ vs [\d.]+, diff \+[\d.]+ pp .*; "
        r"exact match: [\d.]+ vs [\d.]+, diff \+",
        c1.evidence,
    )
    low, high, estimate = (float(c1[k]) for k in ("ci_low", "ci_high", "estimate"))
    assert 0 < low < estimate < high and 0 < float(c1.mde) < 5.0
    # Judged on p(target); exact match's numbers of the same comparison beside them, agreeing.
    assert c1.metric == "p_target"
    em_low, em_high, em_estimate = (float(c1[k]) for k in ("em_low", "em_high", "em_estimate"))
    assert 0 < em_low < em_estimate < em_high and 0 < float(c1.em_mde) < 5.0
    # The world's p(target) items are 0.02 + 0.96 x exact match's plus a shared wobble.
    assert estimate == pytest.approx(0.96 * em_estimate)
    accuracy = table[table["rule"].isin(["direction", "equivalence", "exceeds 5"])]
    assert (accuracy["metric"] == "p_target").all()
    assert accuracy["em_estimate"].astype(float).notna().all()
    nmi = table[table["name"] == "hard - rpb community NMI"].iloc[0]
    assert nmi.metric == "community_nmi" and nmi.em_estimate == ""  # no exact-match twin
    assert "M1 met: lbl flattens" in c1.checks and "M2 met: the configured rpb" in c1.checks
    assert "M5 met: headroom above lbl" in c1.checks and "FAILED" not in c1.checks
    assert "45.77" in c1.paper
    assert table[table["claim"] == "C3"]["paper"].eq("").all()
    assert set(table["kind"]) == {"confirmatory"}
    md = paper_audit.with_suffix(".md").read_text()
    assert "## C5: supported" in md and "## Manipulation checks" in md
    assert "Accuracy parts are judged on p(target)" in md
    n_parts = len(table)
    assert (
        f"Tested: {n_parts} confirmatory parts: {n_parts} tested on an interval, 0 premise "
        "not met, 0 not testable"
    ) in md


REVERSED_WORLD = {
    "base": (0.0, 0.9, 1.0),
    "none": (0.70, 0.60, 0.75),
    "lbl": (0.60, 0.50, 0.60),
    "rpb": (0.20, 0.20, 0.90),
    # A fixed order weight > logit > kl > rpb, far apart: neither comparable nor unordered.
    "anchor_weight": (0.90, 0.80, 0.20),
    "anchor_logit": (0.60, 0.60, 0.40),
    "anchor_kl": (0.40, 0.40, 0.50),
    "hard": (0.80, 0.60, 0.95),  # keeps the structure but gains accuracy
}


# rpb's greedy answers are slightly worse than lbl's in-domain (exact match 0.55 vs 0.60) while
# its p(target) is far higher (0.80 vs 0.35): p(target) resolves rpb > lbl, exact match points
# the other way. Its OOD and the anchors' levels are the paper world's, so rpb is comparable to
# the anchors on p(target) (0.80 each) but 25 points below them on exact match.
DISAGREE_WORLD = {
    **PAPER_WORLD,
    "rpb": (0.55, 0.80, 0.70, 0.80, 0.80),
    "lbl": (0.60, 0.50, 0.30, 0.35, 0.50),
}


@world_of_its_own
def test_exact_match_disagreeing_makes_a_p_target_part_inconclusive(tmp_path: Path) -> None:
    table = _build(tmp_path, DISAGREE_WORLD).set_index("name")
    part = table.loc["tinyA/math in_domain rpb - lbl"]
    # p(target) alone would support it: its interval lies above 0 ...
    assert part.metric == "p_target" and float(part.ci_low) > 0
    # ... but exact match's estimate of the same difference is negative.
    em = float(part.em_estimate)
    assert em < 0 and float(part.em_high) < 0
    assert part.verdict == INCONCLUSIVE
    assert part.verdict_detail == f"inconclusive (exact match disagrees: estimate {em:+.1f} pp)"
    assert part.verdict_checks_waived == INCONCLUSIVE
    # Equivalence: rpb and an anchor are equal on p(target), 25 points apart on exact match.
    eq = table.loc["tinyA in_domain rpb - anchor_weight (corpora math+math2)"]
    assert float(eq.ci_low) > -5.0 and float(eq.ci_high) < 5.0
    assert float(eq.em_estimate) == pytest.approx(-25.0, abs=5.0)
    assert eq.verdict_detail.startswith("inconclusive (exact match disagrees: estimate -2")
    # Where the two agree, p(target) decides as ever: rpb - none and the OOD parts.
    assert table.loc["tinyA/math in_domain rpb - none", "verdict"] == SUPPORTED
    assert table.loc["tinyA/math ood rpb - lbl", "verdict"] == SUPPORTED
    # No part is "not supported" for exact match's sake: p(target) alone decides that.
    assert table.loc["tinyA/math in_domain rpb - lbl", "claim_verdict"] == INCONCLUSIVE
    assert "exact match disagrees" in (tmp_path / "claims.md").read_text()


@world_of_its_own
def test_at_paper_scale_the_verdict_ignores_p_target(tmp_path: Path) -> None:
    """scale: paper judges exact match alone: the disagreeing world's rpb - lbl is then not
    supported (exact match resolves it below 0), and replacing every p(target) item changes
    nothing in the audit."""
    paper = _build(tmp_path / "a", DISAGREE_WORLD, spec=_spec(scale="paper"))
    part = paper.set_index("name").loc["tinyA/math in_domain rpb - lbl"]
    assert part.metric == "exact_match" and part.verdict == NOT_SUPPORTED
    assert float(part.ci_high) < 0 and float(part.estimate) == float(part.em_estimate)
    assert "exact match disagrees" not in " ".join(paper["verdict_detail"])
    # The same exact-match items, p(target) planted at exact match's levels instead.
    same_em = {label: levels[:3] for label, levels in DISAGREE_WORLD.items()}
    other = _build(tmp_path / "b", same_em, spec=_spec(scale="paper"))
    columns = ["verdict", "verdict_detail", "metric", "estimate", "ci_low", "ci_high", "mde"]
    pd.testing.assert_frame_equal(paper[columns], other[columns])
    # ... whereas at tiny scale the two worlds are judged differently.
    tiny = _build(tmp_path / "c", same_em)
    assert tiny.set_index("name").loc["tinyA/math in_domain rpb - lbl", "verdict"] == NOT_SUPPORTED
    assert "Accuracy parts are judged on exact match" in (tmp_path / "a" / "claims.md").read_text()


@world_of_its_own
def test_reversed_world_supports_no_claim(tmp_path: Path) -> None:
    table = _build(tmp_path, REVERSED_WORLD)
    assert set(_verdicts(table).values()) == {NOT_SUPPORTED}, table[["part", "verdict_detail"]]


def test_undecided_world_is_inconclusive_and_says_it_is_underpowered(tmp_path: Path) -> None:
    """Two seeds, few items and differences near the margin: every interval is wide, and the
    parts that show no effect say that more seeds are needed rather than "not supported"."""
    world = {
        "base": (0.0, 0.9, 1.0),
        "none": (0.45, 0.45, 0.50),
        "lbl": (0.45, 0.45, 0.50),
        "rpb": (0.55, 0.55, 0.70),
        "anchor_weight": (0.55, 0.55, 0.70),
        "anchor_logit": (0.50, 0.50, 0.70),
        "anchor_kl": (0.60, 0.60, 0.70),
        "hard": (0.52, 0.55, 0.90),
    }
    table = _build(tmp_path, world, seeds=[0, 1], n_items=12)
    verdicts = _verdicts(table)
    assert {verdicts[c] for c in ("C1", "C2", "C3", "C4", "C5", "C6")} == {INCONCLUSIVE}, table[
        ["part", "verdict_detail"]
    ]
    assert NOT_SUPPORTED not in set(table["verdict"])
    c1 = table[table["claim"] == "C1"]
    assert c1["verdict_detail"].str.match(r"inconclusive \(underpowered: MDE [\d.]+ pp").all()
    assert (c1["seeds_needed"].astype(int) > 2).all()


@world_of_its_own
def test_a_reading_that_does_not_anchor_makes_rpb_claims_not_testable(tmp_path: Path) -> None:
    routing = _routing(PAPER_WORLD)
    # rpb routes (top-k overlap) like none: the readings rule's position is 0.
    routing["rpb"]["topk_overlap_with_base"] = routing["none"]["topk_overlap_with_base"]
    table = _build(tmp_path, PAPER_WORLD, routing=routing)
    verdicts = _verdicts(table)
    for claim in ("C1", "C2", "C3", "C4", "C5"):
        assert verdicts[claim] == NOT_TESTABLE, claim
    assert verdicts["C6"] == SUPPORTED  # its parts do not rest on the rpb reading
    detail = table[table["claim"] == "C1"]["verdict_detail"].iloc[1]
    assert re.match(
        r"not testable: M2 not met: the configured rpb reading does not anchor .*, "
        r"topk_overlap_with_base position 0.000",
        detail,
    )
    md = (tmp_path / "claims.md").read_text()
    assert "M2 not met: the configured rpb reading does not anchor" in md


@world_of_its_own
def test_failed_premises_name_their_check(tmp_path: Path) -> None:
    # lbl near the ceiling of p(target), the measure M5 reads at tiny scale.
    world = {**PAPER_WORLD, "lbl": (0.97, 0.50, 0.30, 1.0, 0.50)}
    routing = _routing(world)
    routing["lbl"]["usage_entropy"] = 0.90  # lbl does not flatten routing
    routing["hard"]["topk_overlap_with_base"] = 0.999  # hard does not route as the base
    routing["anchor_kl"]["kl_to_base"] = 0.7  # anchor_kl drifts more than none
    table = _build(tmp_path, world, routing=routing).set_index("part")
    c1 = table[table["claim"] == "C1"]
    rpb_none, rpb_lbl = c1.iloc[0], c1.iloc[1]
    assert rpb_lbl.verdict == NOT_TESTABLE
    assert "M1 not met: lbl did not flatten routing vs none (tinyA)" in rpb_lbl.verdict_detail
    assert (
        "M5 not met: no headroom above lbl (tinyA/math), lbl in-domain 98.0% (p(target))"
        in rpb_lbl.verdict_detail
    )
    assert rpb_none.verdict == SUPPORTED  # judged: none is flattened by nothing
    c5 = table[table["claim"] == "C5"]
    with_kl = c5[c5["name"].str.contains("anchor_kl")]
    assert (with_kl["verdict"] == NOT_TESTABLE).all()
    assert (
        with_kl["verdict_detail"]
        .str.contains("M4 not met: anchor_kl did not reduce router drift")
        .all()
    )
    assert (c5[~c5["name"].str.contains("anchor_kl")]["verdict"] == SUPPORTED).sum() == 3
    c6 = table[table["claim"] == "C6"]
    hard_parts = c6[c6["name"].str.contains("hard")]
    assert len(hard_parts) == 2 and (hard_parts["verdict"] == NOT_TESTABLE).all()
    assert (
        hard_parts["verdict_detail"]
        .str.contains("M3 not met: hard does not route exactly as the base")
        .all()
    )


@pytest.mark.parametrize(
    ("split_half", "expected"),
    [(0.8, SUPPORTED), pytest.param(0.3, NOT_TESTABLE, marks=world_of_its_own)],
)
def test_c6_association_needs_a_stable_base_structure(
    paper_world: Path, paper_audit: Path, tmp_path: Path, split_half: float, expected: str
) -> None:
    if split_half == 0.8:  # the shared world's testbed report
        table = _paper_table(paper_audit)
    else:
        results = _copy(paper_world, tmp_path)
        _testbed(results, split_half)
        table = _audit(results, _spec(), tmp_path / "claims.csv")
    association = table[table["name"].str.startswith("association")]
    assert len(association) == 2 and (association["verdict"] == expected).all()
    if expected == NOT_TESTABLE:
        assert (
            association["verdict_detail"]
            .str.contains("M6 not met: the base tinyA router has no stable community structure")
            .all()
        )
        assert "split-half NMI 0.300" in association["verdict_detail"].iloc[0]


@world_of_its_own
def test_c6_without_a_testbed_report_is_not_testable(paper_world: Path, tmp_path: Path) -> None:
    results = _copy(paper_world, tmp_path)
    (results / "testbed.json").unlink()
    table = _audit(results, _spec(), tmp_path / "claims.csv")
    association = table[table["name"].str.startswith("association")]
    assert (association["verdict"] == NOT_TESTABLE).all()
    assert "split-half NMI undetermined" in association["verdict_detail"].iloc[0]


@world_of_its_own
def test_unstructured_base_fails_m6(tmp_path: Path) -> None:
    table = _build(tmp_path, PAPER_WORLD, structured_base=False)
    assert _verdicts(table)["C6"] == NOT_TESTABLE
    assert _verdicts(table)["C1"] == SUPPORTED


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


@world_of_its_own
def test_c6_anti_association_is_not_supported(tmp_path: Path) -> None:
    table = _build(tmp_path, ANTI_TRACKING_WORLD)
    association = table[table["name"].str.startswith("association")]
    assert (association["verdict"] == NOT_SUPPORTED).all()
    assert (association["ci_high"].astype(float) < 0).all()


@world_of_its_own
def test_controls_placebo_identical_to_none_and_permuted_prior(tmp_path: Path) -> None:
    """The placebo built from runs identical to `none` yields exactly no difference (not
    supported: no false positive); rpb beats its permuted-prior twin (which learns like none)."""
    world = {**PAPER_WORLD, "placebo": PAPER_WORLD["none"], "rpb_permuted": PAPER_WORLD["none"]}
    spec = _spec(placebo="placebo", permuted="rpb_permuted")
    table = _build(tmp_path, world, spec=spec)
    placebo = table[table["claim"] == "P1"]
    assert list(placebo["kind"]) == ["exploratory", "exploratory"]
    assert (placebo["verdict"] == NOT_SUPPORTED).all()
    assert placebo["estimate"].astype(float).eq(0).all()
    assert placebo["ci_low"].astype(float).eq(0).all() and placebo["mde"].astype(float).eq(0).all()
    assert placebo["evidence"].str.contains("identical to none in every run").all()
    permuted = table[table["claim"] == "P2"]
    assert permuted["name"].iloc[0] == "tinyA/math in_domain rpb - rpb_permuted"
    assert (permuted["verdict"] == SUPPORTED).all()
    md = (tmp_path / "claims.md").read_text()
    assert "empirical false-positive check: no false positive" in md
    assert "P1.1 [exploratory]" in md and "4 exploratory parts: 4 tested" in md
    # The controls never enter a confirmatory claim's verdict.
    assert set(_verdicts(table)[c] for c in ("C1", "C2", "C3", "C4", "C5", "C6")) == {SUPPORTED}


@world_of_its_own
def test_a_placebo_that_differs_is_reported_as_a_false_positive(tmp_path: Path) -> None:
    world = {**PAPER_WORLD, "placebo": PAPER_WORLD["lbl"]}
    _build(tmp_path, world, spec=_spec(placebo="placebo"))
    assert "FALSE POSITIVE" in (tmp_path / "claims.md").read_text()


def test_unknown_method_is_named(paper_world: Path, tmp_path: Path) -> None:
    spec = _spec([0, 1]) | {"method": "rbp"}
    with pytest.raises(ValueError, match=r"claims\.method 'rbp'"):
        build_claims(paper_world, spec, tmp_path / "claims.csv")


def test_nan_in_a_metric_is_an_error_not_a_verdict() -> None:
    with pytest.raises(ValueError, match="finite"):
        run_interval([1.0, math.nan])


@world_of_its_own
def test_runs_pooled_over_bases_get_per_base_verdicts(tmp_path: Path) -> None:
    # Base 0 and its first replicate, each with the same seeds (and its own base row).
    write_world(tmp_path, PAPER_WORLD, seeds=tuple(SEEDS), bases=2, routing=_routing(PAPER_WORLD))
    _testbed(tmp_path, 0.8)
    build_claims(tmp_path, _spec(SEEDS, n_bases=2), tmp_path / "claims.csv")
    table = pd.read_csv(tmp_path / "claims.csv", keep_default_na=False)
    per_base = ["verdict_base0", "verdict_checks_waived_base0"]
    per_base += ["verdict_base1", "verdict_checks_waived_base1"]
    assert list(table.columns) == [*PART_COLUMNS, *per_base]
    c1 = table[table["claim"] == "C1"].iloc[0]
    assert c1["n_runs"] == 10  # the pooled part counts (base, seed) runs
    assert c1["verdict_base0"] and c1["verdict_base1"]
    # Each base alone is the audit of its own runs: the same as building it on base 0's alone.
    alone = tmp_path / "alone.csv"
    build_claims(tmp_path, _spec(SEEDS), alone)
    base0 = pd.read_csv(alone, keep_default_na=False)
    assert table["verdict_base0"].tolist() == base0["verdict"].tolist()
    assert table["verdict_checks_waived_base0"].tolist() == base0["verdict_checks_waived"].tolist()
    assert "## Per-base verdicts" in (tmp_path / "claims.md").read_text()


def test_a_family_whose_premise_was_not_met_reads_premise_not_met(
    paper_world: Path, paper_audit: Path, tmp_path: Path
) -> None:
    """calibration.premise_not_met (M0): every accuracy part on that family reads "premise not
    met", whatever its numbers say (here the paper world, which would support every claim)."""
    reason = "no grid point passes L on both bases"
    table = _audit(paper_world, _spec(premise_not_met={"tinyA": reason}), tmp_path / "claims.csv")
    verdicts = _verdicts(table)
    # Tables 1, 4 and 5 are on tinyA; C4 has a tinyA part; table 2 (C3) is on tinyB.
    for claim in ("C1", "C2", "C5", "C6"):
        assert verdicts[claim] == PREMISE_NOT_MET, claim
    assert verdicts["C3"] == SUPPORTED
    # C4 is one comparison per family: tinyB's judged part decides it, tinyA's unmet premise
    # neither hides nor decides it (issue 56).
    assert verdicts["C4"] == SUPPORTED
    c6 = table[table["claim"] == "C6"].set_index("name")["verdict"]
    # Hard's structure retention is no accuracy comparison: the testbed's premise does not apply.
    assert c6["hard - rpb community NMI"] == SUPPORTED
    assert c6.drop("hard - rpb community NMI").eq(PREMISE_NOT_MET).all()
    c4 = table[table["claim"] == "C4"].set_index("name")["verdict"]
    assert c4.filter(like="tinyA").eq(PREMISE_NOT_MET).all()
    assert c4.filter(like="tinyB").eq(SUPPORTED).all()
    detail = table[table["claim"] == "C1"]["verdict_detail"].iloc[0]
    assert detail.startswith(
        "premise not met: M0 not met: the testbed's premise does not hold for tinyA"
    )
    assert reason in detail
    assert "premise not met" in (tmp_path / "claims.md").read_text()
    # The numbers' own verdict is kept aside: the same table without the premise.
    without = _paper_table(paper_audit)
    assert table["verdict_checks_waived"].tolist() == without["verdict"].tolist()
    assert without["verdict_checks_waived"].tolist() == without["verdict"].tolist()


def test_two_audits_are_compared_part_by_part() -> None:
    def audit(verdicts: list[str], waived: list[str], estimates: list[float]) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "part": ["C1.1", "C1.2", "C5.7"],
                "name": ["x", "y", "z"],
                "rule": ["direction", "direction", "friedman"],
                "verdict": verdicts,
                "verdict_checks_waived": waived,
                "estimate": estimates,
                "mde": [4.0, 8.0, NAN],
            }
        )

    a = audit([NOT_TESTABLE, SUPPORTED, SUPPORTED], [SUPPORTED] * 3, [1.0, 10.0, 0.2])
    b = audit(
        [NOT_TESTABLE, INCONCLUSIVE, SUPPORTED], [INCONCLUSIVE, *[SUPPORTED] * 2], [3.0, 6.0, 0.3]
    )
    b.loc[1, "mde"] = 10.0
    rows = compare_claims(a, b)
    assert rows["same_verdict"].tolist() == [True, False, True]
    assert rows["same_verdict_checks_waived"].tolist() == [False, True, True]
    # Shifts in units of the larger of the two MDEs; undefined without an MDE.
    assert rows["shift"].tolist() == pytest.approx([2.0, -4.0, 0.1])
    assert rows["shift_in_mde"].iloc[:2].tolist() == pytest.approx([0.5, 0.4])
    assert math.isnan(rows["shift_in_mde"].iloc[2])
    with pytest.raises(ValueError, match=r"parts: C5\.7"):
        compare_claims(a, b.iloc[:2])


def test_table1_caption_verdicts_judge_c1_and_c2_from_table1s_runs(
    paper_world: Path, paper_audit: Path, tmp_path: Path
) -> None:
    """`table_verdicts`: the lines that open table 1's caption agree with the full audit; a check
    whose runs table 1 lacks (M2: the readings' hard runs) is undetermined, so the parts it
    guards are not testable from table 1 alone, while a failed premise (M0) still reads
    "premise not met"."""
    from rpb.report.claims import table_verdicts
    from rpb.specs import Run, analysis_path

    table = _paper_table(paper_audit)
    lines = table_verdicts(paper_world, _spec())
    assert lines[0] == "Verdicts (judged on p(target), docs/claims.md):"
    assert lines[1].startswith("C1 supported: tinyA/math in_domain rpb - none: supported (")
    assert lines[2].startswith("C2 supported: ")
    assert "M2 met: the configured rpb reading anchors" in lines[-1]
    full = table[table["claim"] == "C1"].set_index("name")["estimate"]
    assert f"{float(full['tinyA/math in_domain rpb - lbl']):+.1f} pp" in lines[1]
    # Without the readings' upper end (hard), M2 is undetermined here.
    results = _copy(paper_world, tmp_path)
    for seed in SEEDS:
        analysis_path(results, "tinyA", "math", "hard", Run(0, seed)).unlink()
    lines = table_verdicts(results, _spec())
    assert lines[1].startswith("C1 not testable: ")
    assert (
        "M2 undetermined: the configured rpb reading anchors (readings rule, tinyA/math)"
        in (lines[-1])
    )
    assert "undetermined" in lines[-1] and "snakemake all" in lines[-1]
    unmet = table_verdicts(results, _spec(premise_not_met={"tinyA": "L 0.39 < 0.50"}))
    assert unmet[1].startswith("C1 premise not met: ")
    assert "M0 not met: " in unmet[-1] and "(L 0.39 < 0.50)" in unmet[-1]
    assert "FAILED" not in " ".join(lines + unmet)


def test_a_verdict_reads_as_one_plain_sentence() -> None:
    """The landing page's lead and the README's verdict lines: one sentence per claim, saying
    what the verdict means (README's wording for "premise not met" is unchanged)."""
    from rpb.report.claims import verdict_meaning, verdict_sentence

    sentence = verdict_sentence("C1", "not testable")
    assert sentence.startswith("C1 (RPB beats re-applied LBL and plain fine-tuning in-domain): ")
    assert "not testable here" in sentence and sentence.count(". ") == 0
    assert verdict_meaning("premise not met: tinyA/math ...").startswith("not judged: the testbed")
    assert verdict_meaning("something new") == "something new"
    assert verdict_sentence("C3", SUPPORTED) == (
        "C3 (RPB beats LBL in-domain also on family B): supported on this testbed."
    )
