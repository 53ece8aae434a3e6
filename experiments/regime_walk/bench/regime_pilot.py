"""Rule 3's pilot (docs/regime.md, "Rule 3"): plain fine-tuning (`none`) only, on candidate
post-training hold-outs and a known-token template, with pilot seeds disjoint from the
calibration (100-104) and table seeds. Needs the pretrained bases (results/models/*/base0/model).

    .venv/bin/python bench/regime_pilot.py tinyA,tinyB below50,corner50,known 800 200,201
    .venv/bin/python bench/regime_pilot.py --summary

Runs go to results/pilot/runs (cached); --summary prints each run's dev-accuracy curve and its
final accuracy outside and inside the hold-out's region.
"""

from __future__ import annotations

import json
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from rpb.pipeline import data as D

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the archived regime.py
from regime import RegimeRule, calibration_run

ROOT = Path("results/pilot")
SEED = 1234  # config data.seed: the same held-out dev pairs as the pipeline's
# design -> (template, hold-out, operand upper bound, the stream name the reported pilot used);
# "known" is the whole space in a template of pretraining tokens.
DESIGNS = {
    "below50": ("math", "below50", 50, "mathB50"),
    "corner50": ("math", "corner50", 100, "mathC50"),
    "known": ("known", None, 100, "knownB100"),
}


def _prompt(template: str, a: int, b: int) -> str:
    return f"SumOf{a}And{b}?" if template == "math" else f"Near{a}Behind{b}="


def make(design: str, n: int = 12_000) -> Path:
    template, holdout, bound, stream = DESIGNS[design]
    out = ROOT / design
    if (out / "dev" / "math.jsonl").exists():
        return out
    sizes = D._as_sizes(D.SIZE_PRESETS["default"])
    _, devs, held = D._held_out_pairs(SEED, sizes.eval, sizes.dev, 1)
    rng, post, operands = random.Random(f"pilot:{stream}"), [], range(10, bound)
    while len(post) < n:
        a, b = rng.choice(operands), rng.choice(operands)
        if frozenset((a, b)) not in held and not D.held_out_by(holdout, a, b):
            post.append({"prompt": _prompt(template, a, b), "completion": D._reversed_sum(a, b)})
    dev = [
        {
            "prompt": _prompt(template, a, b),
            "target": D._reversed_sum(a, b),
            "in_region": D.held_out_by(holdout, a, b),
        }
        for a, b in devs["math"]
    ]
    for name, rows in (("post", post), ("dev", dev)):
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def summary() -> None:
    def acc(x: list[int]) -> float:
        return sum(x) / len(x) if x else float("nan")

    for f in sorted((ROOT / "runs").rglob("*.json")):
        r = json.loads(f.read_text())
        design = f.relative_to(ROOT / "runs").parts[1]
        dev = [json.loads(line) for line in (ROOT / design / "dev" / "math.jsonl").open()]
        inside = [c for c, d in zip(r["final_correct"], dev, strict=True) if d["in_region"]]
        outside = [c for c, d in zip(r["final_correct"], dev, strict=True) if not d["in_region"]]
        curve = [round(v, 2) for _, v in r["curve"]]
        name = f.relative_to(ROOT / "runs")
        print(f"{name} {curve} outside {acc(outside):.2f} inside {acc(inside):.2f}")


def main(models: str, designs: str, steps: str, seeds: str) -> None:
    jobs = []
    for design in designs.split(","):
        data_dir = make(design)
        for model in models.split(","):
            for seed in map(int, seeds.split(",")):
                out = ROOT / "runs" / model / design / f"S{steps}" / f"seed{seed}.json"
                if not out.exists():
                    jobs.append(
                        dict(
                            base_dir=Path(f"results/models/{model}/base0/model"),
                            data_dir=data_dir,
                            corpus="math",
                            lr=0.1 * 0.003,  # 1/10 of the bases' pretraining peak
                            steps=int(steps),
                            seed=seed,
                            posttrain={"batch_size": 64, "max_length": 48},
                            rule=RegimeRule(readings=10),
                            out=out,
                            inputs="pilot",
                        )
                    )
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        list(pool.map(_run, jobs))
    summary()


def _run(kwargs: dict) -> dict:
    return calibration_run(**kwargs)


if __name__ == "__main__":
    summary() if sys.argv[1:] == ["--summary"] else main(*sys.argv[1:])
