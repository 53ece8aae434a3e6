"""Claims audit: does this run support each of the paper's claims C1-C6?

Each claim is split into parts; each part is one interval (the t-interval of a paired per-run
difference, or of a within-seed rank correlation) with its minimum detectable effect, judged by
a rule fixed before any result was seen (docs/claims.md):

- `direction` ("X beats Y"): supported when the CI of X - Y lies above 0; not supported when it
  lies below 0, or when it lies inside (-margin, +margin) and the MDE is at most the margin (a
  design able to see an effect worth claiming saw none); otherwise inconclusive, "underpowered"
  where the MDE exceeds the margin.
- `equivalence` ("X and Y are comparable"): supported when the CI lies inside (-margin, +margin);
  not supported when it lies wholly outside it; otherwise inconclusive (underpowered where the
  equivalence MDE exceeds the margin).
- `exceeds` ("X - Y is larger than t"): supported when the CI lies above t; not supported when it
  lies below t; otherwise inconclusive (underpowered where the MDE exceeds the part's scale).

Accuracy is judged on one measure (`rpb.tables.primary_measure`): at tiny scale p(target), with
exact match's estimate of the same difference required to agree for "supported" (same sign for
a direction part, above the threshold for an exceeds part, inside (-margin, +margin) for an
equivalence part; otherwise "inconclusive (exact match disagrees: estimate x)"); at paper scale
exact match, the standard tasks' own metric, alone (docs/claims.md, "The primary metric at tiny
scale"). Every accuracy part reports both measures' estimate, interval and MDE.

Before any of that, checks test the premises. M0 is the testbed's premise (the premise screen,
docs/testbed.md): a part on a family whose premise was not met reads "premise not met". The
manipulation checks (M1-M6) test that each method did what it claims: a part whose check fails is
"not testable", naming the check and its value. A claim is not supported when any judged part
is, otherwise "premise not met" when any part is, not testable when any part is, supported when
every part is, and inconclusive otherwise. Controls (P1 placebo, P2 permuted prior) are
exploratory parts judged by the same rules.
Only the paper's reported numbers (C1's three) are constants here; every measured number is read
from this run's outputs through `rpb.run_records` and the tables' frames (`rpb.tables`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rpb.artifacts import atomic_path, write_text
from rpb.exploratory import ANCHOR_METRICS
from rpb.report_html import write_claims_html
from rpb.run_records import analysis_mean, analysis_path
from rpb.specs import base_index
from rpb.stats import (
    DEFAULT_POWER,
    Difference,
    describe_interval,
    friedman_power,
    paired_runs,
    rank_consistency,
    seeds_needed,
)
from rpb.tables import (
    EXACT_MATCH,
    MEASURE_NAMES,
    P_TARGET,
    PAPER_TABLE1,
    SUFFIX,
    compare,
    hard_labels,
    primary_measure,
    rank_order,
    table4_frames,
    table5_frames,
)

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
INCONCLUSIVE = "inconclusive"
NOT_TESTABLE = "not testable"
PREMISE_NOT_MET = "premise not met"
VERDICTS = (SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE, NOT_TESTABLE, PREMISE_NOT_MET)
PREMISE_CHECK = "M0"  # the testbed's premise; a failed one reads PREMISE_NOT_MET
CONFIRMATORY = "confirmatory"
EXPLORATORY = "exploratory"
NONE = "none"  # the unanchored plain fine-tuning every check compares against

STATEMENTS = {
    "C1": "On family A, math post-training with RPB beats re-applied LBL and unanchored "
    "fine-tuning in-domain (paper: 45.77 vs 31.91 vs 29.44)",
    "C2": "RPB retains more out-of-domain capability than LBL and unanchored fine-tuning",
    "C3": "RPB beats LBL in-domain also on family B",
    "C4": "The RPB-over-LBL advantage is statistically resolvable on an independently "
    "generated math corpus",
    "C5": "Anchors on router weights, logits and output distribution perform comparably to each "
    "other and to RPB, with no consistent ordering",
    "C6": "Retained co-activation community structure tracks the gains where the base router is "
    "non-uniform; hard assignment of the same prior keeps the structure but accuracy falls "
    "sharply (tested as an association)",
    "P1": "Control: a placebo arm (a negligible LBL term) differs from plain fine-tuning by no "
    "claimable amount; 'supported' here is an empirical false positive",
    "P2": "Control: RPB's effect depends on the base prior (RPB beats RPB with a per-layer "
    "expert-permuted prior)",
}
MEASURED_BY = {
    "C1": "table1",
    "C2": "table1",
    "C3": "table2",
    "C4": "table3",
    "C5": "table4",
    "C6": "table5",
    "P1": "table1 runs + claims.placebo",
    "P2": "table1 runs + claims.permuted",
}
KINDS = {c: CONFIRMATORY for c in ("C1", "C2", "C3", "C4", "C5", "C6")}
KINDS |= {"P1": EXPLORATORY, "P2": EXPLORATORY}


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
    -> premise not met; else any not testable -> not testable; all supported -> supported;
    otherwise inconclusive."""
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
    return INCONCLUSIVE


# --- checks and parts ---------------------------------------------------------------------------


def _fmt(x: float, digits: int = 1) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.{digits}f}"


@dataclass(frozen=True)
class Check:
    """A manipulation check: a premise of some parts, judged before any accuracy verdict."""

    id: str
    premise: str
    passed: bool
    value: str

    def text(self) -> str:
        return f"{self.id} {self.premise}: {'passed' if self.passed else 'FAILED'} ({self.value})"


@dataclass(frozen=True)
class Part:
    """One judged piece of evidence of a claim: its verdict, the numbers behind it, the checks it
    depended on, and (for an inconclusive or not testable part) why."""

    verdict: str
    evidence: str
    name: str = ""
    rule: str = ""
    estimate: float = math.nan
    low: float = math.nan
    high: float = math.nan
    margin: float = math.nan
    mde: float = math.nan
    seeds_needed: int = -1
    n_runs: int = 0
    checks: tuple[Check, ...] = field(default_factory=tuple)
    note: str = ""
    # The measure the part is judged on (p_target, exact_match; a structure part: its metric)
    # and exact match's numbers of the same comparison (NaN for a part that is not accuracy).
    metric: str = ""
    em_estimate: float = math.nan
    em_low: float = math.nan
    em_high: float = math.nan
    em_mde: float = math.nan
    # What the part's rule says of its numbers were every check passed; differs from `verdict`
    # only where a check failed. Not a verdict on the claim: it lets two runs be compared
    # number for number (bench/verdict_stability.py) while a premise fails on both.
    checks_waived: str = ""

    @property
    def waived(self) -> str:
        """`checks_waived`, or the verdict itself where the part has no rule verdict of its own."""
        return self.checks_waived or self.verdict

    @property
    def detail(self) -> str:
        """The verdict as claims.md prints it: with its reason where it has one."""
        if self.verdict in (NOT_TESTABLE, PREMISE_NOT_MET):
            return f"{self.verdict}: {self.note}"
        return f"{self.verdict} ({self.note})" if self.note else self.verdict


