"""Claims audit: does this run support each of the paper's claims C1-C6?

Each claim is split into parts; each part is one interval (a bootstrap CI of a paired difference
or of a rank correlation) judged by a rule fixed before any result was seen (docs/claims.md):

- `direction` ("X beats Y"): supported when the CI of X - Y lies above 0; not supported when it
  lies below 0, or when it lies inside (-margin, +margin) (no effect of a size worth claiming);
  otherwise inconclusive.
- `equivalence` ("X and Y are comparable"): supported when the CI lies inside (-margin, +margin);
  not supported when it lies wholly outside it; otherwise inconclusive.
- `exceeds` ("X - Y is larger than t", e.g. a sharp fall, or non-inferiority with t = -margin):
  supported when the CI lies above t; not supported when it lies below t; otherwise inconclusive.

A claim is supported when every part is, not supported when any part is not, and inconclusive
otherwise. Only the paper's reported numbers (C1's three) are constants here; every measured
number is read from this run's outputs through `rpb.tables`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from rpb.tables import PAPER_TABLE1, compare, hard_labels, table4_frames, table5_frames

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
INCONCLUSIVE = "inconclusive"
VERDICTS = (SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE)

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
    "sharply",
}
MEASURED_BY = {
    "C1": "table1",
    "C2": "table1",
    "C3": "table2",
    "C4": "table3",
    "C5": "table4",
    "C6": "table5",
}


def _check_interval(low: float, high: float) -> bool:
    """False for an undefined interval (NaN), which every rule reads as inconclusive."""
    if math.isnan(low) or math.isnan(high):
        return False
    if low > high:
        raise ValueError(f"interval low {low} exceeds high {high}")
    return True


def direction_verdict(low: float, high: float, margin: float) -> str:
    """ "X beats Y" from the CI [low, high] of X - Y (see the module docstring)."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if not _check_interval(low, high):
        return INCONCLUSIVE
    if low > 0:
        return SUPPORTED
    if high < 0 or (-margin < low and high < margin):
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
    """A claim from its parts: any part not supported -> not supported; all supported ->
    supported; otherwise inconclusive."""
    if not verdicts:
        raise ValueError("a claim needs at least one part")
    unknown = [v for v in verdicts if v not in VERDICTS]
    if unknown:
        raise ValueError(f"unknown verdict {unknown[0]!r} (known: {', '.join(VERDICTS)})")
    if NOT_SUPPORTED in verdicts:
        return NOT_SUPPORTED
    if all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    return INCONCLUSIVE


@dataclass(frozen=True)
class Part:
    """One judged piece of evidence of a claim."""

    verdict: str
    evidence: str


def _fmt(x: float, digits: int = 1) -> str:
    return "nan" if math.isnan(x) else f"{x:.{digits}f}"


def _diff_text(name: str, a: float, b: float, diff: Any, unit: str = "pp") -> str:
    return (
        f"{name}: {_fmt(a)} vs {_fmt(b)}, diff {diff.estimate:+.1f} {unit} "
        f"[{_fmt(diff.low)}, {_fmt(diff.high)}], p={diff.p_value:.3g} "
        f"({diff.n_seeds} seeds x {diff.n_items} items)"
    )


def _direction_parts(
    results: Path,
    spec: dict[str, Any],
    table: dict[str, Any],
    corpora: Sequence[str],
    model: str,
    others: Sequence[str],
    metric: str,
) -> list[Part]:
    method, margin = spec["method"], float(spec["margin"])
    parts = []
    for other in others:
        a, b, diff = compare(results, spec, model, corpora, method, other, metric, table["seeds"])
        where = f"{model}/{'+'.join(corpora)} {metric} {method} - {other}"
        parts.append(
            Part(direction_verdict(diff.low, diff.high, margin), _diff_text(where, a, b, diff))
        )
    return parts


def _others(methods: Sequence[str], method: str) -> list[str]:
    if method not in methods:
        raise ValueError(f"claims.method {method!r} is not among the table's methods {methods}")
    return [m for m in methods if m != method]


def claim_c1(results: Path, spec: dict[str, Any]) -> list[Part]:
    """RPB - each other table-1 method, in-domain, on table 1's model and corpus."""
    t1 = spec["table1"]
    others = _others(t1["methods"], spec["method"])
    parts = _direction_parts(results, spec, t1, [t1["corpus"]], t1["model"], others, "in_domain")
    return parts


