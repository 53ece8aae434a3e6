"""The claims audit's evidence: checks (the premise M0 and the manipulation checks M1-M6, each
testing that a method did what it claims before its accuracy is read) and parts (one interval
judged by a rule of rpb.report.verdicts, with both accuracy measures' estimates), read from one
run's outputs through `rpb.report.run_records` and the tables' frames (`Audit`).

Accuracy is judged on one measure (`rpb.report.tables.primary_measure`): at tiny scale p(target),
with exact match's estimate of the same difference required to agree for "supported"; at paper scale
exact match alone (docs/claims.md, "The primary metric at tiny scale"). A part on a family whose
premise was not met reads "premise not met"; a part whose check fails is "not testable", naming
the check and its value.
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

from rpb.report.exploratory import ANCHOR_METRICS
from rpb.report.run_records import analysis_mean
from rpb.report.stats import (
    DEFAULT_POWER,
    Difference,
    mde,
    paired_runs,
    seeds_needed,
)
from rpb.report.table5 import hard_labels
from rpb.report.tables import (
    EXACT_MATCH,
    MEASURE_NAMES,
    P_TARGET,
    Comparison,
    TableContext,
    primary_measure,
)
from rpb.report.verdicts import (
    BELOW_MARGIN,
    INCONCLUSIVE,
    NOT_TESTABLE,
    PREMISE_CHECK,
    PREMISE_NOT_MET,
    SUPPORTED,
    direction_verdict,
    equivalence_verdict,
    exceeds_verdict,
    underpowered,
)
from rpb.specs import Run, analysis_path, spec_runs

NONE = "none"  # the unanchored plain fine-tuning every check compares against
UNDETERMINED = "undetermined"  # how a check's value starts when its runs could not judge it


# --- checks and parts ---------------------------------------------------------------------------


def fmt(x: float, digits: int = 1) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.{digits}f}"


@dataclass(frozen=True)
class Check:
    """A manipulation check: a premise of some parts, judged before any accuracy verdict."""

    id: str
    premise: str
    passed: bool
    value: str
    # What a check that did not hold means, in words ("lbl did not flatten routing vs none
    # (tinyA)"); empty: "not <premise>".
    negation: str = ""

    def text(self) -> str:
        """The check with its numbers, as captions and claims.csv state it."""
        return f"{self.id} {self.outcome()} ({self.value})"

    @property
    def undetermined(self) -> bool:
        """Not judged: the runs it needs are missing, or a number it reads is."""
        return not self.passed and self.value.startswith(UNDETERMINED)

    @property
    def state(self) -> str:
        """ "met", "not met" or "undetermined": the check's outcome in a word a reader takes as
        a premise's, never as a pipeline failure."""
        if self.passed:
            return "met"
        return "undetermined" if self.undetermined else "not met"

    def outcome(self) -> str:
        """The check as a reader takes it: "met: <premise>", "not met: <what that means>" (the
        premise itself where no `negation` is given) or "undetermined: <premise>" (`value` says
        why, or with what numbers)."""
        said = self.negation if self.state == "not met" and self.negation else self.premise
        return f"{self.state}: {said}"


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
        return "underpowered: one run per arm, no spread estimate; needs at least 2 runs"
    # A run is a (base, seed): what the formula counts is runs per method.
    runs = f"more than {needed - 1} runs" if needed > 1000 else f"{needed} runs"
    return f"underpowered: MDE {fmt(mde, 1 if unit == 'pp' else 3)} {unit}, needs {runs}"


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
    if verdict == BELOW_MARGIN:
        where_high = (
            "inside (0, margin): smaller than the margin"
            if diff.high < margin
            else ("reaching the margin: its size is not resolved")
        )
        note = f"above 0, not above the margin {margin:g}; interval {where_high}"
    if verdict in (SUPPORTED, BELOW_MARGIN) and metric == P_TARGET:
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
    return checked(Part(verdict, evidence, note=note, **common))


def checked(part: Part) -> Part:
    """`part` made "premise not met" if the testbed's premise (M0) failed, else not testable if
    one of its checks failed, its rule's verdict kept aside."""
    failed = [c for c in part.checks if not c.passed]
    if not failed:
        return part
    note = "; ".join(f"{c.id} {c.outcome()}, {c.value}" for c in failed)
    premise = any(c.id == PREMISE_CHECK for c in failed)
    verdict = PREMISE_NOT_MET if premise else NOT_TESTABLE
    return replace(part, verdict=verdict, note=note, checks_waived=part.verdict)


