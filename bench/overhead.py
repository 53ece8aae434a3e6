"""Training-step overhead of each router method relative to `none`.

One process, one random qwen3_moe model; methods are attached in turn and timed round-robin
(rotating the order every round), so machine-load drift hits every method alike. A step is
forward + router term + backward + AdamW step (+ on_step_end). The reported ratio is the median
over rounds of (method step time / `none` step time in the same round).

    python bench/overhead.py            # hidden 256, 4 layers, 32 experts top-4, 8 x 256 tokens
    python bench/overhead.py --quick    # seconds, to check that it runs
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

from rpb.architectures import random_model
from rpb.methods import METHODS, make_method
from rpb.prior import extract_prior

QUICK = {"hidden": 64, "layers": 2, "experts": 8, "top_k": 2, "batch": 2, "seq": 32, "repeats": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", dest="top_k", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per method")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overhead.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check that it runs")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if "none" not in args.methods:
        args.methods = ["none", *args.methods]
    return args


def build(args: argparse.Namespace) -> torch.nn.Module:
    heads = max(1, args.hidden // 64)
    return random_model(
        "qwen3_moe",
        seed=0,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=max(8, args.hidden * 3 // 8),  # Qwen3-30B-A3B's 768 / 2048
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=max(128, args.seq),
    )


def time_step(model, method, optimizer, batch) -> float:
    start = time.perf_counter()
    out = model(**batch, use_cache=False)
    loss = out.loss + method.router_loss(attention_mask=batch["attention_mask"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.on_step_end()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids.clone(),
    }
    prior = extract_prior(
        model, [batch], model_id="random", revision="0", corpus_hash="bench", progress=False
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    ratios: dict[str, list[float]] = {m: [] for m in args.methods}
    order = list(args.methods)
    for rnd in range(args.warmup + args.repeats):
        shift = rnd % len(order)
        this_round = {}
        for name in order[shift:] + order[:shift]:
            with make_method(name).attach(model, prior) as method:
                this_round[name] = time_step(model, method, optimizer, batch)
        if rnd >= args.warmup:
            for name, t in this_round.items():
                times[name].append(t)
                ratios[name].append(t / this_round["none"])
        print(f"round {rnd}: " + ", ".join(f"{k} {v:.3f}s" for k, v in this_round.items()))
    result = {
        "ratio_to_none": {m: statistics.median(r) for m, r in ratios.items()},
        "median_seconds": {m: statistics.median(t) for m, t in times.items()},
        "seconds": times,
        "config": {
            k: getattr(args, k)
            for k in ("hidden", "layers", "experts", "top_k", "batch", "seq", "vocab")
        }
        | {"repeats": args.repeats, "warmup": args.warmup, "quick": args.quick},
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratio_to_none"], indent=2))
    return result


if __name__ == "__main__":
    main()