def _underpowered_note(mde: float, needed: int, unit: str) -> str:
    if needed < 0:
        return "underpowered: one run per arm, no spread estimate; needs at least 2 seeds"
    seeds = f"more than {needed - 1} seeds" if needed > 1000 else f"{needed} seeds"
    return f"underpowered: MDE {_fmt(mde, 1 if unit == 'pp' else 3)} {unit}, needs {seeds}"


def exact_match_agrees(rule: str, estimate: float, margin: float, threshold: float = 0.0) -> bool:
    """Does exact match's estimate agree with a "supported" p(target) part (docs/claims.md, "The
    primary metric at tiny scale")? Direction: it is above 0 (the supported sign); exceeds t: it
    is above t; equivalence: it lies inside (-margin, +margin). An undefined estimate does not."""
    if math.isnan(estimate):
        return False
    if rule == "direction":
        return estimate > 0
    if rule == "exceeds":
        return estimate > threshold
    if rule == "equivalence":
        return -margin < estimate < margin
    raise ValueError(f"unknown rule {rule!r} (direction, equivalence, exceeds)")


def judged_part(
    name: str,
    diff: Difference,
    rule: str,
    margin: float,
    evidence: str,
    checks: Sequence[Check] = (),
    *,
    threshold: float = 0.0,
    unit: str = "pp",
    metric: str = "",
    exact_match: Difference | None = None,
) -> Part:
    """Judge one interval: not testable if a check failed; else by `rule` ("direction",
    "equivalence", "exceeds" with `threshold`) with the power gate at `margin`. `metric` names
    the measure `diff` is on; on p(target) `exact_match` (the same comparison in exact match) is
    required, and "supported" then also needs its estimate to agree (`exact_match_agrees`).
    The part carries exact match's numbers (`em_*`: `exact_match`, or `diff` itself where
    `metric` is exact match)."""
    equivalence = rule == "equivalence"
    if metric == P_TARGET and exact_match is None:
        raise ValueError(f"{name}: a p(target) part needs exact match's estimate beside it")
    em = exact_match if exact_match is not None else diff if metric == EXACT_MATCH else None
    mde = diff.mde_equivalence if equivalence else diff.mde
    needed = seeds_needed(
        diff.sd,
        margin,
        confidence=diff.confidence,
        power=diff.power,
        equivalence=equivalence,
    )
    common = {
        "name": name,
        "rule": rule if rule != "exceeds" else f"exceeds {threshold:g}",
        "estimate": diff.estimate,
        "low": diff.low,
        "high": diff.high,
        "margin": margin,
        "mde": mde,
        "seeds_needed": needed,
        "n_runs": diff.n_seeds,
        "checks": tuple(checks),
        "metric": metric,
    }
    if em is not None:
        common |= {"em_estimate": em.estimate, "em_low": em.low, "em_high": em.high}
        common["em_mde"] = em.mde_equivalence if equivalence else em.mde
    note = ""
    if diff.n_seeds < 2:
        # No run-to-run spread: an interval over one run's items says nothing about runs.
        verdict, note = INCONCLUSIVE, _underpowered_note(mde, -1, unit)
    elif rule == "direction":
        verdict = direction_verdict(diff.low, diff.high, margin, mde)
    elif equivalence:
        verdict = equivalence_verdict(diff.low, diff.high, margin)
    elif rule == "exceeds":
        verdict = exceeds_verdict(diff.low, diff.high, threshold)
    else:
        raise ValueError(f"unknown rule {rule!r} (direction, equivalence, exceeds)")
    if not note and verdict == INCONCLUSIVE and underpowered(mde, margin):
        note = _underpowered_note(mde, needed, unit)
    if verdict == SUPPORTED and metric == P_TARGET:
        # p(target) moves with calibration alone; greedy answers must move the same way.
        assert exact_match is not None
        if not exact_match_agrees(rule, exact_match.estimate, margin, threshold):
            digits = 1 if unit == "pp" else 3
            value = exact_match.estimate
            # Undefined where exact match cannot order the runs at all (every score tied).
            shown = "undefined" if math.isnan(value) else f"{value:+.{digits}f}"
            verdict = INCONCLUSIVE
            note = f"exact match disagrees: estimate {shown}" + (
                f" {unit}" if unit == "pp" and not math.isnan(value) else ""
            )
    return _checked(Part(verdict, evidence, note=note, **common))


def _checked(part: Part) -> Part:
    """`part` made "premise not met" if the testbed's premise (M0) failed, else not testable if
    one of its checks failed, its rule's verdict kept aside."""
    failed = [c for c in part.checks if not c.passed]
    if not failed:
        return part
    note = "; ".join(f"{c.id} {c.premise} failed, {c.value}" for c in failed)
    premise = any(c.id == PREMISE_CHECK for c in failed)
    verdict = PREMISE_NOT_MET if premise else NOT_TESTABLE
    return replace(part, verdict=verdict, note=note, checks_waived=part.verdict)


def _diff_text(where: str, a: float, b: float, diff: Difference, unit: str = "pp") -> str:
    digits = 1 if unit == "pp" else 3
    return (
        f"{where}: {_fmt(a, digits)} vs {_fmt(b, digits)}, diff {diff.estimate:+.{digits}f} "
        f"{unit} [{_fmt(diff.low, digits)}, {_fmt(diff.high, digits)}], MDE "
        f"{_fmt(diff.mde, digits)}, p={_fmt(diff.p_value, 3)} ({diff.n_seeds} runs"
        + (f" x {diff.n_items} items)" if diff.n_items else ")")
    )