def diff_text(where: str, a: float, b: float, diff: Difference, unit: str = "pp") -> str:
    digits = 1 if unit == "pp" else 3
    return (
        f"{where}: {fmt(a, digits)} vs {fmt(b, digits)}, diff {diff.estimate:+.{digits}f} "
        f"{unit} [{fmt(diff.low, digits)}, {fmt(diff.high, digits)}], MDE "
        f"{fmt(diff.mde, digits)}, p={fmt(diff.p_value, 3)} ({diff.n_seeds} runs"
        + (f" x {diff.n_items} items)" if diff.n_items else ")")
    )


def measures_text(
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
        return f", equivalence MDE {fmt(diff.mde_equivalence)}" if equivalence else ""

    text = diff_text(f"{where} ({MEASURE_NAMES[measure]})", *scores)
    text += eq_mde(scores[2]) + extra
    if measure != EXACT_MATCH and em is not None:
        a, b, diff = em
        text += (
            f"; exact match: {fmt(a)} vs {fmt(b)}, diff {diff.estimate:+.1f} pp "
            f"[{fmt(diff.low)}, {fmt(diff.high)}], MDE {fmt(diff.mde)}" + eq_mde(diff)
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
        # OOD parts' margin (testbed v3: the screen's headroom; null: the in-domain margin), and
        # the paired sd per measure that the design assumed before any method ran (null: none).
        ood_margin = spec.get("ood_margin")
        self.ood_margin = self.margin if ood_margin is None else float(ood_margin)
        self.design_sd = {k: float(v) for k, v in (spec.get("design_sd") or {}).items()}
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

    def design_mde(self, metric: str, n_runs: int) -> float | None:
        """The MDE the design predicted for a `metric` part over `n_runs` planned runs per method
        (`claims.design_sd`; None where the config states no design sd or n_runs < 2)."""
        sd = self.design_sd.get(metric)
        if sd is None or n_runs < 2:
            return None
        return mde(sd, n_runs, **self.level)

    def compare(
        self,
        spec: dict[str, Any],
        model: str,
        corpora: Sequence[str],
        method: str,
        other: str,
        metric: str,
        runs: Sequence[Run],
    ) -> tuple[Comparison, Comparison | None]:
        """`rpb.report.tables.TableContext.compare` on the judged measure, and on exact match
        beside it (None where exact match is the judged measure)."""
        context = TableContext(self.results, spec, model)
        args = (corpora, method, other, metric, runs)
        judged = context.compare(*args, measure=self.measure)
        return judged, (None if self.measure == EXACT_MATCH else context.compare(*args))

    def _cached(self, key: tuple, compute: Callable[[], Check]) -> Check:
        if key not in self._checks:
            self._checks[key] = compute()
        return self._checks[key]

    @property
    def checks(self) -> list[Check]:
        return list(self._checks.values())

    def _metric(self, model: str, corpus: str, label: str, runs: Sequence[Run], key: str):
        return np.array(
            [analysis_mean(self.results, model, corpus, label, r).get(key, math.nan) for r in runs]
        )

    def _paired_metric(
        self, model: str, corpus: str, label: str, runs: Sequence[Run], key: str
    ) -> Difference | None:
        a = self._metric(model, corpus, label, runs, key)
        b = self._metric(model, corpus, NONE, runs, key)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            return None
        return paired_runs(a, b, **self.level)

    # M1 -------------------------------------------------------------------------------------
    def flattening_site(self, model: str) -> tuple[str, Sequence[Run]] | None:
        """The corpus and runs where `model` has both `none` and reference runs (tables 1, 2)."""
        t1, t2 = self.spec["table1"], self.spec.get("table2", {})
        for table in (t1, t2):
            if table.get("model") == model and {NONE, self.reference} <= set(table["methods"]):
                return table["corpus"], spec_runs(table)
        return None

    def reference_flattens(self, model: str) -> Check:
        def compute() -> Check:
            premise = f"{self.reference} flattens routing vs none ({model})"
            site = self.flattening_site(model)
            if site is None:
                return Check("M1", premise, False, f"undetermined: no none/{self.reference} runs")
            corpus, runs = site
            ent = self._paired_metric(model, corpus, self.reference, runs, "usage_entropy")
            mod = self._paired_metric(model, corpus, self.reference, runs, "modularity")
            if ent is None or mod is None:
                return Check("M1", premise, False, "undetermined: entropy or modularity missing")
            passed = bool(ent.low > 0 or mod.high < 0)
            negation = f"{self.reference} did not flatten routing vs none ({model})"
            value = (
                f"{model}/{corpus} {self.reference} - none usage entropy {ent.estimate:+.4f} "
                f"[{fmt(ent.low, 4)}, {fmt(ent.high, 4)}], modularity {mod.estimate:+.4f} "
                f"[{fmt(mod.low, 4)}, {fmt(mod.high, 4)}] over {ent.n_seeds} runs"
            )
            return Check("M1", premise, passed, value, negation)

        return self._cached(("M1", model), compute)

    # M2 -------------------------------------------------------------------------------------
    def method_anchors(self) -> Check:
        def compute() -> Check:
            t5 = self.spec["table5"]
            r = self.spec.get("readings") or {}
            model, corpus = r.get("model", t5["model"]), r.get("corpus", t5["corpus"])
            lower, upper = r.get("lower", NONE), r.get("upper", "hard")
            min_gain = float(r.get("min_gain", 0.25))
            runs = spec_runs(r if "runs" in r else t5)
            premise = (
                f"the configured {self.method} reading anchors (readings rule, {model}/{corpus})"
            )
            labels = (lower, self.method, upper)
            missing = [
                (label, run)
                for label in labels
                for run in runs
                if not analysis_path(self.results, model, corpus, label, run).is_file()
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
                    m: float(np.mean(self._metric(model, corpus, label, runs, m)))
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
                    f"{m} position {fmt(pos, 3)}"
                    if math.isfinite(pos)
                    else f"{m} position undefined ({upper} does not exceed {lower})"
                )
            passed = all(math.isfinite(p) and p >= min_gain for p in positions)
            value = ", ".join(texts) + f" (needs >= {min_gain:g})"
            negation = (
                f"the configured {self.method} reading does not anchor (readings rule, "
                f"{model}/{corpus})"
            )
            return Check("M2", premise, passed, value, negation)

        return self._cached(("M2",), compute)

    # M3 -------------------------------------------------------------------------------------
    def hard_routes_as_base(self) -> Check:
        def compute() -> Check:
            t5 = self.spec["table5"]
            hard = hard_labels(t5)
            premise = "hard routes exactly as the base at evaluation"
            if not hard:
                return Check(
                    "M3",
                    premise,
                    False,
                    "no hard-routing method in table 5",
                    "table 5 has no hard-routing method to check",
                )
            texts, passed = [], True
            for h in hard:
                overlap = self._metric(
                    t5["model"], t5["corpus"], h, spec_runs(t5), "topk_overlap_with_base"
                )
                ok = bool(np.isfinite(overlap).all() and (overlap >= 1 - 1e-6).all())
                passed &= ok
                texts.append(
                    f"{h} top-k overlap with the base per seed {np.round(overlap, 6).tolist()}"
                )
            negation = "hard does not route exactly as the base at evaluation"
            return Check("M3", premise, passed, "; ".join(texts), negation)

        return self._cached(("M3",), compute)

    # M4 -------------------------------------------------------------------------------------
    def anchor_reduces_drift(self, anchor: str) -> Check:
        def compute() -> Check:
            t5 = self.spec["table5"]
            premise = f"{anchor} reduces router drift vs none"
            diff = self._paired_metric(
                t5["model"], t5["corpus"], anchor, spec_runs(t5), "kl_to_base"
            )
            if diff is None:
                return Check("M4", premise, False, "undetermined: KL to the base missing")
            value = (
                f"{t5['model']}/{t5['corpus']} {anchor} - none KL to the base router "
                f"{diff.estimate:+.4f} [{fmt(diff.low, 4)}, {fmt(diff.high, 4)}] over "
                f"{diff.n_seeds} runs"
            )
            negation = f"{anchor} did not reduce router drift vs none"
            return Check("M4", premise, bool(diff.high < 0), value, negation)

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
                    PREMISE_CHECK,
                    f"the testbed's premise holds for {model}",
                    False,
                    reason,
                    f"the testbed's premise does not hold for {model}",
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
                f"{label} in-domain {fmt(score)}% ({MEASURE_NAMES[self.measure]}), an effect of "
                f"{self.margin:g} pp needs <= {ceiling:g}%",
                f"no headroom above {label} ({where})",
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
                f"modularity {fmt(base.modularity, 3)} vs uniform routing "
                f"{fmt(base.uniform_modularity, 3)}"
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
                    f"the base {model} router's community structure is not shown stable "
                    f"(no {path.name} entry)",
                )
            halves = [float(r["split_half_nmi"]) for r in structure["layers"]]
            halves = [h for h in halves if math.isfinite(h)]
            split = float(np.mean(halves)) if halves else math.nan
            uniform = float(structure["uniform"]["split_half_nmi"])
            uniform = 0.0 if math.isnan(uniform) else uniform  # no structure at chance at all
            stable = math.isfinite(split) and split >= min_split and split > uniform
            value = (
                f"{head}; split-half NMI {fmt(split, 3)} vs uniform routing {fmt(uniform, 3)} "
                f"(needs >= {min_split:g})"
            )
            negation = f"the base {model} router has no stable community structure"
            return Check("M6", premise, bool(modular and stable), value, negation)

        return self._cached(("M6",), compute)
