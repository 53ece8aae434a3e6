"""Where one post-training job's time goes: table 1's `rpb pipeline train` of one run under
cProfile, split into start-up, forward, backward, optimizer step, logging (MLflow included) and the
Trainer's other per-step work, as seconds and shares of the job.

    python bench/train_profile.py          # 400 steps of rpb -> bench/results/train_profile.json
    python bench/train_profile.py --method none --steps 1600 --out /tmp/p.json

It trains in this process, from a results folder that holds table 1's inputs (the base, its
prior and the corpus: `snakemake --cores 2 results/priors/tinyA/base0/math.safetensors
results/data/manifest.json results/.mlflow_ready` makes them in seconds), into a temporary
folder and a temporary MLflow store. Start-up counts the imports of the training stack, which
the pipeline's job server pays once for all jobs (docs/performance.md). cProfile slows Python code
more than torch's kernels, so the shares of Python work (logging, the Trainer's bookkeeping) read
high: compare the parts of one profile, or the same part across commits, not against an
unprofiled job's seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (file suffix, function name) of each part's entry point: its cumulative time is the part's.
PARTS = {
    "job": ("rpb/pipeline/cli.py", "cmd_train"),
    "training_loop": ("transformers/trainer.py", "_inner_training_loop"),
    "training_step": ("transformers/trainer.py", "training_step"),
    "forward_and_loss": ("rpb/trainer.py", "compute_loss"),
    "backward": ("accelerate/accelerator.py", "backward"),
    "optimizer_step": ("torch/optim/lr_scheduler.py", "wrapper"),
    "logging": ("transformers/trainer.py", "_maybe_log_save_evaluate"),
    "batches": ("rpb/trainer.py", "get_batch_samples"),
    "router_hooks": ("rpb/routing.py", "_hook"),
}


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> tuple[float, int]:
    """Cumulative seconds and calls of the function `name` in a file ending with `suffix`."""
    seconds, calls = 0.0, 0
    for (filename, _, function), (_, ncalls, _, cum, _) in stats.stats.items():
        if function == name and filename.endswith(suffix):
            seconds, calls = max(seconds, cum), ncalls
    return seconds, calls


def breakdown(stats: pstats.Stats, steps: int) -> dict[str, dict[str, float]]:
    """Each part's seconds, share of the job and milliseconds per step; `other_per_step` is the
    loop's time outside a training step, the optimizer and logging (callbacks, data, scheduler)."""
    found = {part: cumulative(stats, *where) for part, where in PARTS.items()}
    seconds = {part: s for part, (s, _) in found.items()}
    seconds["start_up_and_save"] = seconds["job"] - seconds["training_loop"]
    seconds["other_per_step"] = seconds["training_loop"] - sum(
        seconds[p] for p in ("training_step", "optimizer_step", "logging")
    )
    job = seconds["job"] or 1.0
    return {
        part: {
            "seconds": round(s, 3),
            "share_of_job": round(s / job, 4),
            "ms_per_step": round(1000 * s / steps, 2),
        }
        for part, s in seconds.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "results")
    p.add_argument("--model", default="tinyA")
    p.add_argument("--method", default="rpb")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="table 1's")
    p.add_argument("--base", type=Path, help="default: the results folder's base 0 of --model")
    p.add_argument("--prior", type=Path, help="default: that base's prior over the math corpus")
    p.add_argument("--corpus", type=Path, help="default: the results folder's math corpus")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_profile.json")
    args = p.parse_args(argv)
    base = args.base or args.results / "models" / args.model / "base0" / "model"
    prior = args.prior or args.results / "priors" / args.model / "base0" / "math.safetensors"
    corpus = args.corpus or args.results / "data" / "post" / "math.jsonl"
    for path in (base, prior, corpus):
        if not path.exists():
            p.error(f"{path} is missing: make table 1's inputs first (see this script's docstring)")
    from rpb.pipeline.cli import main as rpb

    spec = {"base": 0, "batch_size": args.batch_size, "lr": 0.0003, "max_length": 48, "seed": 0}
    spec |= {"steps": args.steps, "trainable": "moe", "warmup_ratio": 0.02}
    method = {"kind": args.method, "options": {}, "strength": None}
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["pipeline", "train", "--name", args.model, "--label", args.method]
        argv += ["--tracking-uri", f"sqlite:///{tmp}/mlflow.db"]
        argv += ["--base", str(base), "--prior", str(prior), "--corpus", str(corpus)]
        argv += [
            "--corpus-name",
            "math",
            "--method",
            json.dumps(method),
            "--spec",
            json.dumps(spec),
        ]
        argv += ["--out", f"{tmp}/run", "--threads", "1", "--experiment", "train_profile"]
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        code = rpb(argv)
        profile.disable()
        wall = time.perf_counter() - started
    if code:
        raise SystemExit(f"the training job failed with status {code}")
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "load_average_1min": os.getloadavg()[0],
        "model": args.model,
        "method": args.method,
        "steps": args.steps,
        "wall_seconds_profiled": round(wall, 2),
        "parts": breakdown(pstats.Stats(profile), args.steps),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for part, value in result["parts"].items():
        print(f"{part:18s} {value['seconds']:8.2f} s {100 * value['share_of_job']:5.1f}%")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
