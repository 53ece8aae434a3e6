"""Verdict rules of the claims audit, fixed before any result was seen (docs/claims.md): each
judges one interval (a paired per-run difference, or a within-seed rank correlation) with its
minimum detectable effect.

- `direction` ("X beats Y"): supported when the CI of X - Y lies above 0; not supported when it
  lies below 0, or when it lies inside (-margin, +margin) and the MDE is at most the margin (a
  design able to see an effect worth claiming saw none); otherwise inconclusive, "underpowered"
  where the MDE exceeds the margin.
- `equivalence` ("X and Y are comparable"): supported when the CI lies inside (-margin, +margin);
  not supported when it lies wholly outside it; otherwise inconclusive (underpowered where the
  equivalence MDE exceeds the margin).
- `exceeds` ("X - Y is larger than t"): supported when the CI lies above t; not supported when it
  lies below t; otherwise inconclusive (underpowered where the MDE exceeds the part's scale).

`combine` makes a claim's verdict from its parts'. Pure functions of numbers: rpb.report.audit
applies them to a run's parts, rpb.report.claims to the paper's claims.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
INCONCLUSIVE = "inconclusive"
NOT_TESTABLE = "not testable"
PREMISE_NOT_MET = "premise not met"
# Decided before any method ran: the design's MDE exceeds the most a method could change (the
# OOD headroom of the premise screen, docs/testbed.md); the interval is still reported.
UNDERPOWERED_BY_DESIGN = "underpowered by design"
VERDICTS = (
    SUPPORTED,
    NOT_SUPPORTED,
    INCONCLUSIVE,
    NOT_TESTABLE,
    PREMISE_NOT_MET,
    UNDERPOWERED_BY_DESIGN,
)
PREMISE_CHECK = "M0"  # the testbed's premise; a failed one reads PREMISE_NOT_MET
CONFIRMATORY = "confirmatory"
EXPLORATORY = "exploratory"


# --- the rules ----------------------------------------------------------------------------------


def _check_interval(low: float, high: float) -> bool:
    """False for an undefined interval (NaN), which every rule reads as inconclusive."""
    if math.isnan(low) or math.isnan(high):
        return False
    if low > high:
        raise ValueError(f"interval low {low} exceeds high {high}")
    return True


def underpowered(mde: float | None, margin: float) -> bool:
    """True when the design cannot see an effect of the margin's size: MDE > margin, or an
    unknown MDE (one run). None means "not stated" (no power gate)."""
    return mde is not None and not (mde <= margin)


def direction_verdict(low: float, high: float, margin: float, mde: float | None = None) -> str:
    """ "X beats Y" from the CI [low, high] of X - Y and its MDE (see the module docstring)."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if not _check_interval(low, high):
        return INCONCLUSIVE
    if low > 0:
        return SUPPORTED
    if high < 0:
        return NOT_SUPPORTED  # a resolved effect the other way, whatever the power
    if underpowered(mde, margin):
        return INCONCLUSIVE  # no effect seen by a design that could not see one
    if -margin < low and high < margin:
        return NOT_SUPPORTED
    return INCONCLUSIVE


def equivalence_verdict(low: float, high: float, margin: float) -> str:
    """ "X and Y are comparable" from the CI [low, high] of X - Y."""
    if margin <= 0:
        raise ValueError(f"an equivalence margin must be > 0, got {margin}")
    if not _check_interval(low, high):
        return INCONCLUSIVE
    if -margin < low and high < margin:
        return SUPPORTED
    if low >= margin or high <= -margin:
        return NOT_SUPPORTED
    return INCONCLUSIVE


def exceeds_verdict(low: float, high: float, threshold: float) -> str:
    """ "X - Y exceeds `threshold`" from the CI [low, high] of X - Y."""
    if not _check_interval(low, high):
        return INCONCLUSIVE
    if low > threshold:
        return SUPPORTED
    if high < threshold:
        return NOT_SUPPORTED
    return INCONCLUSIVE


def combine(verdicts: Sequence[str]) -> str:
    """A claim from its parts: any part not supported -> not supported; else any premise not met
    -> premise not met; else any not testable -> not testable; all supported -> supported; all
    underpowered by design -> underpowered by design; otherwise inconclusive."""
    if not verdicts:
        raise ValueError("a claim needs at least one part")
    unknown = [v for v in verdicts if v not in VERDICTS]
    if unknown:
        raise ValueError(f"unknown verdict {unknown[0]!r} (known: {', '.join(VERDICTS)})")
    if NOT_SUPPORTED in verdicts:
        return NOT_SUPPORTED
    if PREMISE_NOT_MET in verdicts:
        return PREMISE_NOT_MET
    if NOT_TESTABLE in verdicts:
        return NOT_TESTABLE
    if all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    if all(v == UNDERPOWERED_BY_DESIGN for v in verdicts):
        return UNDERPOWERED_BY_DESIGN
    return INCONCLUSIVE
