"""The testbed-v3 premise screen (the project's docs/testbed.md, "Testbed v3", committed before
its first run): on the fixed bases, choose a learning rate per base so that `none` learns to the
same level, then judge the v2 gates L, F, D, R there on 5 seeds.

Needs the pipeline's fixed bases and corpora (from the project root):

    snakemake --cores all results/models/{tinyA,tinyB}/base{0,1}/model results/data/manifest.json

then

    .venv/bin/python experiments/premise_screen/screen_v3.py   # both families, 2 workers

Runs are cached under experiments/premise_screen/work_v3/ (git-ignored) and the walk resumes where
it stopped; the records and verdicts go to experiments/premise_screen/results/screen_v3.{json,md}.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import screen
from screen import OOD, Gates, Point, base_record, judge, pooled_r, run_record, seed_count

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS, LEVEL = 1600, 1
RATES = (1 / 10, 1 / 8, 1 / 6.5, 1 / 5, 1 / 4, 1 / 3)  # of the pretraining peak, lowest first
CALIBRATION_SEEDS = (510, 511, 512)
GATE_SEEDS = (510, 511, 512, 513, 514)
# The walk's rule: stop at the first rate with L >= L_STOP and F <= F_STOP; the base fails if a
# rate overshoots (L > L_OVER or F < F_UNDER) first.
L_STOP, F_STOP = 0.60, 0.95
L_OVER, F_UNDER = screen.L_RANGE[1], screen.F_RANGE[0]
MAX_RUNS_PER_FAMILY = 40

log = logging.getLogger("premise_screen_v3")


def learning_and_retention(
    runs: Sequence[dict[str, Any]], base: dict[str, Any]
) -> tuple[float, float]:
    """L (mean dev p(target)) and F (mean OOD p(target) retention against the base), as v2."""
    learnt = float(np.mean([r["dev_p"] for r in runs]))
    kept = float(np.mean([np.mean([r["ood_p"][t] / base["ood_p"][t] for t in OOD]) for r in runs]))
    return learnt, kept


def calibration_step(learnt: float, kept: float) -> str:
    """What one rate's calibration runs decide: "chosen", "overshoot" (the base fails) or
    "continue" to the next rate."""
    if learnt > L_OVER or kept < F_UNDER:
        return "overshoot"
    if learnt >= L_STOP and kept <= F_STOP:
        return "chosen"
    return "continue"


def points() -> list[Point]:
    return [Point(STEPS, LEVEL, f) for f in RATES]


@dataclass
class BaseWalk:
    """One base's walk over the rates, then its gates at the chosen rate."""

    model: str
    history: list[dict[str, Any]] = field(default_factory=list)
    chosen: Point | None = None
    gates: Gates | None = None
    outcome: str = "not run"
    seen: set[tuple[str, int]] = field(default_factory=set)
    error: BaseException | None = None

    @property
    def runs(self) -> int:
        return len(self.seen)

    def run_catching(self, results: Path, work: Path, pool: ProcessPoolExecutor) -> None:
        """`run` in a thread: a failure is kept and raised by the main thread."""
        try:
            self.run(results, work, pool)
        except BaseException as err:
            self.error = err

    def run(self, results: Path, work: Path, pool: ProcessPoolExecutor) -> None:
        base = pool.submit(base_record, results, work, self.model, LEVEL).result()
        for point in points():
            records = self._records(results, work, pool, point, CALIBRATION_SEEDS)
            learnt, kept = learning_and_retention(records, base)
            step = calibration_step(learnt, kept)
            self.history.append(
                {"point": asdict(point), "n": len(records), "L": learnt, "F": kept, "step": step}
            )
            log.info("%s %s: L %.3f F %.3f -> %s", self.model, point.label, learnt, kept, step)
            if step == "overshoot":
                self.outcome = f"fails: overshoots at {point.label} (L {learnt:.3f}, F {kept:.3f})"
                return
            if step == "chosen":
                self.chosen = point
                break
        if self.chosen is None:
            self.outcome = "fails: no rate reaches L >= 0.60 with F <= 0.95"
            return
        records = self._records(results, work, pool, self.chosen, GATE_SEEDS)
        self.gates = judge(records, base)
        self.outcome = "passes" if self.gates.passes else "fails the gates"
        log.info("%s at %s: %s %s", self.model, self.chosen.label, self.outcome, self.gates)

    def _records(self, results, work, pool, point, seeds) -> list[dict[str, Any]]:
        futures = [pool.submit(run_record, results, work, self.model, point, s) for s in seeds]
        self.seen.update((point.label, s) for s in seeds)
        return [f.result() for f in futures]


