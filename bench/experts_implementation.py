"""Training-step time of the tiny bases under each transformers experts implementation.

For every pretrained model of config/config.yaml (tinyA: deepseek_v3, tinyB: qwen3_moe) at its
default size, a post-training step (forward + backward + AdamW, batch `posttrain.batch_size` x
`--seq` tokens) is timed with `eager`, `grouped_mm` and `batched_mm`, round-robin with the order
rotating each round; the median per implementation and its ratio to transformers' default
(grouped_mm) go to bench/results/experts_implementation.json. tests/test_experts_implementation.py
checks that every implementation's logits and gradients agree with eager.

    python bench/experts_implementation.py            # rounds: 5 (batched_mm: 1, it is slow)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import yaml

from rpb.architectures import random_model

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def step_seconds(model, batch, optimizer) -> float:
    start = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--slow-rounds", type=int, default=1, help="rounds of batched_mm")
    p.add_argument("--seq", type=int, default=24, help="tokens per example (the math corpus: ~24)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/experts_implementation.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    batch_size = config["posttrain"]["batch_size"]
    results = {}
    for name, entry in config["models"].items():
        if entry["source"] != "pretrain":
            continue
        arch = dict(entry["architecture"], vocab_size=128)
        model = random_model(entry["model_type"], seed=0, **arch).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 128, (batch_size, args.seq), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        times: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = list(IMPLEMENTATIONS[rnd % 3 :] + IMPLEMENTATIONS[: rnd % 3])
            for impl in order:
                if impl == "batched_mm" and rnd > args.slow_rounds:
                    continue
                model.set_experts_implementation(impl)
                seconds = step_seconds(model, batch, optimizer)
                if rnd > 0 or impl == "batched_mm":
                    times[impl].append(seconds)
            print(name, rnd, {k: round(v[-1], 4) for k, v in times.items() if v}, flush=True)
        medians = {impl: statistics.median(t) for impl, t in times.items()}
        results[name] = {
            "model_type": entry["model_type"],
            "median_step_s": medians,
            "ratio_to_grouped_mm": {k: v / medians["grouped_mm"] for k, v in medians.items()},
            "fastest": min(medians, key=medians.get),
            "seconds": times,
        }
    report = {
        "models": results,
        "batch": [batch_size, args.seq],
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(name, {k: round(v, 4) for k, v in r["median_step_s"].items()}, "->", r["fastest"])
    return report


if __name__ == "__main__":
    main()