def _measures_text(
    where: str,
    measure: str,
    scores: tuple[float, float, Difference],
    em: tuple[float, float, Difference] | None,
    extra: str = "",
    equivalence: bool = False,
) -> str:
    """An accuracy part's evidence: the judged measure's numbers (with the equivalence MDE for
    an `equivalence` part, then `extra`), and exact match's beside them where the judged measure
    is p(target)."""

    def eq_mde(diff: Difference) -> str:
        return f", equivalence MDE {_fmt(diff.mde_equivalence)}" if equivalence else ""

    text = _diff_text(f"{where} ({MEASURE_NAMES[measure]})", *scores)
    text += eq_mde(scores[2]) + extra
    if measure != EXACT_MATCH and em is not None:
        a, b, diff = em
        text += (
            f"; exact match: {_fmt(a)} vs {_fmt(b)}, diff {diff.estimate:+.1f} pp "
            f"[{_fmt(diff.low)}, {_fmt(diff.high)}], MDE {_fmt(diff.mde)}" + eq_mde(diff)
        )
    return text


class Audit:
    """Everything one audit reads: the spec, the results folder, and each manipulation check,
    computed once and shared by every part that depends on it."""

    def __init__(self, results: Path, spec: dict[str, Any], partial: bool = False) -> None:
        self.results = Path(results)
        self.spec = spec
        # Judging from a subset of the runs (table 1's caption, `table_verdicts`): a check whose
        # runs that subset lacks is undetermined (failed, saying so), not an error.
        self.partial = partial
        self.method, self.reference = spec["method"], spec["reference"]
        self.margin = float(spec["margin"])
        self.nmi_margin = float(spec["nmi_margin"])
        self.rho_margin = float(spec.get("rho_margin", 0.5))
        self.confidence = float(spec["confidence"])
        self.power = float(spec.get("power", DEFAULT_POWER))
        # The measure accuracy is judged on: p(target) at tiny scale, else exact match.
        self.measure = primary_measure(spec)
        self._checks: dict[tuple, Check] = {}

    @property
    def level(self) -> dict[str, float]:
        return {"confidence": self.confidence, "power": self.power}

    def compare(
        self,
        spec: dict[str, Any],
        model: str,
        corpora: Sequence[str],
        method: str,
        other: str,
        metric: str,
        seeds: Sequence[int],
    ) -> tuple[tuple[float, float, Difference], tuple[float, float, Difference] | None]:
        """`rpb.tables.compare` on the judged measure, and on exact match beside it (None where
        exact match is the judged measure)."""
        args = (self.results, spec, model, corpora, method, other, metric, seeds)
        judged = compare(*args, measure=self.measure)
        return judged, (None if self.measure == EXACT_MATCH else compare(*args))

    def _cached(self, key: tuple, compute: Callable[[], Check]) -> Check:
        if key not in self._checks:
            self._checks[key] = compute()
        return self._checks[key]

    @property
    def checks(self) -> list[Check]:
        return list(self._checks.values())

    def _metric(self, model: str, corpus: str, label: str, seeds: Sequence[int], key: str):
        return np.array(
            [analysis_mean(self.results, model, corpus, label, s).get(key, math.nan) for s in seeds]
        )

    def _paired_metric(
        self, model: str, corpus: str, label: str, seeds: Sequence[int], key: str
    ) -> Difference | None:
        a = self._metric(model, corpus, label, seeds, key)
        b = self._metric(model, corpus, NONE, seeds, key)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            return None
        return paired_runs(a, b, **self.level)

    # M1 -------------------------------------------------------------------------------------
    def flattening_site(self, model: str) -> tuple[str, Sequence[int]] | None:
        """The corpus and seeds where `model` has both `none` and reference runs (tables 1, 2)."""
        t1, t2 = self.spec["table1"], self.spec.get("table2", {})
        for table in (t1, t2):
            if table.get("model") == model and {NONE, self.reference} <= set(table["methods"]):
                return table["corpus"], table["seeds"]
        return None

    def reference_flattens(self, model: str) -> Check:
        def compute() -> Check:
            premise = f"{self.reference} flattens routing vs none ({model})"
            site = self.flattening_site(model)
            if site is None:
                return Check("M1", premise, False, f"undetermined: no none/{self.reference} runs")
            corpus, seeds = site
            ent = self._paired_metric(model, corpus, self.reference, seeds, "usage_entropy")
            mod = self._paired_metric(model, corpus, self.reference, seeds, "modularity")
            if ent is None or mod is None:
                return Check("M1", premise, False, "undetermined: entropy or modularity missing")
            passed = bool(ent.low > 0 or mod.high < 0)
            value = (
                f"{model}/{corpus} {self.reference} - none usage entropy {ent.estimate:+.4f} "
                f"[{_fmt(ent.low, 4)}, {_fmt(ent.high, 4)}], modularity {mod.estimate:+.4f} "
                f"[{_fmt(mod.low, 4)}, {_fmt(mod.high, 4)}] over {ent.n_seeds} seeds"
            )
            return Check("M1", premise, passed, value)

        return self._cached(("M1", model), compute)

    # M2 -------------------------------------------------------------------------------------
    def method_anchors(self) -> Check:
        def compute() -> Check:
            t5 = self.spec["table5"]
            r = self.spec.get("readings") or {}
            model, corpus = r.get("model", t5["model"]), r.get("corpus", t5["corpus"])
            lower, upper = r.get("lower", NONE), r.get("upper", "hard")
            min_gain = float(r.get("min_gain", 0.25))
            seeds = r.get("seeds", t5["seeds"])
            premise = (
                f"the configured {self.method} reading anchors (readings rule, {model}/{corpus})"
            )
            labels = (lower, self.method, upper)
            missing = [
                (label, s)
                for label in labels
                for s in seeds
                if not analysis_path(self.results, model, corpus, label, s).is_file()
            ]
            if missing and self.partial:
                return Check(
                    "M2",
                    premise,
                    False,
                    f"undetermined: {len(missing)} of the readings runs' analyses are not built "
                    "by this target (`snakemake all` builds them)",
                )
            means = {
                label: {
                    m: float(np.mean(self._metric(model, corpus, label, seeds, m)))
                    for m in ANCHOR_METRICS
                }
                for label in (lower, self.method, upper)
            }
            positions, texts = [], []
            for m in ANCHOR_METRICS:
                gap = means[upper][m] - means[lower][m]
                pos = (means[self.method][m] - means[lower][m]) / gap if gap > 0 else math.nan
                positions.append(pos)
                texts.append(
                    f"{m} position {_fmt(pos, 3)}"
                    if math.isfinite(pos)
                    else f"{m} position undefined ({upper} does not exceed {lower})"
                )
            passed = all(math.isfinite(p) and p >= min_gain for p in positions)
            return Check("M2", premise, passed, ", ".join(texts) + f" (needs >= {min_gain:g})")

        return self._cached(("M2",), compute)

    # M3 -------------------------------------------------------------------------------------
    def hard_routes_as_base(self) -> Check:
        def compute() -> Check:
            t5 = self.spec["table5"]
            hard = hard_labels(t5)
            premise = "hard routes exactly as the base at evaluation"
            if not hard:
                return Check("M3", premise, False, "no hard-routing method in table 5")
            texts, passed = [], True
            for h in hard:
                overlap = self._metric(
                    t5["model"], t5["corpus"], h, t5["seeds"], "topk_overlap_with_base"
                )
                ok = bool(np.isfinite(overlap).all() and (overlap >= 1 - 1e-6).all())
                passed &= ok
                texts.append(
                    f"{h} top-k overlap with the base per seed {np.round(overlap, 6).tolist()}"
                )
            return Check("M3", premise, passed, "; ".join(texts))

        return self._cached(("M3",), compute)

    # M4 -------------------------------------------------------------------------------------
    def anchor_reduces_drift(self, anchor: str) -> Check:
        def compute() -> Check:
            t5 = self.spec["table5"]
            premise = f"{anchor} reduces router drift vs none"
            diff = self._paired_metric(t5["model"], t5["corpus"], anchor, t5["seeds"], "kl_to_base")
            if diff is None:
                return Check("M4", premise, False, "undetermined: KL to the base missing")
            value = (
                f"{t5['model']}/{t5['corpus']} {anchor} - none KL to the base router "
                f"{diff.estimate:+.4f} [{_fmt(diff.low, 4)}, {_fmt(diff.high, 4)}] over "
                f"{diff.n_seeds} seeds"
            )
            return Check("M4", premise, bool(diff.high < 0), value)

        return self._cached(("M4", anchor), compute)

    # M0 -------------------------------------------------------------------------------------
    def premise_checks(self, model: str) -> list[Check]:
        """The testbed's premise on `model`'s family, when the premise screen found it not met
        (`calibration.premise_not_met`, docs/testbed.md, "Testbed v2"): a failed premise of every
        part on it that compares accuracy (not of hard's structure retention, nor of the
        placebo control), which then reads "premise not met"."""
        reason = (self.spec.get("premise_not_met") or {}).get(model)
        if reason is None:
            return []
        return [
            self._cached(
                (PREMISE_CHECK, model),
                lambda: Check(
                    PREMISE_CHECK, f"the testbed's premise holds for {model}", False, reason
                ),
            )
        ]

    # M5 -------------------------------------------------------------------------------------
    def headroom(self, where: str, label: str, score: float) -> Check:
        """`label`'s in-domain score on the judged measure (p(target) at tiny scale) leaves room
        for an effect of the margin."""
        ceiling = 100.0 - self.margin
        return self._cached(
            ("M5", where, label),
            lambda: Check(
                "M5",
                f"headroom above {label} ({where})",
                bool(score <= ceiling),
                f"{label} in-domain {_fmt(score)}% ({MEASURE_NAMES[self.measure]}), an effect of "
                f"{self.margin:g} pp needs <= {ceiling:g}%",
            ),
        )

    # M6 -------------------------------------------------------------------------------------
    def base_structured(self, frames: dict[str, pd.DataFrame]) -> Check:
        def compute() -> Check:
            t5 = self.spec["table5"]
            model = t5["model"]
            min_split = float(self.spec.get("min_split_half_nmi", 0.5))
            premise = f"the base {model} router has stable community structure"
            base = frames["base"].set_index("layer").loc["mean"]
            modular = bool(base.modularity > base.uniform_modularity)
            head = (
                f"modularity {_fmt(base.modularity, 3)} vs uniform routing "
                f"{_fmt(base.uniform_modularity, 3)}"
            )
            path = self.results / "testbed.json"
            structure = (
                json.loads(path.read_text()).get(model, {}).get("structure")
                if path.is_file()
                else None
            )
            if not structure:
                return Check(
                    "M6",
                    premise,
                    False,
                    f"{head}; split-half NMI undetermined (no {path.name} entry)",
                )
            halves = [float(r["split_half_nmi"]) for r in structure["layers"]]
            halves = [h for h in halves if math.isfinite(h)]
            split = float(np.mean(halves)) if halves else math.nan
            uniform = float(structure["uniform"]["split_half_nmi"])
            uniform = 0.0 if math.isnan(uniform) else uniform  # no structure at chance at all
            stable = math.isfinite(split) and split >= min_split and split > uniform
            value = (
                f"{head}; split-half NMI {_fmt(split, 3)} vs uniform routing {_fmt(uniform, 3)} "
                f"(needs >= {min_split:g})"
            )
            return Check("M6", premise, bool(modular and stable), value)

        return self._cached(("M6",), compute)


