"""Verdict rules of the claims audit, fixed before any result was seen (docs/claims.md): each
judges one interval (a paired per-run difference, or a within-seed rank correlation) with its
minimum detectable effect.

- `direction` ("X beats Y" by an effect worth claiming, the margin): supported when the CI of
  X - Y lies above the margin; "positive, below the margin" when it lies above 0 but not above
  the margin (a real effect, not one of the claimed size); not supported when it lies below 0, or
  when it lies inside (-margin, +margin) and the MDE is at most the margin (a design able to see
  an effect worth claiming saw none); otherwise inconclusive, "underpowered" where the MDE
  exceeds the margin. (Rule of 2026-12-07; until then "supported" needed only a CI above 0.)
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
# A direction part whose interval lies above 0 but not above the margin: X beats Y, by less than
# an effect worth claiming (or by an amount the interval cannot yet place above the margin).
BELOW_MARGIN = "positive, below the margin"
INCONCLUSIVE = "inconclusive"
NOT_TESTABLE = "not testable"
PREMISE_NOT_MET = "premise not met"
# Decided before any method ran: the design's MDE exceeds the part's margin; an interval that
# resolves anyway keeps its own verdict (`rpb.report.claims.by_design`).
UNDERPOWERED_BY_DESIGN = "underpowered by design"
VERDICTS = (
    SUPPORTED,
    BELOW_MARGIN,
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
    """ "X beats Y" by the margin, from the CI [low, high] of X - Y and its MDE (see the module
    docstring)."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if not _check_interval(low, high):
        return INCONCLUSIVE
    if low > margin:
        return SUPPORTED
    if low > 0:
        return BELOW_MARGIN  # resolved above 0 whatever the power, not above the margin
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


def combine(verdicts: Sequence[str], *, replicates: bool = False) -> str:
    """A claim from its parts: any part not supported -> not supported; else any premise not met
    -> premise not met; else any not testable -> not testable; all supported -> supported; all
    underpowered by design -> underpowered by design; all supported or positive below the margin
    -> positive, below the margin; otherwise inconclusive.

    `replicates`: the parts are one comparison replicated on several families (C4). A family whose
    premise is not met (M0) neither decides nor hides another family's judged part, so its parts
    are set aside while any part was judged; premise not met only when every part is."""
    if not verdicts:
        raise ValueError("a claim needs at least one part")
    unknown = [v for v in verdicts if v not in VERDICTS]
    if unknown:
        raise ValueError(f"unknown verdict {unknown[0]!r} (known: {', '.join(VERDICTS)})")
    if replicates and any(v != PREMISE_NOT_MET for v in verdicts):
        verdicts = [v for v in verdicts if v != PREMISE_NOT_MET]
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
    if all(v in (SUPPORTED, BELOW_MARGIN) for v in verdicts):
        return BELOW_MARGIN
    return INCONCLUSIVE
