"""The testbed-v2 premise screen (docs/records/premise_screen.md, "Testbed v2"): walk the grid of
learning rate x steps x difficulty level with `none` alone, post-training the MoE layers
(`trainable: moe`), and find per family the cheapest point where the paper's premise holds
(gates L, F, D, R).

Needs the pipeline's bases and corpora (from the project root):

    snakemake --cores all results/models/{tinyA,tinyB}/base{0,1}/model results/data/manifest.json

then

    .venv/bin/python experiments/premise_screen/screen.py   # both families, 2 workers

Every run is cached under experiments/premise_screen/work/ (git-ignored) and the walk resumes
where it stopped; the records and verdicts go to experiments/premise_screen/results/.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from rpb.report.stats import mde, seeds_needed, t_interval

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PEAK_LR = 3e-3  # the bases' pretraining peak (config/config.yaml models.*.pretrain.lr)
LR_FRACTIONS = (1 / 30, 1 / 10, 1 / 3)
STEPS = (400, 800, 1600)
LEVELS = (1, 2, 3, 4)
OOD = ("addition", "facts", "reverse", "sort", "grammar")
SEEDS_BASE0 = (500, 501, 502)
SEEDS_BASE1 = (500, 501, 502, 503, 504)
FAMILIES = {"A": ("tinyA", "tinyA_p1"), "B": ("tinyB", "tinyB_p1")}
PROBE_LIMIT = 200  # the analysis probe: the first 200 items of each OOD task
MARGIN = 5.0  # the claims' margin, points of p(target)
# The gates (docs/records/premise_screen.md): fixed before any run.
L_RANGE = (0.50, 0.95)
F_RANGE = (0.70, 0.95)
D_MAX = 0.90
R_MIN_SHARE = 0.10

log = logging.getLogger("premise_screen")


@dataclass(frozen=True, order=True)
class Point:
    """One grid point, in walk order: steps, then level, then learning rate."""

    steps: int
    level: int
    lr_fraction: float

    @property
    def lr(self) -> float:
        return PEAK_LR * self.lr_fraction

    @property
    def label(self) -> str:
        # "%.3g" keeps v2's labels (1of30, 1of10, 1of3) and spells v3's 1/6.5 as written.
        return f"S{self.steps}-L{self.level}-lr1of{1 / self.lr_fraction:.3g}"


def grid() -> list[Point]:
    return sorted(Point(s, lv, f) for s in STEPS for lv in LEVELS for f in LR_FRACTIONS)


# --- judging (pure: unit-tested in test_screen.py) ---------------------------------------------


@dataclass
class Gates:
    """A point's statistics on one base and which gates they pass."""

    n: int
    dev_p: float  # L
    retention: float  # F
    overlap: float  # D
    r_share: float  # R
    r_undone_low: float
    l_ok: bool
    f_ok: bool
    d_ok: bool
    r_ok: bool

    @property
    def passes(self) -> bool:
        return self.l_ok and self.f_ok and self.d_ok and self.r_ok


def judge(runs: Sequence[dict[str, Any]], base: dict[str, Any]) -> Gates:
    """The four gates on `none`'s runs of one point and base (`run_record` dicts) against the
    base's own scores (`base_record`)."""
    dev = np.array([r["dev_p"] for r in runs])
    retention = np.array([np.mean([r["ood_p"][t] / base["ood_p"][t] for t in OOD]) for r in runs])
    overlap = np.array([r["overlap"] for r in runs])
    ood_none = np.array([np.mean([r["ood_p"][t] for t in OOD]) for r in runs])
    ood_swap = np.array([np.mean([r["ood_p_base_routers"][t] for t in OOD]) for r in runs])
    ood_base = float(np.mean([base["ood_p"][t] for t in OOD]))
    undone = ood_swap - ood_none
    loss = ood_base - ood_none
    share = float(undone.mean() / loss.mean()) if loss.mean() > 0 else float("nan")
    _, low, _, _ = t_interval(undone)
    learnt, kept, same = float(dev.mean()), float(retention.mean()), float(overlap.mean())
    return Gates(
        n=len(runs),
        dev_p=learnt,
        retention=kept,
        overlap=same,
        r_share=share,
        r_undone_low=float(low),
        l_ok=L_RANGE[0] <= learnt <= L_RANGE[1],
        f_ok=F_RANGE[0] <= kept <= F_RANGE[1],
        d_ok=same <= D_MAX,
        r_ok=math.isfinite(share) and share >= R_MIN_SHARE and float(low) > 0,
    )