# --- the claims ---------------------------------------------------------------------------------


def _others(methods: Sequence[str], method: str) -> list[str]:
    if method not in methods:
        raise ValueError(f"claims.method {method!r} is not among the table's methods {methods}")
    return [m for m in methods if m != method]


def _direction_part(
    audit: Audit,
    table: dict[str, Any],
    model: str,
    corpus: str,
    method: str,
    other: str,
    metric: str,
    checks: Sequence[Check],
    with_headroom: bool = True,
) -> Part:
    judged, em = audit.compare(audit.spec, model, [corpus], method, other, metric, table["seeds"])
    _, b, diff = judged
    where = f"{model}/{corpus} {metric} {method} - {other}"
    checks = list(checks)
    if with_headroom and metric == "in_domain":
        checks.append(audit.headroom(f"{model}/{corpus}", other, b))
    return judged_part(
        where,
        diff,
        "direction",
        audit.margin,
        _measures_text(where, audit.measure, judged, em),
        checks,
        metric=audit.measure,
        exact_match=em[2] if em else None,
    )


def _premises(audit: Audit, model: str, other: str) -> list[Check]:
    checks = [*audit.premise_checks(model), audit.method_anchors()]
    if other == audit.reference:
        checks.insert(0, audit.reference_flattens(model))
    return checks