def family_record(
    family: str, walks: Sequence[BaseWalk], results: Path, work: Path
) -> dict[str, Any]:
    """A family's outcome, and for a passing family the seed count and headroom (v2's formula on
    the 5 gate runs of each base at its own rate)."""
    runs = sum(w.runs for w in walks)
    if runs > MAX_RUNS_PER_FAMILY:
        raise SystemExit(f"family {family}: {runs} runs, over the rule's {MAX_RUNS_PER_FAMILY}")
    record: dict[str, Any] = {
        "bases": {
            w.model: {
                "history": w.history,
                "chosen": None if w.chosen is None else asdict(w.chosen),
                "gates": None if w.gates is None else asdict(w.gates),
                "outcome": w.outcome,
                "runs": w.runs,
            }
            for w in walks
        },
        "runs": runs,
        "outcome": "passes" if all(w.outcome == "passes" for w in walks) else "premise not met",
    }
    if record["outcome"] == "passes":
        by_base = [
            [run_record(results, work, w.model, w.chosen, s) for s in GATE_SEEDS] for w in walks
        ]
        bases = [base_record(results, work, w.model, LEVEL) for w in walks]
        share, loss = pooled_r(by_base, bases)
        record["seed_count"] = {"r_share_pooled": share, "ood_loss_points": loss}
        record["seed_count"] |= seed_count(by_base, loss, share)
    return record


def markdown(record: dict[str, Any]) -> str:
    lines = ['# Premise screen, testbed v3 (docs/testbed.md, "Testbed v3")', ""]
    lines.append(
        f"Walk: {STEPS} steps, level {LEVEL}; rates (of the pretraining peak) lowest first on "
        f"seeds {', '.join(map(str, CALIBRATION_SEEDS))}; stop at L >= {L_STOP} and F <= "
        f"{F_STOP}; a base fails on L > {L_OVER} or F < {F_UNDER} first. Gates at the chosen "
        f"rate on seeds {', '.join(map(str, GATE_SEEDS))}: v2's L, F, D, R."
    )
    for family, fam in record["families"].items():
        lines += ["", f"## Family {family}: {fam['outcome']} ({fam['runs']} runs)", ""]
        lines.append("| base | rate | n | L | F | step |")
        lines.append("|---|---|---|---|---|---|")
        for model, b in fam["bases"].items():
            for h in b["history"]:
                label = Point(**h["point"]).label
                lines.append(
                    f"| {model} | {label} | {h['n']} | {h['L']:.3f} | {h['F']:.3f} | {h['step']} |"
                )
        lines += ["", "| base | rate | n | L | F | D | R share | undone low (pp) | outcome |"]
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for model, b in fam["bases"].items():
            g = b["gates"]
            if g is None:
                lines.append(f"| {model} | | | | | | | | {b['outcome']} |")
                continue
            mark = lambda ok: "" if ok else " ✗"  # noqa: E731
            lines.append(
                f"| {model} | {Point(**b['chosen']).label} | {g['n']} "
                f"| {g['dev_p']:.3f}{mark(g['l_ok'])} | {g['retention']:.3f}{mark(g['f_ok'])} "
                f"| {g['overlap']:.3f}{mark(g['d_ok'])} | {g['r_share']:.3f}{mark(g['r_ok'])} "
                f"| {100 * g['r_undone_low']:.2f} | {b['outcome']} |"
            )
        if "seed_count" in fam:
            sc = fam["seed_count"]
            lines += [
                "",
                f"Seed count: {sc['seeds_per_base']} seeds per base; sd in-domain "
                f"{sc['sd_in_domain']:.2f}, OOD {sc['sd_ood']:.2f} points; MDE in-domain "
                f"{sc['in_domain_mde']:.2f}, OOD {sc['ood_mde']:.2f}; headroom "
                f"{sc['headroom_points']:.2f} points (R share {sc['r_share_pooled']:.3f} x OOD "
                f"loss {sc['ood_loss_points']:.2f}).",
            ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    args = screen.parse_arguments(argv, __doc__, HERE / "work_v3")
    screen.prepare_data(args.results, args.work, levels=(LEVEL,))
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    walks = {f: [BaseWalk(m) for m in screen.FAMILIES[f]] for f in families}
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        threads = [
            threading.Thread(
                target=w.run_catching, args=(args.results, args.work, pool), name=w.model
            )
            for ws in walks.values()
            for w in ws
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for ws in walks.values():
        for w in ws:
            if w.error is not None:
                raise SystemExit(f"{w.model}: the walk failed: {w.error!r}") from w.error
    record = {
        "rule": {
            "steps": STEPS,
            "level": LEVEL,
            "rates": RATES,
            "calibration_seeds": CALIBRATION_SEEDS,
            "gate_seeds": GATE_SEEDS,
            "stop": {"L_min": L_STOP, "F_max": F_STOP},
            "overshoot": {"L_max": L_OVER, "F_min": F_UNDER},
            "gates": {
                "L": screen.L_RANGE,
                "F": screen.F_RANGE,
                "D_max": screen.D_MAX,
                "R_min_share": screen.R_MIN_SHARE,
            },
        },
        "families": {f: family_record(f, ws, args.results, args.work) for f, ws in walks.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "screen_v3.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (args.out / "screen_v3.md").write_text(markdown(record))
    log.info("wrote %s", args.out / "screen_v3.md")


if __name__ == "__main__":
    main()