def ruled_out(point: Point, gates: Gates) -> dict[Point, str]:
    """Points a result at `point` rules out, by the monotonicity assumptions of the screen."""
    out: dict[Point, str] = {}
    why = None
    if gates.dev_p > L_RANGE[1]:
        why = f"L {gates.dev_p:.3f} > {L_RANGE[1]} at {point.label}"
    elif gates.retention < F_RANGE[0]:
        why = f"F {gates.retention:.3f} < {F_RANGE[0]} at {point.label}"
    if why:
        for p in grid():
            if (
                p != point
                and p.level == point.level
                and p.lr_fraction >= point.lr_fraction
                and p.steps >= point.steps
            ):
                out[p] = why
    if gates.dev_p < L_RANGE[0]:
        for p in grid():
            if p.level > point.level and (p.steps, p.lr_fraction) == (
                point.steps,
                point.lr_fraction,
            ):
                out.setdefault(p, f"L {gates.dev_p:.3f} < {L_RANGE[0]} at {point.label}")
    return out


def seed_count(
    runs_by_base: Sequence[Sequence[dict[str, Any]]], ood_loss_points: float, r_share: float
) -> dict[str, Any]:
    """Seeds per base from power (docs/records/premise_screen.md, "The seed count") and the
    headroom check."""

    def pooled_sd(values_by_base: list[np.ndarray]) -> float:
        num = sum(((v - v.mean()) ** 2).sum() for v in values_by_base)
        dof = sum(len(v) - 1 for v in values_by_base)
        return float(math.sqrt(num / dof)) if dof > 0 else float("nan")

    sd_in = pooled_sd([100 * np.array([r["dev_p"] for r in runs]) for runs in runs_by_base])
    sd_ood = pooled_sd(
        [
            100 * np.array([np.mean([r["ood_p"][t] for t in OOD]) for r in runs])
            for runs in runs_by_base
        ]
    )
    n_in = seeds_needed(math.sqrt(2) * sd_in, MARGIN)
    n_ood = seeds_needed(math.sqrt(2) * sd_ood, MARGIN)
    n_runs = max(n_in, n_ood)
    seeds_per_base = math.ceil(n_runs / len(runs_by_base))
    n_total = seeds_per_base * len(runs_by_base)
    ood_mde = mde(math.sqrt(2) * sd_ood, n_total)
    headroom = r_share * ood_loss_points
    return {
        "sd_in_domain": sd_in,
        "sd_ood": sd_ood,
        "runs_needed_in_domain": n_in,
        "runs_needed_ood": n_ood,
        "seeds_per_base": seeds_per_base,
        "in_domain_mde": mde(math.sqrt(2) * sd_in, n_total),
        "ood_mde": ood_mde,
        "headroom_points": headroom,
        "ood_underpowered_by_design": bool(headroom < ood_mde),
    }


# --- running (one process per run; the parent only schedules) -----------------------------------


def _paths(work: Path) -> dict[str, Path]:
    return {"data": work / "data", "runs": work / "runs", "base": work / "base"}


def prepare_data(results: Path, work: Path, levels: Sequence[int] = LEVELS) -> None:
    """Corpora at each of `levels` with the pipeline's data settings, and a per-level eval folder
    holding the level's dev split (as `math`) and the OOD eval sets."""
    import yaml

    from rpb.pipeline.data import preset_sizes, write_corpora

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    seed, preset = config["data"]["seed"], config["data"]["preset"]
    pipeline_pretrain = results / "data" / "pretrain.jsonl"
    for level in levels:
        out = _paths(work)["data"] / f"L{level}"
        if not (out / "manifest.json").is_file():
            write_corpora(out, seed=seed, sizes=preset_sizes(preset), level=level)
        if (out / "pretrain.jsonl").read_bytes() != pipeline_pretrain.read_bytes():
            raise SystemExit(
                f"{out}/pretrain.jsonl differs from {pipeline_pretrain}: the bases were "
                "pretrained on another corpus (rebuild results/ with the default config)"
            )
        screen = out / "screen_eval"
        screen.mkdir(exist_ok=True)
        shutil.copyfile(out / "dev" / "math.jsonl", screen / "math.jsonl")
        for task in OOD:
            shutil.copyfile(out / "eval" / f"{task}.jsonl", screen / f"{task}.jsonl")