def _table1_parts(audit: Audit, metric: str) -> list[Part]:
    """RPB - each other table-1 method on `metric`, on table 1's model and corpus."""
    t1 = audit.spec["table1"]
    return [
        _direction_part(
            audit,
            t1,
            t1["model"],
            t1["corpus"],
            audit.method,
            other,
            metric,
            _premises(audit, t1["model"], other),
        )
        for other in _others(t1["methods"], audit.method)
    ]


def claim_c1(audit: Audit) -> list[Part]:
    """RPB - each other table-1 method, in-domain."""
    return _table1_parts(audit, "in_domain")


def claim_c2(audit: Audit) -> list[Part]:
    """RPB - each other table-1 method, OOD (the mean of the OOD tasks per run)."""
    return _table1_parts(audit, "ood")


def claim_c3(audit: Audit) -> list[Part]:
    """RPB - LBL in-domain on table 2's (family B) model."""
    t2 = audit.spec["table2"]
    _others(t2["methods"], audit.method)
    return [
        _direction_part(
            audit,
            t2,
            t2["model"],
            t2["corpus"],
            audit.method,
            audit.reference,
            "in_domain",
            _premises(audit, t2["model"], audit.reference),
        )
    ]


def claim_c4(audit: Audit) -> list[Part]:
    """RPB - LBL in-domain on the independent corpus, every table-3 model."""
    t3 = audit.spec["table3"]
    return [
        _direction_part(
            audit,
            t3,
            model,
            t3["corpus"],
            audit.method,
            audit.reference,
            "in_domain",
            _premises(audit, model, audit.reference),
        )
        for model in t3["models"]
    ]


def claim_c5(audit: Audit) -> list[Part]:
    """Every pair of table-4 methods equivalent in-domain (one run per corpus and seed), and no
    consistent ordering (Friedman, judged with its power)."""
    spec = audit.spec
    t4 = {**spec["table4"], "ood": spec["ood"]}
    t4 |= {k: spec[k] for k in ("confidence", "n_resamples", "scale") if k in spec}
    t4 |= {"power": audit.power, "corpus_tasks": spec.get("corpus_tasks") or {}}
    methods, corpora = list(t4["methods"]), list(t4["corpora"])

    def checks_for(labels: Sequence[str]) -> list[Check]:
        out = audit.premise_checks(t4["model"])
        out += [audit.method_anchors()] if audit.method in labels else []
        return out + [audit.anchor_reduces_drift(m) for m in labels if m != audit.method]

    parts = []
    for i, first in enumerate(methods):
        for second in methods[i + 1 :]:
            judged, em = audit.compare(
                t4, t4["model"], corpora, first, second, "in_domain", t4["seeds"]
            )
            diff = judged[2]
            where = f"{t4['model']} in_domain {first} - {second} (corpora {'+'.join(corpora)})"
            text = _measures_text(where, audit.measure, judged, em, equivalence=True)
            parts.append(
                judged_part(
                    where,
                    diff,
                    "equivalence",
                    audit.margin,
                    text,
                    checks_for([first, second]),
                    metric=audit.measure,
                    exact_match=em[2] if em else None,
                )
            )
    runs = table4_frames(audit.results, t4)["runs"]

    def block_scores(column: str) -> np.ndarray:
        return runs.pivot(index=["corpus", "seed"], columns="method", values=column)[
            methods
        ].to_numpy()

    # Judged on the primary measure; exact match's Friedman test is reported beside it.
    s = block_scores(f"in_domain{SUFFIX[audit.measure]}")
    check = rank_consistency(s, methods)
    em_check = rank_consistency(block_scores("in_domain"), methods)
    alpha = 1.0 - audit.confidence
    pw = friedman_power(
        s,
        audit.margin,
        alpha=alpha,
        target=audit.power,
        n_sims=int(spec.get("n_resamples", 2000)),
    )
    text = (
        f"in-domain {MEASURE_NAMES[audit.measure]} ranking over {check.n_blocks} (corpus, seed) "
        f"blocks: Kendall's W {_fmt(check.kendall_w, 2)}, Friedman p={_fmt(check.friedman_p, 3)}, "
        f"its power {_fmt(pw.power, 2)} against an ordering spanning {audit.margin:g} pp (block "
        f"noise {_fmt(pw.noise_sd)} pp); mean-rank order {rank_order(check.mean_rank)}"
    )
    if audit.measure != EXACT_MATCH:
        text += (
            f"; exact match: Kendall's W {_fmt(em_check.kendall_w, 2)}, Friedman "
            f"p={_fmt(em_check.friedman_p, 3)}, mean-rank order {rank_order(em_check.mean_rank)}"
        )
    name = f"{t4['model']} no consistent in-domain ordering of {', '.join(methods)}"
    common = {
        "name": name,
        "rule": "friedman",
        "estimate": check.kendall_w,
        "margin": audit.margin,
        "n_runs": check.n_blocks,
        "checks": tuple(checks_for(methods)),
        "metric": audit.measure,
        "em_estimate": em_check.kendall_w,
    }
    if len(methods) < 3 or check.n_blocks < 2:
        part = Part(INCONCLUSIVE, text, note="needs >= 3 methods and >= 2 blocks", **common)
    elif math.isfinite(check.friedman_p) and check.friedman_p < alpha:
        part = Part(NOT_SUPPORTED, text, **common)
    elif pw.power >= audit.power or not math.isfinite(check.friedman_p):
        # Every block a full tie (p undefined, no noise): no ordering at all.
        part = Part(SUPPORTED, text, **common)
    else:
        blocks = (
            f"more than {pw.blocks_needed - 1} blocks"
            if pw.blocks_needed > 200
            else f"{pw.blocks_needed} blocks"
        )
        note = f"underpowered: Friedman power {_fmt(pw.power, 2)}, needs {blocks}"
        part = Part(INCONCLUSIVE, text, note=note, seeds_needed=pw.blocks_needed, **common)
    return [*parts, _checked(part)]


