"""The claims audit's parts (rpb.report.audit), judged on synthetic intervals: a part states its
power (the MDE and the seeds it would need) and its premises (a failed manipulation check makes it
not testable, a failed testbed premise "premise not met"), and at tiny scale a part judged on
p(target) is "supported" only where exact match's estimate of the same difference agrees. Every
claim's verdict on synthetic pipeline outputs: tests/test_claims.py."""

from __future__ import annotations

import re
from math import nan as NAN

import pytest

from rpb.report.audit import Check, exact_match_agrees, judged_part
from rpb.report.stats import Difference, paired_runs, run_interval
from rpb.report.verdicts import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    NOT_TESTABLE,
    PREMISE_NOT_MET,
    SUPPORTED,
)


def test_judged_part_states_power_and_premises() -> None:
    noisy = paired_runs([60.0, 20.0, 45.0], [50.0, 40.0, 30.0])  # sd ~ 18 pp over 3 runs
    part = judged_part("x - y", noisy, "direction", 5.0, "evidence")
    assert part.verdict == INCONCLUSIVE and part.mde > 5.0
    needed = int(re.search(r"needs (\d+) runs", part.detail).group(1))
    assert (
        part.detail.startswith("inconclusive (underpowered: MDE ") and needed == part.seeds_needed
    )
    assert needed > 3
    failed = Check("M2", "the configured rpb reading anchors", False, "position -0.005")
    passed = Check("M1", "lbl flattens routing", True, "entropy +0.01")
    part = judged_part("x - y", noisy, "direction", 5.0, "evidence", [passed, failed])
    assert part.verdict == NOT_TESTABLE
    assert part.detail == (
        "not testable: M2 not met: the configured rpb reading anchors, position -0.005"
    )
    one_seed = judged_part("x - y", run_interval([3.0]), "direction", 5.0, "evidence")
    assert one_seed.verdict == INCONCLUSIVE and "needs at least 2 runs" in one_seed.detail
    # An item-level interval of one run above 0 supports nothing about runs.
    one_run = judged_part("x - y", run_interval([30.0], min_sd=1.0), "direction", 5.0, "e")
    assert one_run.low > 0 and one_run.verdict == INCONCLUSIVE
    eq = judged_part("x - y", noisy, "equivalence", 5.0, "evidence")
    assert eq.verdict == INCONCLUSIVE and eq.mde == noisy.mde_equivalence > noisy.mde


@pytest.mark.parametrize(
    ("rule", "estimate", "threshold", "agrees"),
    [
        ("direction", 0.1, 0.0, True),  # the supported sign, however small
        ("direction", -0.1, 0.0, False),
        ("direction", 0.0, 0.0, False),  # no sign is not the same sign
        ("exceeds", 5.5, 5.0, True),
        ("exceeds", 4.9, 5.0, False),
        ("exceeds", 0.2, 0.0, True),  # C6's association: exact match's rho positive
        ("equivalence", 4.9, 0.0, True),
        ("equivalence", -4.9, 0.0, True),
        ("equivalence", 5.0, 0.0, False),  # inside (-m, +m), open
        ("direction", NAN, 0.0, False),
    ],
)
def test_exact_match_agreement(rule: str, estimate: float, threshold: float, agrees: bool) -> None:
    assert exact_match_agrees(rule, estimate, 5.0, threshold) is agrees


def test_a_supported_p_target_part_needs_exact_match_to_agree() -> None:
    """p(target) decides; exact match's estimate can only turn "supported" into inconclusive,
    never "not supported" or "inconclusive" into anything else."""
    up = paired_runs([60.0, 62.0, 61.0, 63.0], [40.0, 41.0, 40.5, 42.0])  # clearly above 0
    down = paired_runs([40.0, 41.0, 40.5, 42.0], [60.0, 62.0, 61.0, 63.0])
    agree = judged_part("x - y", up, "direction", 5.0, "e", metric="p_target", exact_match=up)
    assert agree.verdict == SUPPORTED and agree.em_estimate == up.estimate
    assert agree.metric == "p_target" and agree.em_low == up.low and agree.em_mde == up.mde
    disagree = judged_part("x - y", up, "direction", 5.0, "e", metric="p_target", exact_match=down)
    assert disagree.verdict == INCONCLUSIVE
    assert (
        disagree.detail == f"inconclusive (exact match disagrees: estimate {down.estimate:+.1f} pp)"
    )
    # Exact match tied in every run (at its floor): no sign, so no agreement.
    tied = paired_runs([0.0, 0.0], [0.0, 0.0])
    flat = judged_part("x - y", up, "direction", 5.0, "e", metric="p_target", exact_match=tied)
    assert flat.detail == "inconclusive (exact match disagrees: estimate +0.0 pp)"
    rho = judged_part(
        "rho",
        up,
        "exceeds",
        5.0,
        "e",
        unit="rho",
        metric="p_target",
        exact_match=Difference(NAN, NAN, NAN, NAN, 2, 6),
    )
    assert rho.detail == "inconclusive (exact match disagrees: estimate undefined)"
    # p(target) not supported: exact match has no say, whatever it shows.
    refuted = judged_part("x - y", down, "direction", 5.0, "e", metric="p_target", exact_match=up)
    assert refuted.verdict == NOT_SUPPORTED
    # The agreement is part of the rule: with a failed check it is what the waived verdict says.
    failed = Check("M1", "lbl flattens routing", False, "none")
    part = judged_part(
        "x - y", up, "direction", 5.0, "e", [failed], metric="p_target", exact_match=down
    )
    assert part.verdict == NOT_TESTABLE and part.checks_waived == INCONCLUSIVE
    # The testbed's premise (M0) failed reads "premise not met", whatever else failed.
    unmet = Check("M0", "the testbed's premise holds", False, "L 0.39 < 0.50")
    part = judged_part(
        "x - y", up, "direction", 5.0, "e", [failed, unmet], metric="p_target", exact_match=up
    )
    assert part.verdict == PREMISE_NOT_MET and part.checks_waived == SUPPORTED
    assert part.detail.startswith("premise not met: M1 not met: lbl flattens routing")
    # Exact match judged alone (paper scale): its own numbers are the em_* ones.
    alone = judged_part("x - y", down, "direction", 5.0, "e", metric="exact_match")
    assert alone.verdict == NOT_SUPPORTED and alone.em_estimate == down.estimate
    with pytest.raises(ValueError, match="needs exact match's estimate"):
        judged_part("x - y", up, "direction", 5.0, "e", metric="p_target")


