"""The testbed regime rule of regime.md (this folder), applied. Archived: it was `rpb.regime`
until the walk left the product (last run there: commit 0e5c1da); see README.md.

The rule chooses the post-training regime (learning rate, step count, task difficulty, seed count)
from plain fine-tuning (`none`) and the base alone, before any method comparison: calibration runs
of `none` on their own seeds, scored on the development split (`rpb.pipeline.data`: disjoint from
training data and from every eval set the tables read), walked over the candidates in the rule's
order. The first candidate that passes every gate is the regime; every candidate tried is reported.

Calibration runs are cached one JSON per (model, task, lr fraction, steps, seed), so an
interrupted or extended walk never recomputes a finished run. A task is a difficulty level and,
for rule 2 (data-limited post-training), the number of post-training pairs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rpb.artifacts import write_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegimeRule:
    """The rule's settings (config key `regime`); defaults are docs/regime.md's."""

    seeds: tuple[int, ...] = (100, 101, 102, 103, 104)
    lr_fractions: tuple[float, ...] = (0.1, 1 / 30)  # R0: of the base's pretraining peak lr
    steps: tuple[int, ...] = (200, 400, 800)  # R1: the smallest whose doubling changes nothing
    levels: tuple[int, ...] = (1, 2, 3, 4)  # R2: tried from the easiest upward
    # Rule 2's second graded axis (docs/regime.md): post-training pairs per level, tried from the
    # most (easiest) down; empty (or None): the data preset's size (rule 1).
    post_pairs: tuple[int | None, ...] = ()
    # Rule 3's graded axis (docs/regime.md): post-training hold-outs
    # (`rpb.pipeline.data.check_holdout`), tried in the given order; empty (or None): no hold-out
    # (rules 1 and 2).
    post_holdouts: tuple[str | None, ...] = ()
    # Rule 2's R2b: the least share of dev items that some but not every seed answers correctly
    # (room to move); 0 skips the gate (rule 1).
    min_moving_share: float = 0.0
    readings: int = 10  # dev accuracy read every steps / readings
    plateau_tolerance: float = 0.02  # R1: mean change of dev accuracy from S to 2S steps
    plateau_seed_tolerance: float = 0.05  # R1: every seed's change from S to 2S steps
    accuracy_range: tuple[float, float] = (0.40, 0.85)  # R2: none's mean dev accuracy
    table1_budget_s: float = 900.0  # R3: table 1 within 15 minutes on the development machine
    all_budget_s: float = 5400.0  # R3: `all` within 90 minutes on the development machine
    run_overhead_s: float = 4.5  # R3: a run's non-training seconds (bench/pipeline_cost.py)
    margin: float = 5.0  # R4: points; the claims margin
    confidence: float = 0.95
    power: float = 0.8
    warmup_ratio: float = 0.02  # R0: the pretraining schedule's shape (warm-up, cosine)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RegimeRule:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"regime: unknown key(s) {', '.join(unknown)}")
        tuples = {k: tuple(v) for k, v in raw.items() if isinstance(v, list)}
        return cls(**(raw | tuples))


@dataclass(frozen=True)
class Candidate:
    """One calibration setting of one base."""

    model: str
    level: int
    lr_fraction: float
    steps: int
    post_pairs: int | None = None  # None: the data preset's post-training pairs
    post_holdout: str | None = None  # None: no post-training hold-out (rule 3)

    @property
    def task(self) -> tuple[int, int | None, str | None]:
        """The corpora it trains and reads: (level, post-training pairs, hold-out)."""
        return (self.level, self.post_pairs, self.post_holdout)

    def path(self, root: Path, seed: int) -> Path:
        frac = f"{self.lr_fraction:.4g}".replace(".", "p")
        return (
            root
            / self.model
            / task_name(*self.task)
            / f"lr{frac}"
            / f"S{self.steps}"
            / f"seed{seed}.json"
        )


def task_name(level: int, post_pairs: int | None, post_holdout: str | None = None) -> str:
    """The folder name of a task's corpora and runs: L1, L1-N3000 for 3,000 pairs, L1-corner50
    for a hold-out."""
    name = f"L{level}" if post_pairs is None else f"L{level}-N{post_pairs}"
    return name if post_holdout is None else f"{name}-{post_holdout}"


# --- the gates ------------------------------------------------------------------------------------


def plateaued(
    short: Sequence[float], long: Sequence[float], tolerance: float, seed_tolerance: float
) -> list[bool]:
    """R1 (revised, docs/regime.md): a step count S is past the learning transition when
    training for 2S steps (same seeds, same schedule shape) changes the mean final dev accuracy
    by less than `tolerance` and no seed's by `seed_tolerance` or more. Per seed: whether that
    seed stays within `seed_tolerance` (all False when the mean moves by `tolerance` or more).

    A cosine schedule freezes the last steps of any run, so a flat end of one run's curve
    cannot tell a plateau from a stalled climb; only a longer run can."""
    if len(short) != len(long) or not short:
        raise ValueError("plateau check: the S and 2S runs must cover the same seeds")
    mean_change = abs(sum(long) / len(long) - sum(short) / len(short))
    if mean_change >= tolerance:
        return [False] * len(short)
    return [abs(b - a) < seed_tolerance for a, b in zip(short, long, strict=True)]


def moving_share(outcomes: Sequence[Sequence[bool]]) -> float:
    """R2b (rule 2): the share of items that at least one seed and not every seed answers
    correctly (`outcomes`: one list of per-item results per seed, items in the same order)."""
    if len(outcomes) < 2 or len({len(o) for o in outcomes}) != 1 or not outcomes[0]:
        raise ValueError("room to move: need per-item outcomes of 2+ seeds on the same items")
    per_item = list(zip(*outcomes, strict=True))
    return sum(any(item) and not all(item) for item in per_item) / len(per_item)


def region_accuracy(
    holdout: str | None, data_dir: Path, corpus: str, outcomes: Sequence[Sequence[int]] | None
) -> float | None:
    """Rule 3: the mean over seeds of the accuracy on the dev items whose operands lie in the
    hold-out's region (the task's hard items by construction); None without a hold-out."""
    if holdout is None or not outcomes:
        return None
    import re

    from rpb.pipeline.data import held_out_by, load_jsonl

    items = load_jsonl(Path(data_dir) / "dev" / f"{corpus}.jsonl", ("prompt", "target"))
    pairs = [tuple(int(x) for x in re.findall(r"\d+", item["prompt"])[:2]) for item in items]
    inside = [i for i, (a, b) in enumerate(pairs) if held_out_by(holdout, a, b)]
    if not inside:
        return None
    return sum(o[i] for o in outcomes for i in inside) / (len(inside) * len(outcomes))


def seeds_for_margin(sigma: float, rule: RegimeRule) -> int:
    """R4: the smallest n whose paired MDE at sd sqrt(2) * sigma (points) is at most the margin."""
    from rpb.report.stats import seeds_needed

    return seeds_needed(
        math.sqrt(2) * sigma, rule.margin, confidence=rule.confidence, power=rule.power
    )


def table1_seconds(
    run_seconds: float, n_runs: int, n_methods: int, pretrain_seconds: float, cores: int
) -> float:
    """R3's estimate of table 1's wall time: the bases pretrained side by side, then every
    (method, run) post-trained, evaluated and analysed, `cores` at a time."""
    return pretrain_seconds + n_runs * n_methods * run_seconds / max(1, cores)


def all_seconds(
    run_seconds: float,
    n_runs: int,
    workload: AllWorkload,
    pretrain_seconds: float,
    cores: int,
) -> float:
    """R3's estimate of `all`'s wall time: its bases pretrained `cores` at a time, then its
    post-training runs, scaled from the configured runs per method to `n_runs`."""
    rounds = math.ceil(workload.bases / max(1, cores))
    runs = workload.posttrain_runs * n_runs / workload.runs_per_method
    return rounds * pretrain_seconds + runs * run_seconds / max(1, cores)


@dataclass(frozen=True)
class AllWorkload:
    """What `all` trains at the configured seeds (counted from the workflow's targets)."""

    posttrain_runs: int  # distinct post-training runs, diagnostics included
    runs_per_method: int  # table 1's (base, seed) runs per method
    bases: int  # pretrained bases


# --- one calibration run --------------------------------------------------------------------------


def dev_accuracy(model: Any, tokenizer: Any, items: Sequence[dict[str, str]]) -> float:
    """Greedy exact match on prompt/target items: the target's tokens, then EOS."""
    return sum(dev_outcomes(model, tokenizer, items)) / max(1, len(items))


def dev_outcomes(model: Any, tokenizer: Any, items: Sequence[dict[str, str]]) -> list[bool]:
    """Per item, in `items`' order: greedy exact match (the target's tokens, then EOS).

    Prompts are grouped by token length, so no batch needs padding and positions are the ones
    training saw (the tiny tokenizer has no BOS)."""
    import torch

    from rpb.pipeline.tokenizer import encode

    eos = tokenizer.eos_token_id
    groups: dict[int, list[tuple[list[int], list[int]]]] = {}
    for i, item in enumerate(items):
        prompt = encode(tokenizer, item["prompt"], f"dev item {i}")
        target = [*encode(tokenizer, item["target"], f"dev item {i}"), eos]
        groups.setdefault(len(prompt), []).append((i, prompt, target))
    was_training = model.training
    model.eval()
    correct = [False] * len(items)
    with torch.no_grad():
        for group in groups.values():
            width = max(len(t) for _, _, t in group)
            ids = torch.tensor([p for _, p, _ in group])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=width,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos,
            )[:, ids.shape[1] :]
            for row, (i, _, target) in zip(out.tolist(), group, strict=True):
                correct[i] = row[: len(target)] == target
    model.train(was_training)
    return correct