def _p_target(result: dict[str, Any], task: str) -> float:
    return float(result["tasks"][f"rpb_{task}_ll"]["p_target_mean"])


def _em(result: dict[str, Any], task: str) -> float:
    return float(result["tasks"][f"rpb_{task}"]["score"])


def _scores(
    model_dir: Path, eval_dir: Path, out: Path, *, exact_match: bool = True
) -> dict[str, Any]:
    """p(target) (and, with `exact_match`, greedy exact match) on the level's dev split and the
    OOD sets, through lm-eval as the pipeline evaluates. Without exact match only the
    loglikelihood tasks run: generation is most of an evaluation's cost."""
    from rpb.pipeline.evaluation import (
        LL_SUFFIX,
        evaluate_model,
        run_lm_eval,
        save_results,
        write_tasks,
    )

    names = ["math", *OOD]
    if not out.is_file():
        if exact_match:
            evaluate_model(model_dir, eval_dir, names, out, out.parent / "lm_eval_work")
        else:
            task_dir = out.parent / "lm_eval_work" / "tasks"
            tasks = [t for t in write_tasks(eval_dir, task_dir, names) if t.endswith(LL_SUFFIX)]
            save_results(run_lm_eval(model_dir, task_dir, tasks), out)
    result = json.loads(out.read_text())
    scores = {"dev_p": _p_target(result, "math"), "ood_p": {t: _p_target(result, t) for t in OOD}}
    if exact_match:
        scores |= {"dev_em": _em(result, "math"), "ood_em": {t: _em(result, t) for t in OOD}}
    return scores


def base_dir_of(results: Path, model: str) -> Path:
    """The pipeline's folder of a base this screen names `tinyA` or `tinyA_p1` (pretraining seed
    1, the config's first replicate: `models/tinyA/base1`)."""
    family, _, seed = model.partition("_p")
    return results / "models" / family / f"base{1 if seed else 0}" / "model"


def base_record(results: Path, work: Path, model: str, level: int) -> dict[str, Any]:
    """The base's scores at a level (dev p(target) of the level's task, OOD p(target))."""
    out = _paths(work)["base"] / model / f"L{level}" / "eval.json"
    base = base_dir_of(results, model)
    return _scores(base, _paths(work)["data"] / f"L{level}" / "screen_eval", out)


def _overlap(model_dir: Path, base_dir: Path, eval_dir: Path) -> float:
    """Same-state top-k overlap of the live router with the base router on the OOD probe, layer
    mean (the analysis stage's drift measure, rpb.pipeline.analysis.routing_pass)."""
    from rpb.pipeline.analysis import load_for_inference, probe_texts, routing_pass, text_batches
    from rpb.routing import find_routers

    _, base = load_for_inference(base_dir)
    prior = _prior_of(find_routers(base))
    tokenizer, model = load_for_inference(model_dir)
    batches = text_batches(tokenizer, probe_texts(eval_dir, OOD, PROBE_LIMIT), batch_size=64)
    drift = routing_pass(model, batches, prior, desc="probe")["drift"]
    layers = drift["topk_overlap_with_base"]
    return float(sum(layers) / len(layers))


def _prior_of(handles) -> Any:
    """A RouterPrior holding only the base's router weights (all that drift needs)."""
    from types import SimpleNamespace

    bias = [getattr(h.module, "e_score_correction_bias", None) for h in handles]
    return SimpleNamespace(
        base_weights=[h.module.weight.detach().clone() for h in handles],
        correction_bias=None
        if all(b is None for b in bias)
        else [None if b is None else b.detach().clone() for b in bias],
        router_bias=None,
    )