def claim_c6(audit: Audit) -> list[Part]:
    """Association of retention with accuracy within seeds (premise M6: a stable base
    structure); hard keeps the structure and its in-domain accuracy falls below RPB's by more
    than the margin (premise M3: hard routes as the base)."""
    spec = audit.spec
    t5 = {**spec["table5"], "ood": spec["ood"]}
    t5 |= {k: spec[k] for k in ("confidence", "n_resamples", "scale") if k in spec}
    t5 |= {"power": audit.power, "corpus_tasks": spec.get("corpus_tasks") or {}}
    frames = table5_frames(audit.results, t5)
    premise = audit.premise_checks(t5["model"])
    structured = audit.base_structured(frames)
    parts = []
    corr = frames["correlation"].set_index(["retention", "accuracy"])
    suffix = SUFFIX[audit.measure]
    for accuracy in ("in_domain", "ood_mean"):
        # Judged on the primary measure's association; exact match's must have the same sign.
        diff = _rho_difference(corr.loc[("community_nmi", f"{accuracy}{suffix}")], audit)
        em = _rho_difference(corr.loc[("community_nmi", accuracy)], audit)
        where = f"association of community_nmi with {accuracy} within seeds ({t5['model']})"
        text = (
            f"{where}: Spearman rho with {MEASURE_NAMES[audit.measure]} across the soft methods "
            f"per seed, mean {_fmt(diff.estimate, 2)} [{_fmt(diff.low, 2)}, "
            f"{_fmt(diff.high, 2)}], MDE {_fmt(diff.mde, 2)} over {diff.n_seeds} seeds "
            f"({diff.n_items} runs)"
        )
        if audit.measure != EXACT_MATCH:
            text += (
                f"; with exact match {_fmt(em.estimate, 2)} [{_fmt(em.low, 2)}, "
                f"{_fmt(em.high, 2)}], MDE {_fmt(em.mde, 2)}"
            )
        parts.append(
            judged_part(
                where,
                diff,
                "exceeds",
                audit.rho_margin,
                text,
                [*premise, structured],
                unit="rho",
                metric=audit.measure,
                exact_match=em if audit.measure != EXACT_MATCH else None,
            )
        )
    hard = hard_labels(t5)
    m3 = audit.hard_routes_as_base()
    if not hard:
        parts.append(
            Part(
                NOT_TESTABLE,
                "no hard-routing method in table 5",
                checks=(m3,),
                note=f"M3 {m3.premise} failed, {m3.value}",
            )
        )
    comparisons = frames["hard"]
    for h in hard:
        sel = comparisons[(comparisons["method"] == h) & (comparisons["other"] == audit.method)]
        nmi = sel[sel["metric"] == "community_nmi"]
        where = f"{h} - {audit.method} community NMI"
        if nmi.empty:
            parts.append(
                Part(
                    INCONCLUSIVE,
                    f"{where} undefined (single-community base)",
                    name=where,
                    checks=(m3,),
                    metric="community_nmi",
                )
            )
        else:
            r = nmi.iloc[0]
            diff = _row_difference(r, audit)
            text = _diff_text(where, r.method_score, r.other_score, diff, unit="NMI")
            text += f" (keeps the structure if above -{audit.nmi_margin:g})"
            parts.append(
                judged_part(
                    where,
                    diff,
                    "exceeds",
                    audit.nmi_margin,
                    text,
                    [m3],  # structure, not accuracy: the testbed's premise (M0) does not apply
                    threshold=-audit.nmi_margin,
                    unit="NMI",
                    metric="community_nmi",
                )
            )
        acc = sel[sel["metric"] == "in_domain"].iloc[0]
        where = f"{audit.method} - {h} in_domain"
        judged = _flipped_scores(acc, audit, suffix)
        em = _flipped_scores(acc, audit, "") if audit.measure != EXACT_MATCH else None
        text = _measures_text(
            where, audit.measure, judged, em, f" (sharp if above {audit.margin:g})"
        )
        parts.append(
            judged_part(
                where,
                judged[2],
                "exceeds",
                audit.margin,
                text,
                [*premise, m3],
                threshold=audit.margin,
                metric=audit.measure,
                exact_match=em[2] if em else None,
            )
        )
    return parts


def _flipped_scores(row: Any, audit: Audit, suffix: str) -> tuple[float, float, Difference]:
    """(other's score, method's score, other - method) from a comparison row, in the measure of
    `suffix` ("" exact match, "_p" p(target))."""
    return (
        float(row[f"other_score{suffix}"]),
        float(row[f"method_score{suffix}"]),
        _row_difference(row, audit, flip=True, suffix=suffix),
    )


def _rho_difference(row: Any, audit: Audit) -> Difference:
    """A `Difference` (estimate: the mean within-seed rho) from a table-5 correlation row."""
    return Difference(
        float(row.spearman_rho),
        float(row.rho_ci_low),
        float(row.rho_ci_high),
        float(row.p_value),
        int(row.n_seeds),
        int(row.n_runs),
        sd=float(row.rho_sd),
        mde=float(row.mde),
        confidence=audit.confidence,
        power=audit.power,
    )


def _row_difference(row: Any, audit: Audit, flip: bool = False, suffix: str = "") -> Difference:
    """A `Difference` from a table row written by `rpb.tables.comparison_row` (b - a if flip);
    `suffix` `_p`: its p(target) columns (`diff_p`, `diff_p_ci_low`, `p_value_p`, ...)."""
    sign = -1.0 if flip else 1.0
    d = f"diff{suffix}"
    low, high = float(row[f"{d}_ci_low"]), float(row[f"{d}_ci_high"])
    # `+ 0.0` keeps a flipped 0 from printing as -0.0.
    return Difference(
        sign * float(row[d]) + 0.0,
        sign * (high if flip else low) + 0.0,
        sign * (low if flip else high) + 0.0,
        float(row[f"p_value{suffix}"]),
        int(row["n_seeds"]),
        int(row["n_items"]),
        sd=float(row[f"{d}_sd"]),
        mde=float(row[f"mde{suffix}"]),
        mde_equivalence=float(row[f"mde_equivalence{suffix}"]),
        confidence=audit.confidence,
        power=audit.power,
    )


def control_placebo(audit: Audit) -> list[Part]:
    """P1: the placebo arm - none, in-domain and OOD, on table 1's model and corpus. A false
    positive is a property of the statistics, not of the testbed: no M0 premise."""
    return _control(audit, audit.spec["placebo"], NONE, [])


def control_permuted_prior(audit: Audit) -> list[Part]:
    """P2: rpb - rpb trained with the expert-permuted prior, in-domain and OOD."""
    t1 = audit.spec["table1"]
    return _control(audit, audit.method, audit.spec["permuted"], audit.premise_checks(t1["model"]))