def _dev_callback(tokenizer: Any, items: list[dict[str, str]], every: int, curve: list) -> Any:
    from transformers import TrainerCallback

    class DevAccuracyCallback(TrainerCallback):
        """Reads dev accuracy every `every` optimizer steps (and at the last); `outcomes` holds
        the latest reading's per-item results."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                start = time.perf_counter()
                self.outcomes = dev_outcomes(model, tokenizer, items)
                curve.append((state.global_step, sum(self.outcomes) / max(1, len(items))))
                self.seconds = getattr(self, "seconds", 0.0) + time.perf_counter() - start

    return DevAccuracyCallback()


def inputs_fingerprint(base_dir: Path, data_dir: Path, corpus: str) -> str:
    """What a calibration run's result depends on besides its settings: the base's weights and
    the training and development data. A cached run whose fingerprint differs is stale."""
    digest = hashlib.sha256()
    for path in (
        Path(base_dir) / "model.safetensors",
        Path(data_dir) / "post" / f"{corpus}.jsonl",
        Path(data_dir) / "dev" / f"{corpus}.jsonl",
    ):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def calibration_run(
    *,
    base_dir: Path,
    data_dir: Path,
    corpus: str,
    lr: float,
    steps: int,
    seed: int,
    posttrain: dict[str, Any],
    rule: RegimeRule,
    out: Path,
    inputs: str,
) -> dict[str, Any]:
    """Post-train `none` on `corpus` of `data_dir` and write its dev-accuracy curve to `out`
    (`inputs`: the base and data's `inputs_fingerprint`, kept with the record)."""
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from rpb.method_config import MethodConfig
    from rpb.pipeline.data import load_jsonl
    from rpb.pipeline.training import TrainSpec
    from rpb.pipeline.training import posttrain as run_posttrain

    torch.set_num_threads(1)
    items = load_jsonl(data_dir / "dev" / f"{corpus}.jsonl", ("prompt", "target"))
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    curve: list[tuple[int, float]] = []
    callback = _dev_callback(tokenizer, items, max(1, steps // rule.readings), curve)
    settings = {k: v for k, v in posttrain.items() if k in ("batch_size", "max_length")}
    spec = TrainSpec(
        steps=steps,
        lr=lr,
        seed=seed,
        warmup_ratio=rule.warmup_ratio,
        threads=1,
        log_every=max(1, steps // rule.readings),
        **settings,
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rpb-calib-") as tmp:
        run_posttrain(
            base_dir=base_dir,
            prior_path=None,
            corpus=data_dir / "post" / f"{corpus}.jsonl",
            method=MethodConfig("none"),
            spec=spec,
            out_dir=Path(tmp),
            callbacks=[callback],
            save_model=False,
        )
    wall = time.perf_counter() - start
    record = {
        "curve": curve,
        "final": curve[-1][1] if curve else float("nan"),
        # The last reading's per-item results, in the dev file's order (R2b of rule 2).
        "final_correct": [int(c) for c in getattr(callback, "outcomes", [])],
        "wall_s": wall,
        "dev_eval_s": getattr(callback, "seconds", 0.0),
        "train_s": wall - getattr(callback, "seconds", 0.0),
        "settings": {"lr": lr, "steps": steps, "seed": seed, "corpus": corpus} | settings,
        "inputs": inputs,
    }
    write_text(out, json.dumps(record, indent=2) + "\n")  # atomic: a finished run only
    return record


def _calibration_job(kwargs: dict[str, Any]) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING)
    return calibration_run(**kwargs)


# --- the walk -------------------------------------------------------------------------------------


def _is_current(path: Path, inputs: str) -> bool:
    """A cached run exists and was trained on these inputs (a record without a fingerprint
    predates it and counts as stale)."""
    if not path.is_file():
        return False
    return json.loads(path.read_text()).get("inputs") == inputs


class MissingRuns(RuntimeError):
    """A cached-only walk reached a candidate whose runs are not trained yet."""


@dataclass
class CandidateResult:
    """What the rule saw for one candidate."""

    candidate: Candidate
    finals: list[float]
    plateau: list[bool]
    train_s: float  # median seconds of a run's training (dev readings excluded)
    gate: str = ""  # which gate it passed or failed, in words
    # R2b's share of items some but not every seed solves (None: a run recorded before per-item
    # results were kept, or a single seed).
    moving: float | None = None
    # Rule 3: the seeds' mean accuracy on the dev items inside the hold-out's region (None: no
    # hold-out, or no per-item results).
    inside: float | None = None

    @property
    def mean(self) -> float:
        return sum(self.finals) / len(self.finals)

    @property
    def sd_points(self) -> float:
        import statistics

        return 100 * statistics.stdev(self.finals) if len(self.finals) > 1 else float("nan")

    def row(self) -> dict[str, Any]:
        return asdict(self.candidate) | {
            "dev_mean": round(self.mean, 4),
            "dev_sd_points": round(self.sd_points, 2),
            "finals": [round(f, 3) for f in self.finals],
            # None: not judged (a 2S reference run, or not reached).
            "all_plateaued": all(self.plateau) if self.plateau else None,
            "moving_share": None if self.moving is None else round(self.moving, 3),
            "inside_region": None if self.inside is None else round(self.inside, 3),
            "train_s": round(self.train_s, 1),
            "gate": self.gate,
        }


@dataclass
class RegimeWalk:
    """Walks the rule's candidates in order, running (or reading cached) calibration runs."""

    rule: RegimeRule
    models: dict[str, dict[str, Any]]  # name -> {"base_dir", "pretrain_lr"}
    data_dirs: dict[tuple[int, int | None, str | None], Path]  # Candidate.task -> its corpora
    corpus: str
    posttrain: dict[str, Any]
    runs_root: Path
    cores: int = 2
    tried: list[CandidateResult] = field(default_factory=list)
    runner: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
    # Called with the candidates tried so far after each one, so an interrupted walk leaves a
    # report of what it had measured (the runs themselves are cached anyway).
    on_progress: Callable[[dict[str, Any]], None] | None = None
    cached_only: bool = False  # report from finished runs only; stop at the first missing one

    def _run_all(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.runner is not None:
            return self.runner(jobs)
        todo = [j for j in jobs if not _is_current(j["out"], j["inputs"])]
        if todo and self.cached_only:
            raise MissingRuns(f"{len(todo)} run(s) not yet trained, e.g. {todo[0]['out']}")
        if todo:
            log.info("regime: %d calibration run(s) to train", len(todo))
            for job in todo:
                if job["out"].is_file():  # stale: trained on another base or data; kept aside
                    old = json.loads(job["out"].read_text()).get("inputs", "unfingerprinted")
                    stale = job["out"].with_suffix(f".stale-{old}.json")
                    log.warning("regime: %s is stale, moved to %s", job["out"], stale.name)
                    job["out"].replace(stale)
            with ProcessPoolExecutor(
                max_workers=min(self.cores, len(todo)), mp_context=get_context("spawn")
            ) as pool:
                list(pool.map(_calibration_job, todo))
        return [json.loads(j["out"].read_text()) for j in jobs]

    def evaluate(self, candidate: Candidate) -> CandidateResult:
        model = self.models[candidate.model]
        data_dir = self.data_dirs[candidate.task]
        inputs = inputs_fingerprint(Path(model["base_dir"]), data_dir, self.corpus)
        jobs = [
            {
                "base_dir": Path(model["base_dir"]),
                "data_dir": data_dir,
                "corpus": self.corpus,
                "lr": candidate.lr_fraction * model["pretrain_lr"],
                "steps": candidate.steps,
                "seed": seed,
                "posttrain": self.posttrain,
                "rule": self.rule,
                "out": candidate.path(self.runs_root, seed),
                "inputs": inputs,
            }
            for seed in self.rule.seeds
        ]
        records = self._run_all(jobs)
        outcomes = (
            [rec["final_correct"] for rec in records]
            if all(rec.get("final_correct") for rec in records)
            else None
        )
        result = CandidateResult(
            candidate,
            finals=[rec["final"] for rec in records],
            plateau=[],
            train_s=sorted(rec["train_s"] for rec in records)[len(records) // 2],
            # Reported for every candidate that has per-item results; gated only by R2b.
            moving=moving_share(outcomes) if outcomes and len(outcomes) > 1 else None,
            inside=region_accuracy(candidate.post_holdout, data_dir, self.corpus, outcomes),
        )
        self.tried.append(result)
        return result

    def result(self, candidate: Candidate) -> CandidateResult:
        """The candidate's runs, trained once per walk (and once ever: the JSON cache)."""
        for done in self.tried:
            if done.candidate == candidate:
                return done
        return self.evaluate(candidate)

    def check(self, candidate: Candidate, last: bool = True) -> CandidateResult:
        """R1 at `candidate.steps` (S) against the same setting at 2S, then R2 at S. Before the
        rule's largest S (`last` False) a plateau below the range is no floor: it may be the
        flat start before the transition (doubling 0 gives 0), and the next S is tried."""
        r = self.rule
        short = self.result(candidate)
        long = self.result(dataclasses.replace(candidate, steps=2 * candidate.steps))
        if not long.gate:
            long.gate = f"2S run of S={candidate.steps}"
        short.plateau = plateaued(
            short.finals, long.finals, r.plateau_tolerance, r.plateau_seed_tolerance
        )
        change = long.mean - short.mean
        low, high = r.accuracy_range
        if not all(short.plateau):
            moved = max(abs(b - a) for a, b in zip(short.finals, long.finals, strict=True))
            short.gate = f"R1 fails: mean {change:+.3f} at 2S, a seed up to {moved:.3f}"
        elif short.mean > high:
            short.gate = f"R1 passes; R2 fails: ceiling ({short.mean:.3f} > {high})"
        elif short.mean < low and not last:
            short.gate = "R1: flat below the range before the largest S; next S"
        elif short.mean < low:
            short.gate = f"R1 passes; R2 fails: floor ({short.mean:.3f} < {low})"
        elif r.min_moving_share > 0 and self._moving(short) < r.min_moving_share:
            short.gate = (
                f"R1, R2 pass; R2b fails: room to move ({short.moving:.3f} of the items vary"
                f" between seeds < {r.min_moving_share})"
            )
        else:
            short.gate = "R1, R2 pass"
        log.info("regime: %s", json.dumps(short.row()))
        if self.on_progress is not None:
            self.on_progress(
                {"chosen": None, "partial": True, "tried": [t.row() for t in self.tried]}
            )
        return short

    def _moving(self, result: CandidateResult) -> float:
        if result.moving is None:
            raise ValueError(
                f"R2b needs per-item outcomes, and a cached run of {result.candidate} predates "
                "them: delete its JSON files under the calibration runs to retrain them"
            )
        return result.moving

    def tasks(self) -> list[tuple[int, int | None, str | None]]:
        """The graded tasks in the rule's order: each level, then (rule 2) each post-training
        size from the most pairs down, then (rule 3) each hold-out in the rule's order."""
        sizes = self.rule.post_pairs or (None,)
        holdouts = self.rule.post_holdouts or (None,)
        return [(lv, n, h) for lv in self.rule.levels for n in sizes for h in holdouts]

    def family_setting(self, model: str, frac: float) -> CandidateResult | None:
        """R1 then R2 (and R2b) for one base at one lr: the easiest task whose plateau step
        count puts none's mean dev accuracy inside the range; None if no task does."""
        low = self.rule.accuracy_range[0]
        for level, pairs, holdout in self.tasks():
            found = None
            for steps in self.rule.steps:
                last = steps == self.rule.steps[-1]
                candidate = Candidate(model, level, frac, steps, pairs, holdout)
                result = self.check(candidate, last=last)
                if all(result.plateau) and (result.mean >= low or last):
                    found = result
                    break
            if found is None:
                continue  # R1 fails at every step count: the next task
            if found.gate == "R1, R2 pass":
                return found
            if "floor" in found.gate:
                # Harder tasks only lower accuracy further (docs/regime.md): stop climbing.
                return None
        return None

    def walk(
        self,
        table1_methods: int,
        pretrain_seconds: float,
        workload: AllWorkload | None = None,
    ) -> dict[str, Any]:
        """The regime: the first lr fraction at which every base passes R1 and R2 at one common
        step count, then R4's seed count and R3's cost gate.

        A family that passes at no level of any lr fraction is "not testable: ceiling/floor"
        (R2): the regime is then the first lr fraction at which the other families pass, and the
        failing family is named in `not_testable`. Evaluation is lazy but decides the same:
        once a fallback exists, an lr fraction stops at its first failing family. Without a
        `workload`, R3 gates on table 1 alone."""
        cost = (table1_methods, pretrain_seconds, workload)
        decision: dict[str, Any] = {"chosen": None}
        fallback: dict[str, Any] | None = None
        for frac in self.rule.lr_fractions:
            settings: dict[str, CandidateResult | None] = {}
            for m in self.models:
                settings[m] = self.family_setting(m, frac)
                if settings[m] is None and fallback is not None:
                    break  # no full pass here, and the fallback is an earlier fraction
            failed = [m for m, s in settings.items() if s is None]
            if failed:
                decision.setdefault("rejected", []).append(
                    {"lr_fraction": frac, "why": f"no level passes R1+R2 on {', '.join(failed)}"}
                )
                if fallback is None and len(failed) < len(settings):
                    fallback = {"frac": frac, "settings": settings, "not_testable": failed}
                continue
            entry = self._regime(frac, settings, decision, cost)
            if entry is not None:
                decision["chosen"] = entry
                break
        else:
            if fallback is not None:
                passing = {m: s for m, s in fallback["settings"].items() if s is not None}
                entry = self._regime(fallback["frac"], passing, decision, cost)
                if entry is not None:
                    entry["not_testable"] = fallback["not_testable"]
                    decision["chosen"] = entry
        decision["tried"] = [t.row() for t in self.tried]
        return decision

    def _regime(
        self,
        frac: float,
        settings: dict[str, CandidateResult],
        decision: dict[str, Any],
        cost: tuple[int, float, AllWorkload | None],
    ) -> dict[str, Any] | None:
        """R1 + R2 at the families' common step count, then R4 and R3; None (and a rejection
        recorded in `decision`) if a gate fails."""
        steps = max(s.candidate.steps for s in settings.values())
        common = {}
        for m, s in settings.items():  # R1 + R2 again at the common step count
            if s.candidate.steps != steps:
                s = self.check(dataclasses.replace(s.candidate, steps=steps))
            common[m] = s
        if not all(s.gate == "R1, R2 pass" for s in common.values()):
            decision.setdefault("rejected", []).append(
                {"lr_fraction": frac, "why": "R1/R2 fail at the common step count"}
            )
            return None
        sigma = max(s.sd_points for s in common.values())
        n = seeds_for_margin(sigma, self.rule)
        run_s = max(s.train_s for s in common.values()) + self.rule.run_overhead_s
        table1_methods, pretrain_seconds, workload = cost
        cost = table1_seconds(run_s, n, table1_methods, pretrain_seconds, self.cores)
        entry = {
            "lr_fraction": frac,
            "steps": steps,
            "levels": {m: s.candidate.level for m, s in common.items()},
            "post_pairs": {m: s.candidate.post_pairs for m, s in common.items()},
            "post_holdout": {m: s.candidate.post_holdout for m, s in common.items()},
            "lr": {m: frac * self.models[m]["pretrain_lr"] for m in common},
            "dev_mean": {m: round(s.mean, 4) for m, s in common.items()},
            "sigma_points": round(sigma, 2),
            "runs_needed": n,
            "run_seconds": round(run_s, 1),
            "table1_seconds_estimate": round(cost, 0),
        }
        all_cost = (
            all_seconds(run_s, n, workload, pretrain_seconds, self.cores)
            if workload is not None
            else None
        )
        if all_cost is not None:
            entry["all_seconds_estimate"] = round(all_cost, 0)
        # An unknown cost (no pretraining time in the store: NaN) fails the gate too.
        if not cost <= self.rule.table1_budget_s:
            entry["why"] = (
                f"R3 fails: table 1 estimate {cost:.0f} s > {self.rule.table1_budget_s:.0f} s"
            )
            decision.setdefault("rejected", []).append(entry)
            return None
        if all_cost is not None and not all_cost <= self.rule.all_budget_s:
            entry["why"] = (
                f"R3 fails: `all` estimate {all_cost:.0f} s > {self.rule.all_budget_s:.0f} s"
            )
            decision.setdefault("rejected", []).append(entry)
            return None
        return entry


def write_report(decision: dict[str, Any], rule: RegimeRule, out_json: Path, out_md: Path) -> None:
    """The decision and every candidate tried, as JSON and a Markdown table."""
    write_text(out_json, json.dumps({"rule": asdict(rule), **decision}, indent=2) + "\n")
    lines = [
        "# Testbed regime (the rule of docs/regime.md, applied by `rpb regime`)",
        "",
        "Task: difficulty level (L1-L4), for rule 2 the post-training pairs (L1-N3000), for rule 3"
        " the post-training hold-out (L1-corner50).",
        "",
        f"Calibration seeds {list(rule.seeds)}; in-domain accuracy of `none` on the development",
        f"split, read every steps/{rule.readings}. R2 range {list(rule.accuracy_range)}; margin"
        f" {rule.margin} points.",
        "",
        "| model | task | lr fraction | steps | dev mean | sd (points) | all plateaued"
        " | varying items | in region | train s | gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in decision["tried"]:
        plateau = "-" if t["all_plateaued"] is None else t["all_plateaued"]
        moving = "-" if t.get("moving_share") is None else f"{t['moving_share']:.3f}"
        inside = "-" if t.get("inside_region") is None else f"{t['inside_region']:.3f}"
        lines.append(
            f"| {t['model']} | {task_name(t['level'], t.get('post_pairs'), t.get('post_holdout'))}"
            " | "
            f"{t['lr_fraction']:.4g} | {t['steps']} | {t['dev_mean']:.3f} | "
            f"{t['dev_sd_points']:.2f} | {plateau} | {moving} | {inside} | {t['train_s']} |"
            f" {t['gate']} |"
        )
    lines += ["", "## Decision", ""]
    for r in decision.get("rejected", []):
        lines.append(f"- rejected: `{json.dumps(r)}`")
    if decision.get("stopped"):
        lines.append(f"- walk stopped (cached runs only): {decision['stopped']}")
    chosen = decision.get("chosen")
    lines.append(
        f"- chosen: `{json.dumps(chosen)}`" if chosen else "- chosen: none (no candidate passes)"
    )
    write_text(out_md, "\n".join(lines) + "\n")