def run_record(
    results: Path, work: Path, model: str, point: Point, seed: int, threads: int = 1
) -> dict[str, Any]:
    """Post-train `model`'s base with `none` at `point` and `seed`, score it and its copy with the
    base's routers put back, and measure its router's drift. Cached as record.json."""
    import torch

    from rpb.method_config import MethodConfig
    from rpb.pipeline.training import TrainSpec, posttrain
    from rpb.router_swap import swap_routers

    run_dir = _paths(work)["runs"] / model / point.label / f"seed{seed}"
    record_path = run_dir / "record.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    torch.set_num_threads(threads)
    started = time.time()
    base_dir = base_dir_of(results, model)
    data = _paths(work)["data"] / f"L{point.level}"
    spec = TrainSpec(
        steps=point.steps,
        batch_size=64,
        lr=point.lr,
        max_length=48,
        warmup_ratio=0.02,
        seed=seed,
        log_every=max(1, point.steps // 20),
        threads=threads,
        trainable="moe",
    )
    posttrain(
        base_dir=base_dir,
        prior_path=None,
        corpus=data / "post" / "math.jsonl",
        method=MethodConfig("none"),
        spec=spec,
        out_dir=run_dir,
    )
    trained_s = time.time() - started
    scores = _scores(run_dir / "model", data / "screen_eval", run_dir / "eval.json")
    # The base's routers put back into none's model (R).
    from transformers import AutoModelForCausalLM

    swapped = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
    swap_routers(swapped, AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))
    swapped_dir = run_dir / "model_base_routers"
    swapped.save_pretrained(swapped_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (run_dir / "model" / name).is_file():
            shutil.copyfile(run_dir / "model" / name, swapped_dir / name)
    swap = _scores(
        swapped_dir, data / "screen_eval", run_dir / "eval_base_routers.json", exact_match=False
    )
    record = {
        "model": model,
        "point": asdict(point),
        "seed": seed,
        **scores,
        "dev_p_base_routers": swap["dev_p"],
        "ood_p_base_routers": swap["ood_p"],
        "overlap": _overlap(run_dir / "model", base_dir, data / "screen_eval"),
        "train_seconds": trained_s,
        "seconds": time.time() - started,
    }
    shutil.rmtree(swapped_dir)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


# --- the walk ----------------------------------------------------------------------------------


class Walk:
    """One family's walk over the grid (docs/records/premise_screen.md); its history is the
    screen's record."""

    def __init__(self, family: str, results: Path, work: Path, pool: ProcessPoolExecutor):
        self.family, self.results, self.work, self.pool = family, results, work, pool
        self.base0, self.base1 = FAMILIES[family]
        self.history: list[dict[str, Any]] = []
        self.skipped: dict[Point, str] = {}
        self.chosen: Point | None = None

    def _runs(self, model: str, point: Point, seeds: Sequence[int]) -> list[dict[str, Any]]:
        futures: list[Future] = [
            self.pool.submit(run_record, self.results, self.work, model, point, s) for s in seeds
        ]
        return [f.result() for f in futures]

    def _base(self, model: str, level: int) -> dict[str, Any]:
        return self.pool.submit(base_record, self.results, self.work, model, level).result()

    def run(self) -> None:
        for point in grid():
            if point in self.skipped:
                self.history.append(
                    {"point": asdict(point), "status": "skipped", "why": self.skipped[point]}
                )
                continue
            runs0 = self._runs(self.base0, point, SEEDS_BASE0)
            gates0 = judge(runs0, self._base(self.base0, point.level))
            entry: dict[str, Any] = {"point": asdict(point), "base0": asdict(gates0)}
            for p, why in ruled_out(point, gates0).items():
                self.skipped.setdefault(p, why)
            if gates0.passes:
                runs1 = self._runs(self.base1, point, SEEDS_BASE1)
                gates1 = judge(runs1, self._base(self.base1, point.level))
                entry["base1"] = asdict(gates1)
                if gates1.passes:
                    entry["status"] = "chosen"
                    self.history.append(entry)
                    self.chosen = point
                    log.info("family %s: %s passes on both bases", self.family, point.label)
                    return
                entry["status"] = "fails on base 1"
            else:
                entry["status"] = "fails on base 0"
            log.info("family %s: %s %s %s", self.family, point.label, entry["status"], gates0)
            self.history.append(entry)


def pooled_r(runs_by_base: Sequence[Sequence[dict]], bases: Sequence[dict]) -> tuple[float, float]:
    """R's share over every run of both bases (each against its own base) and `none`'s mean OOD
    p(target) loss in points."""
    undone, loss = [], []
    for runs, base in zip(runs_by_base, bases, strict=True):
        ood_base = np.mean([base["ood_p"][t] for t in OOD])
        for r in runs:
            ood_none = np.mean([r["ood_p"][t] for t in OOD])
            undone.append(np.mean([r["ood_p_base_routers"][t] for t in OOD]) - ood_none)
            loss.append(ood_base - ood_none)
    return float(np.mean(undone) / np.mean(loss)), float(100 * np.mean(loss))


def summary(walks: Sequence[Walk]) -> dict[str, Any]:
    """Every family's walk, its outcome and, for a chosen point, the seed count and headroom."""
    out: dict[str, Any] = {
        "gates": {"L": L_RANGE, "F": F_RANGE, "D_max": D_MAX, "R_min_share": R_MIN_SHARE},
        "families": {},
    }
    for walk in walks:
        fam: dict[str, Any] = {"bases": [walk.base0, walk.base1], "history": walk.history}
        if walk.chosen is None:
            fam["outcome"] = "premise not met"
        else:
            fam["outcome"] = "chosen"
            fam["point"] = asdict(walk.chosen)
            runs = [
                [run_record(walk.results, walk.work, m, walk.chosen, s) for s in seeds]
                for m, seeds in ((walk.base0, SEEDS_BASE0), (walk.base1, SEEDS_BASE1))
            ]
            bases = [
                base_record(walk.results, walk.work, m, walk.chosen.level)
                for m in (walk.base0, walk.base1)
            ]
            share, loss = pooled_r(runs, bases)
            fam["seed_count"] = {"r_share_pooled": share, "ood_loss_points": loss}
            fam["seed_count"] |= seed_count(runs, loss, share)
        out["families"][walk.family] = fam
    return out


def markdown(record: dict[str, Any]) -> str:
    """Every grid point's L, F, D, R per family, and each family's outcome."""
    lines = ['# Premise screen (docs/testbed.md, "Testbed v2")', ""]
    g = record["gates"]
    lines.append(
        f"Gates: L in [{g['L'][0]}, {g['L'][1]}], F in [{g['F'][0]}, {g['F'][1]}], "
        f"D <= {g['D_max']}, R share >= {g['R_min_share']} with undone's 95% lower bound > 0."
    )
    for family, fam in record["families"].items():
        lines += ["", f"## Family {family} ({', '.join(fam['bases'])}): {fam['outcome']}", ""]
        lines.append("| point | base | n | L | F | D | R share | undone low (pp) | status |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for entry in fam["history"]:
            label = Point(**entry["point"]).label
            if entry["status"] == "skipped":
                lines.append(f"| {label} | | | | | | | | skipped: {entry['why']} |")
                continue
            for base in ("base0", "base1"):
                if base not in entry:
                    continue
                x = entry[base]
                mark = lambda ok: "" if ok else " ✗"  # noqa: E731
                lines.append(
                    f"| {label} | {base[-1]} | {x['n']} | {x['dev_p']:.3f}{mark(x['l_ok'])} "
                    f"| {x['retention']:.3f}{mark(x['f_ok'])} "
                    f"| {x['overlap']:.3f}{mark(x['d_ok'])} "
                    f"| {x['r_share']:.3f}{mark(x['r_ok'])} | {100 * x['r_undone_low']:.2f} "
                    f"| {entry['status']} |"
                )
        if "seed_count" in fam:
            sc = fam["seed_count"]
            lines += [
                "",
                f"Seed count: {sc['seeds_per_base']} seeds per base (runs needed: in-domain "
                f"{sc['runs_needed_in_domain']}, OOD {sc['runs_needed_ood']}; sd "
                f"{sc['sd_in_domain']:.2f} / {sc['sd_ood']:.2f} points); MDE in-domain "
                f"{sc['in_domain_mde']:.2f}, OOD "
                f"{sc['ood_mde']:.2f} points. Headroom: R share {sc['r_share_pooled']:.3f} x OOD "
                f"loss {sc['ood_loss_points']:.2f} = {sc['headroom_points']:.2f} points"
                + (
                    " < the OOD MDE: OOD parts underpowered by design."
                    if sc["ood_underpowered_by_design"]
                    else "."
                ),
            ]
    return "\n".join(lines) + "\n"


def parse_arguments(
    argv: Sequence[str] | None, description: str | None, work: Path
) -> argparse.Namespace:
    """The screens' command line (v2's and v3's: each its own `work` cache), logging set up."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--work", type=Path, default=work)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--families", default="A,B")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_arguments(argv, __doc__, HERE / "work")
    prepare_data(args.results, args.work)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        walks = [Walk(f, args.results, args.work, pool) for f in families]
        threads = [threading.Thread(target=w.run, name=f"walk-{w.family}") for w in walks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    args.out.mkdir(parents=True, exist_ok=True)
    record = summary(walks)
    (args.out / "screen.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (args.out / "screen.md").write_text(markdown(record))
    log.info("wrote %s", args.out / "screen.json")


if __name__ == "__main__":
    main()