def _control(audit: Audit, method: str, other: str, checks: list[Check]) -> list[Part]:
    t1 = audit.spec["table1"]
    table = {**t1, "seeds": audit.spec.get("controls_seeds") or audit.spec["table5"]["seeds"]}
    parts = []
    for metric in ("in_domain", "ood"):
        part = _direction_part(
            audit,
            table,
            t1["model"],
            t1["corpus"],
            method,
            other,
            metric,
            checks,
            with_headroom=False,
        )
        if part.n_runs and part.low == part.high == part.estimate == 0:
            part = replace(part, evidence=f"{part.evidence}; identical to {other} in every run")
        parts.append(part)
    return parts


CLAIMS: dict[str, Callable[[Audit], list[Part]]] = {
    "C1": claim_c1,
    "C2": claim_c2,
    "C3": claim_c3,
    "C4": claim_c4,
    "C5": claim_c5,
    "C6": claim_c6,
}
CONTROLS: dict[str, tuple[str, Callable[[Audit], list[Part]]]] = {
    "P1": ("placebo", control_placebo),
    "P2": ("permuted", control_permuted_prior),
}


PAPER = {
    "C1": "Moonlight-16B-A3B in-domain (%): "
    + ", ".join(f"{k} {v}" for k, v in PAPER_TABLE1.items())
}


def judge_claims(
    results: Path, spec: dict[str, Any], audit: Audit | None = None
) -> dict[str, list[Part]]:
    """Every claim's judged parts, then every configured control's (`claims.placebo`,
    `claims.permuted`; null or absent: not run)."""
    audit = audit or Audit(Path(results), spec)
    judged = {claim: judge(audit) for claim, judge in CLAIMS.items()}
    for claim, (key, judge) in CONTROLS.items():
        if spec.get(key):
            judged[claim] = judge(audit)
    return judged


def table_verdicts(
    results: Path, spec: dict[str, Any], claims: Sequence[str] = ("C1", "C2")
) -> list[str]:
    """`claims` judged from one table's runs alone, as lines for that table's caption: each
    claim's verdict, each part's verdict with its estimate and interval on the judged measure,
    then every check the parts depended on with its outcome. A check whose runs the table lacks
    (M2 needs the readings runs) is undetermined, so the parts it guards read "not testable"
    unless a premise (M0) already decides them; `results/claims.md` of `all` judges them all."""
    audit = Audit(Path(results), spec, partial=True)
    digits = 1
    lines = [f"Verdicts ({_measure_name(audit.measure)}, docs/claims.md):"]
    for claim in claims:
        parts = CLAIMS[claim](audit)
        shown = "; ".join(
            f"{p.name}: {p.verdict} ({p.estimate:+.{digits}f} pp "
            f"[{_fmt(p.low, digits)}, {_fmt(p.high, digits)}], MDE {_fmt(p.mde, digits)})"
            for p in parts
        )
        lines.append(f"{claim} {combine([p.verdict for p in parts])}: {shown}.")
    lines.append("Checks: " + "; ".join(c.text() for c in audit.checks) + ".")
    return lines


def _measure_name(measure: str) -> str:
    return "judged on p(target)" if measure == P_TARGET else "judged on exact match"


PART_COLUMNS = [
    "claim",
    "part",
    "kind",
    "statement",
    "claim_verdict",
    "verdict",
    "verdict_detail",
    "verdict_checks_waived",
    "name",
    "rule",
    "metric",
    "estimate",
    "ci_low",
    "ci_high",
    "margin",
    "mde",
    "em_estimate",
    "em_low",
    "em_high",
    "em_mde",
    "seeds_needed",
    "n_runs",
    "checks",
    "evidence",
    "paper",
    "measured_by",
]


def claims_frame(parts: dict[str, list[Part]]) -> pd.DataFrame:
    """One row per part: its claim (statement, the claim's combined verdict, confirmatory or
    exploratory), the part's verdict (and its reason), the measure it is judged on (`metric`),
    estimate, interval, margin, MDE, exact match's estimate, interval and MDE of the same
    comparison (`em_*`), the seeds an MDE under the margin needs, the checks it depended on with
    their outcomes, its evidence, the paper's numbers where public, the table."""
    rows = []
    for claim, judged in parts.items():
        verdict = combine([p.verdict for p in judged])
        for i, p in enumerate(judged, start=1):
            rows.append(
                {
                    "claim": claim,
                    "part": f"{claim}.{i}",
                    "kind": KINDS[claim],
                    "statement": STATEMENTS[claim],
                    "claim_verdict": verdict,
                    "verdict": p.verdict,
                    "verdict_detail": p.detail,
                    "verdict_checks_waived": p.waived,
                    "name": p.name,
                    "rule": p.rule,
                    "metric": p.metric,
                    "estimate": p.estimate,
                    "ci_low": p.low,
                    "ci_high": p.high,
                    "margin": p.margin,
                    "mde": p.mde,
                    "em_estimate": p.em_estimate,
                    "em_low": p.em_low,
                    "em_high": p.em_high,
                    "em_mde": p.em_mde,
                    "seeds_needed": p.seeds_needed,
                    "n_runs": p.n_runs,
                    "checks": " | ".join(c.text() for c in p.checks),
                    "evidence": p.evidence,
                    "paper": PAPER.get(claim, ""),
                    "measured_by": MEASURED_BY[claim],
                }
            )
    return pd.DataFrame(rows, columns=PART_COLUMNS)


def _count_line(parts: dict[str, list[Part]], kind: str) -> str:
    judged = [p for c, ps in parts.items() if KINDS[c] == kind for p in ps]
    untestable = sum(p.verdict == NOT_TESTABLE for p in judged)
    unmet = sum(p.verdict == PREMISE_NOT_MET for p in judged)
    return (
        f"{len(judged)} {kind} parts: {len(judged) - untestable - unmet} tested on an interval, "
        f"{unmet} premise not met, {untestable} not testable"
    )


def _measure_line(measure: str) -> str:
    """claims.md's statement of the measure accuracy parts are judged on."""
    if measure == EXACT_MATCH:
        return (
            "Accuracy parts are judged on exact match (the standard tasks' own metric); "
            "`metric` and `em_*` in claims.csv say so."
        )
    return (
        'Accuracy parts are judged on p(target) in percent (docs/claims.md, "The primary metric '
        'at tiny scale"); "supported" also needs exact match\'s estimate of the same difference '
        "to agree (same sign; above the threshold; inside the equivalence margin), otherwise "
        '"inconclusive (exact match disagrees: estimate x)". Each part\'s evidence gives exact '
        "match beside p(target) (claims.csv: `em_estimate`, `em_low`, `em_high`, `em_mde`)."
    )


