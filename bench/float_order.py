"""Does a change of float reduction order change what a run trains?

Two post-trainings of the same base, method, data order and seed that differ only in torch's
thread count (1 vs 2: the reductions inside matmuls split differently, as on another CPU). If the
trained weights differ, the thread count is a valid stand-in for "another machine" in the
verdict-stability comparison of docs/claims.md; if they were bitwise equal it would not be.

    python bench/float_order.py --base results/models/tinyA/base0/model \
        --corpus results/data/post/math.jsonl      # -> bench/results/float_order.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from rpb.method_config import MethodConfig
from rpb.pipeline.training import TrainSpec, posttrain


def train(base: Path, corpus: Path, threads: int, steps: int, out: Path) -> dict[str, torch.Tensor]:
    spec = TrainSpec(steps=steps, batch_size=64, lr=1e-3, max_length=48, seed=0, threads=threads)
    posttrain(
        base_dir=base,
        prior_path=None,
        corpus=corpus,
        method=MethodConfig("none"),
        spec=spec,
        out_dir=out,
    )
    return load_file(str(out / "model" / "model.safetensors"))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "float_order.json"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        one = train(args.base, args.corpus, 1, args.steps, Path(tmp) / "t1")
        two = train(args.base, args.corpus, 2, args.steps, Path(tmp) / "t2")
    diffs = {k: (one[k].double() - two[k].double()).abs().max().item() for k in one}
    result = {
        "steps": args.steps,
        "tensors": len(diffs),
        "tensors_that_differ": sum(d > 0 for d in diffs.values()),
        "max_abs_weight_difference": max(diffs.values()),
        "bitwise_equal": all(d == 0 for d in diffs.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