def claim_c2(results: Path, spec: dict[str, Any]) -> list[Part]:
    """RPB - each other table-1 method on the pooled OOD items."""
    t1 = spec["table1"]
    others = _others(t1["methods"], spec["method"])
    return _direction_parts(results, spec, t1, [t1["corpus"]], t1["model"], others, "ood")


def claim_c3(results: Path, spec: dict[str, Any]) -> list[Part]:
    """RPB - LBL in-domain on table 2's (family B) model."""
    t2 = spec["table2"]
    _others(t2["methods"], spec["method"])
    return _direction_parts(
        results, spec, t2, [t2["corpus"]], t2["model"], [spec["reference"]], "in_domain"
    )


def claim_c4(results: Path, spec: dict[str, Any]) -> list[Part]:
    """RPB - LBL in-domain on the independent corpus, every table-3 model."""
    t3 = spec["table3"]
    parts = []
    for model in t3["models"]:
        parts += _direction_parts(
            results, spec, t3, [t3["corpus"]], model, [spec["reference"]], "in_domain"
        )
    return parts


def claim_c5(results: Path, spec: dict[str, Any]) -> list[Part]:
    """Every pair of table-4 methods comparable in-domain; no consistent ordering (Friedman)."""
    t4 = {**spec["table4"], "ood": spec["ood"]}
    t4 |= {k: spec[k] for k in ("confidence", "n_resamples")}
    frames = table4_frames(results, t4)
    margin, alpha = float(spec["margin"]), 1.0 - float(spec["confidence"])
    parts = []
    for row in frames["pairs"][frames["pairs"]["metric"] == "in_domain"].itertuples():
        where = f"{t4['model']} in_domain {row.method} - {row.other} (corpora {t4['corpora']})"
        text = (
            f"{where}: {_fmt(row.method_score)} vs {_fmt(row.other_score)}, diff "
            f"{row.diff:+.1f} pp [{_fmt(row.diff_ci_low)}, {_fmt(row.diff_ci_high)}] "
            f"(margin ±{margin:g})"
        )
        parts.append(Part(equivalence_verdict(row.diff_ci_low, row.diff_ci_high, margin), text))
    check = frames["consistency"].set_index("metric").loc["in_domain"]
    n_methods = len(t4["methods"])
    text = (
        f"in-domain ranking over {check.n_blocks} (corpus, seed) blocks: Kendall's W "
        f"{_fmt(check.kendall_w, 2)}, Friedman p={_fmt(check.friedman_p, 3)}, identical ranking "
        f"in every block: {bool(check.identical_ranking)}, same best everywhere: "
        f"{check.same_best or 'no'}; mean-rank order {check.mean_rank_order}"
    )
    if n_methods < 3 or check.n_blocks < 2:
        verdict = INCONCLUSIVE  # the Friedman test needs >= 3 methods and >= 2 blocks
    elif math.isnan(check.friedman_p):
        verdict = SUPPORTED  # every block a full tie: no ordering at all
    else:
        verdict = NOT_SUPPORTED if check.friedman_p < alpha else SUPPORTED
    return [*parts, Part(verdict, text)]