def build_claims(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Write claims.csv (one row per part) and claims.md (checks first, then one section per
    claim and control, each part labelled confirmatory or exploratory)."""
    audit = Audit(Path(results), spec)
    parts = judge_claims(results, spec, audit)
    table = claims_frame(parts)
    per_base = per_base_frames(results, spec)
    for k, frame in per_base.items():
        for column in ("verdict", "verdict_checks_waived"):
            verdicts = dict(zip(frame["part"], frame[column], strict=True))
            table[f"{column}_base{k}"] = table["part"].map(verdicts).fillna("")
    out_csv = Path(out_csv)
    with atomic_path(out_csv) as tmp:
        table.to_csv(tmp, index=False)
    # The audit's caption, in claims.md and on its report pages (rpb.report_html).
    title = f"Claims audit ({spec.get('scale')} scale)"
    summary = [
        "Verdict rules: docs/claims.md. Each part is judged on one interval: the "
        f"{describe_interval(audit.confidence, '(base, seed) runs')} of a paired per-run "
        "difference, or for an association the "
        f"{describe_interval(audit.confidence, 'the per-seed rhos')}; minimum detectable "
        f"effects at {100 * audit.power:g}% power; margin ±{audit.margin:g} pp, NMI margin "
        f"{audit.nmi_margin:g}, rho margin {audit.rho_margin:g}.",
        _measure_line(audit.measure),
        f"Tested: {_count_line(parts, CONFIRMATORY)}; {_count_line(parts, EXPLORATORY)}.",
    ]
    lines = [
        f"# {title}",
        "",
        summary[0],
        "",
        summary[1],
        "",
        summary[2],
        "",
        "## Manipulation checks (judged before any accuracy verdict)",
        "",
    ]
    lines += [f"- {c.text()}" for c in audit.checks] or ["- (none)"]
    lines.append("")
    by_claim = table.groupby("claim", sort=False)["claim_verdict"].first()
    for claim, judged in parts.items():
        lines += [f"## {claim}: {by_claim[claim]}", "", f"{STATEMENTS[claim]}.", ""]
        for i, p in enumerate(judged, start=1):
            depends = ", ".join(f"{c.id} {'passed' if c.passed else 'FAILED'}" for c in p.checks)
            lines.append(
                f"- {claim}.{i} [{KINDS[claim]}] **{p.detail}**: {p.evidence}"
                + (f" (checks: {depends})" if depends else "")
            )
        if claim in PAPER:
            lines += [f"- paper: {PAPER[claim]}"]
        if claim == "P1":
            false_positive = any(p.verdict == SUPPORTED for p in judged)
            lines += [
                "- empirical false-positive check: "
                + (
                    "FALSE POSITIVE: the placebo was judged different from none"
                    if false_positive
                    else "no false positive"
                )
            ]
        lines.append("")
    if per_base:
        lines += [
            "## Per-base verdicts",
            "",
            "The same audit on each base's runs alone (base 0: the model as configured; base k: "
            "its k-th replicate, `models.<name>.replicates`). A part whose verdict differs "
            'between bases depends on the base. The columns "checks waived" give what each '
            "part's rule says of that base's numbers were every check passed (not a verdict: "
            "docs/claims.md).",
            "",
            "| part | pooled | "
            + " | ".join(f"base {k}" for k in per_base)
            + " | "
            + " | ".join(f"checks waived: base {k}" for k in per_base)
            + " |",
            "|---|---|" + "---|" * (2 * len(per_base)),
        ]
        for _, row in table.iterrows():
            cells = [str(row[f"verdict_base{k}"]) for k in per_base]
            waived = [str(row[f"verdict_checks_waived_base{k}"]) for k in per_base]
            flag = " (depends on the base)" if len(set(cells)) > 1 else ""
            lines.append(
                f"| {row['part']}{flag} | {row['verdict']} | " + " | ".join(cells + waived) + " |"
            )
        lines.append("")
    write_text(out_csv.with_suffix(".md"), "\n".join(lines))
    write_claims_html(out_csv, table, audit.checks, title, summary)
    return table


def _restrict_runs(node: Any, k: int) -> Any:
    """`node` (a spec) with every `seeds` / `controls_seeds` list cut to base k's runs."""
    if isinstance(node, dict):
        return {
            key: (
                [s for s in value if base_index(s) == k]
                if key in ("seeds", "controls_seeds") and isinstance(value, list)
                else _restrict_runs(value, k)
            )
            for key, value in node.items()
        }
    return node


def per_base_frames(results: Path, spec: dict[str, Any]) -> dict[int, pd.DataFrame]:
    """The audit of each base's runs alone, {base index: its claims frame}; empty when the runs
    come from one base."""
    indices = sorted({base_index(s) for s in spec["table1"]["seeds"]})
    if len(indices) < 2:
        return {}
    out = {}
    for k in indices:
        sub = _restrict_runs(spec, k)
        out[k] = claims_frame(judge_claims(results, sub, Audit(Path(results), sub)))
    return out


def compare_claims(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two audits of the same design (two machines, say), part by part: both verdicts, both
    verdicts with the checks waived, both estimates and their shift in units of the larger MDE
    (a shift well under 1 MDE is one the design could not have told from noise)."""
    parts_a, parts_b = list(a["part"]), list(b["part"])
    if parts_a != parts_b:
        only = sorted(set(parts_a) ^ set(parts_b)) or ["(same parts, another order)"]
        raise ValueError(f"the two claims tables have different parts: {', '.join(only)}")
    out = pd.DataFrame({"part": a["part"], "name": a["name"], "rule": a["rule"]})
    for column in ("verdict", "verdict_checks_waived", "estimate", "mde"):
        out[f"{column}_a"], out[f"{column}_b"] = a[column].to_numpy(), b[column].to_numpy()
    out["same_verdict"] = out["verdict_a"] == out["verdict_b"]
    out["same_verdict_checks_waived"] = (
        out["verdict_checks_waived_a"] == out["verdict_checks_waived_b"]
    )
    out["shift"] = out["estimate_b"] - out["estimate_a"]
    out["shift_in_mde"] = out["shift"].abs() / out[["mde_a", "mde_b"]].max(axis=1)
    return out
