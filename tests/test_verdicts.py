"""The verdict rules (rpb.report.verdicts), each on intervals with a known answer: direction,
equivalence and exceeds, their underpowered readings, and how parts combine into a claim."""

from __future__ import annotations

import pytest

from rpb.report.verdicts import (
    BELOW_MARGIN,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    NOT_TESTABLE,
    PREMISE_NOT_MET,
    SUPPORTED,
    UNDERPOWERED_BY_DESIGN,
    combine,
    direction_verdict,
    equivalence_verdict,
    exceeds_verdict,
)

NAN = float("nan")


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (5.5, 9.0, SUPPORTED),  # clears the margin
        (0.5, 9.0, BELOW_MARGIN),  # above zero, not clear of the margin: not the claimed effect
        (0.5, 4.0, BELOW_MARGIN),  # a real effect, resolved as smaller than the margin
        (5.0, 9.0, BELOW_MARGIN),  # touching the margin is not clearing it
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
    assert direction_verdict(low, high, margin=5.0, mde=4.0) == expected  # powered: the same


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (-3.0, 4.0, INCONCLUSIVE),  # "no effect" from a design that could not see one
        (5.5, 9.0, SUPPORTED),  # a resolved effect stands whatever the power
        (0.5, 9.0, BELOW_MARGIN),  # a resolved sign too
        (-9.0, -0.5, NOT_SUPPORTED),  # so does a resolved effect the other way
    ],
)
def test_direction_verdict_when_underpowered(low: float, high: float, expected: str) -> None:
    assert direction_verdict(low, high, margin=5.0, mde=8.0) == expected
    assert direction_verdict(low, high, margin=5.0, mde=NAN) == expected


def test_direction_without_margin_is_the_sign_rule() -> None:
    assert direction_verdict(-0.1, 0.1, margin=0.0) == INCONCLUSIVE
    assert direction_verdict(0.1, 0.2, margin=0.0) == SUPPORTED


def test_an_effect_above_zero_but_under_the_margin_is_not_supported_as_claimed() -> None:
    """Issue 56: with enough runs a true effect a third of the margin resolves above 0; the
    claim ("beats by an effect worth claiming") must not read supported on it."""
    assert direction_verdict(1.2, 2.2, margin=5.0, mde=1.4) == BELOW_MARGIN
    assert combine([BELOW_MARGIN, SUPPORTED]) == BELOW_MARGIN
    assert combine([BELOW_MARGIN, INCONCLUSIVE]) == INCONCLUSIVE


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
    assert combine([SUPPORTED, INCONCLUSIVE, NOT_TESTABLE]) == NOT_TESTABLE
    assert combine([NOT_TESTABLE, NOT_SUPPORTED]) == NOT_SUPPORTED  # a testable part refutes it
    assert combine([NOT_TESTABLE, PREMISE_NOT_MET, SUPPORTED]) == PREMISE_NOT_MET
    assert combine([PREMISE_NOT_MET, NOT_SUPPORTED]) == NOT_SUPPORTED
    # Parts of one claim: a premise not met decides it (C6's accuracy parts and its structure).
    assert combine([SUPPORTED, PREMISE_NOT_MET]) == PREMISE_NOT_MET
    # One comparison replicated over families (C4): a family whose premise is not met neither
    # hides nor decides another family's judged part.
    assert combine([INCONCLUSIVE, PREMISE_NOT_MET], replicates=True) == INCONCLUSIVE
    assert combine([SUPPORTED, PREMISE_NOT_MET], replicates=True) == SUPPORTED
    assert combine([PREMISE_NOT_MET, PREMISE_NOT_MET], replicates=True) == PREMISE_NOT_MET
    assert combine([UNDERPOWERED_BY_DESIGN, UNDERPOWERED_BY_DESIGN]) == UNDERPOWERED_BY_DESIGN
    assert combine([UNDERPOWERED_BY_DESIGN, SUPPORTED]) == INCONCLUSIVE
    assert combine([UNDERPOWERED_BY_DESIGN, NOT_SUPPORTED]) == NOT_SUPPORTED
    with pytest.raises(ValueError, match="at least one"):
        combine([])
    with pytest.raises(ValueError, match="unknown verdict 'maybe'"):
        combine([SUPPORTED, "maybe"])
    with pytest.raises(ValueError, match="exceeds high"):
        direction_verdict(2.0, 1.0, 5.0)
    with pytest.raises(ValueError, match="margin"):
        equivalence_verdict(-1.0, 1.0, 0.0)