def test_underpowered_by_design_labels_only_an_inconclusive_interval() -> None:
    """A part whose pre-registered design MDE exceeds its margin reads "underpowered by design"
    when its interval leaves it inconclusive, the rule's verdict in the note; an interval that
    resolves anyway keeps its verdict (issue 56: P2's resolved OOD harm was hidden); a failed
    check still reads as a failed check; without a design statement nothing changes."""
    from rpb.report.claims import by_design
    from rpb.report.verdicts import BELOW_MARGIN, INCONCLUSIVE, UNDERPOWERED_BY_DESIGN

    wide = paired_runs([60.0, 52.0, 61.0, 45.0], [50.0, 58.0, 49.0, 55.0])
    part = judged_part("x - y", wide, "direction", 1.89, "e", metric="p_target", exact_match=wide)
    assert part.verdict == INCONCLUSIVE
    judged = by_design(part, 2.27)
    assert judged.verdict == UNDERPOWERED_BY_DESIGN
    assert judged.note.startswith(
        "design MDE 2.27 pp > margin 1.89 pp, as predicted before any method ran; the interval "
        "alone reads inconclusive"
    )
    assert (judged.estimate, judged.low, judged.high) == (part.estimate, part.low, part.high)
    assert by_design(part, 1.5) is part  # a powered design: the rule's verdict
    assert by_design(part, None) is part
    # Resolved intervals stand: a clear gain, a gain below the margin, a clear loss.
    up = paired_runs([60.0, 62.0, 61.0, 63.0], [40.0, 41.0, 40.5, 42.0])
    small = paired_runs([41.0, 42.5, 41.2, 43.0], [40.0, 41.0, 40.5, 42.0])
    down = paired_runs([40.0, 41.0, 40.5, 42.0], [60.0, 62.0, 61.0, 63.0])
    for diff, verdict in ((up, SUPPORTED), (small, BELOW_MARGIN), (down, NOT_SUPPORTED)):
        resolved = judged_part(
            "x - y", diff, "direction", 1.89, "e", metric="p_target", exact_match=diff
        )
        assert resolved.verdict == verdict
        assert by_design(resolved, 2.27) is resolved
    failed = Check("M1", "lbl flattens routing", False, "none")
    untestable = judged_part(
        "x - y", wide, "direction", 1.89, "e", [failed], metric="p_target", exact_match=wide
    )
    assert by_design(untestable, 2.27).verdict == NOT_TESTABLE


def test_a_check_reads_as_what_it_means_never_as_a_failure() -> None:
    """Issue 48: "M1 ...: FAILED" read as a pipeline failure; the landing page words a check by
    what its outcome means."""
    m1 = Check("M1", "lbl flattens routing vs none (tinyA)", False, "entropy +0.05",
               "lbl did not flatten routing vs none (tinyA)")  # fmt: skip
    assert m1.outcome() == "not met: lbl did not flatten routing vs none (tinyA)"
    assert Check("M5", "headroom above none", True, "5%").outcome() == "met: headroom above none"
    m2 = Check("M2", "the rpb reading anchors", False, "undetermined: 2 runs not built", "x")
    assert m2.undetermined and m2.outcome() == "undetermined: the rpb reading anchors"
    assert Check("M9", "p holds", False, "0.1").outcome() == "not met: p holds"
    # Captions and claims.csv (`text`) word it the same way, with the numbers.
    assert m1.text() == "M1 not met: lbl did not flatten routing vs none (tinyA) (entropy +0.05)"
    assert [c.state for c in (m1, m2)] == ["not met", "undetermined"]