def claim_c6(results: Path, spec: dict[str, Any]) -> list[Part]:
    """Base non-uniform (a condition); retention tracks in-domain and OOD accuracy across the
    soft runs (rho > 0; judged only where the base is non-uniform); hard keeps the structure (NMI
    not below RPB's by more than the NMI margin) and its in-domain accuracy falls below RPB's by
    more than the margin."""
    t5 = {**spec["table5"], "ood": spec["ood"]}
    t5 |= {k: spec[k] for k in ("confidence", "n_resamples")}
    frames = table5_frames(results, t5)
    margin, nmi_margin = float(spec["margin"]), float(spec["nmi_margin"])
    base = frames["base"].set_index("layer").loc["mean"]
    nonuniform = bool(base.modularity > base.uniform_modularity)
    condition = (
        f"base {t5['model']} router (probe set, layer mean): modularity {_fmt(base.modularity, 3)}"
        f" vs uniform routing {_fmt(base.uniform_modularity, 3)}, usage entropy "
        f"{_fmt(base.usage_entropy, 3)} vs {_fmt(base.uniform_usage_entropy, 3)}: "
        f"{'non-uniform' if nonuniform else 'NOT measurably non-uniform: the claim does not apply'}"
    )
    parts = [Part(SUPPORTED if nonuniform else INCONCLUSIVE, condition)]
    corr = frames["correlation"].set_index(["retention", "accuracy"])
    for accuracy in ("in_domain", "ood_mean"):
        row = corr.loc[("community_nmi", accuracy)]
        text = (
            f"Spearman(community_nmi, {accuracy}) over {row.n_runs} soft runs: rho "
            f"{_fmt(row.spearman_rho, 2)} [{_fmt(row.rho_ci_low, 2)}, {_fmt(row.rho_ci_high, 2)}]"
        )
        if nonuniform:
            parts.append(Part(exceeds_verdict(row.rho_ci_low, row.rho_ci_high, 0.0), text))
        else:  # the claim's "where the base router is non-uniform" does not hold
            parts.append(Part(INCONCLUSIVE, text + " (not applicable: uniform base)"))
    hard = hard_labels(t5)
    if not hard:
        parts.append(Part(INCONCLUSIVE, "no hard-routing method in table 5"))
    comparisons = frames["hard"]
    for h in hard:
        sel = comparisons[(comparisons["method"] == h) & (comparisons["other"] == spec["method"])]
        nmi = sel[sel["metric"] == "community_nmi"]
        if nmi.empty:
            parts.append(Part(INCONCLUSIVE, f"{h} - {spec['method']} community NMI undefined"))
        else:
            r = nmi.iloc[0]
            text = (
                f"{h} - {spec['method']} community NMI: {r['diff']:+.3f} "
                f"[{_fmt(r.diff_ci_low, 3)}, {_fmt(r.diff_ci_high, 3)}] over {r.n_seeds} seeds "
                f"(keeps the structure if above -{nmi_margin:g})"
            )
            parts.append(Part(exceeds_verdict(r.diff_ci_low, r.diff_ci_high, -nmi_margin), text))
        acc = sel[sel["metric"] == "in_domain"].iloc[0]
        text = (
            f"{spec['method']} - {h} in_domain: {_fmt(acc.other_score)} vs "
            f"{_fmt(acc.method_score)}, fall {-acc['diff']:+.1f} pp [{_fmt(-acc.diff_ci_high)}, "
            f"{_fmt(-acc.diff_ci_low)}] (sharp if above {margin:g})"
        )
        parts.append(Part(exceeds_verdict(-acc.diff_ci_high, -acc.diff_ci_low, margin), text))
    return parts


CLAIMS = {
    "C1": claim_c1,
    "C2": claim_c2,
    "C3": claim_c3,
    "C4": claim_c4,
    "C5": claim_c5,
    "C6": claim_c6,
}


PAPER = {
    "C1": "Moonlight-16B-A3B in-domain (%): "
    + ", ".join(f"{k} {v}" for k, v in PAPER_TABLE1.items())
}


def judge_claims(results: Path, spec: dict[str, Any]) -> dict[str, list[Part]]:
    """Every claim's judged parts."""
    return {claim: judge(Path(results), spec) for claim, judge in CLAIMS.items()}


def claims_frame(parts: dict[str, list[Part]]) -> pd.DataFrame:
    """One row per claim: statement, verdict, evidence (each part's numbers and its own verdict
    in brackets, parts separated by ' | '), the paper's numbers where public, the table."""
    return pd.DataFrame(
        [
            {
                "claim": claim,
                "statement": STATEMENTS[claim],
                "verdict": combine([p.verdict for p in judged]),
                "evidence": " | ".join(f"[{p.verdict}] {p.evidence}" for p in judged),
                "paper": PAPER.get(claim, ""),
                "measured_by": MEASURED_BY[claim],
            }
            for claim, judged in parts.items()
        ]
    )


def build_claims(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Write claims.csv and claims.md (one row / section per claim)."""
    parts = judge_claims(results, spec)
    table = claims_frame(parts)
    out_csv = Path(out_csv)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_csv, index=False)
    lines = [
        f"# Claims audit ({spec.get('scale')} scale)",
        "",
        "Verdict rules: docs/claims.md (margin "
        f"±{float(spec['margin']):g} pp, NMI margin {float(spec['nmi_margin']):g}, "
        f"{100 * float(spec['confidence']):g}% bootstrap intervals over seeds x items).",
        "",
    ]
    for row in table.itertuples():
        lines += [f"## {row.claim}: {row.verdict}", "", f"{row.statement}.", ""]
        lines += [f"- [{p.verdict}] {p.evidence}" for p in parts[row.claim]]
        if row.paper:
            lines += [f"- paper: {row.paper}"]
        lines.append("")
    out_csv.with_suffix(".md").write_text("\n".join(lines))
    return table
