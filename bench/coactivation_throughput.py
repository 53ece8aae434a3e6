"""Throughput of co-activation counting (tokens/s, one CPU thread).

Compares the two vectorised counting schemes the design considered and records the one
``rpb.coactivation.CoactivationCounter`` uses:
- ``bincount``: pair ids ``i * E + j`` of every (i, j) in a token's top-k, counted with
  ``torch.bincount`` in cache-sized chunks (the library's implementation);
- ``matmul``: multi-hot ``M [T, E]`` and ``M^T M`` (float32, exact below 2^24 per entry).

Usage: python bench/coactivation_throughput.py [--tokens N] [--out bench/results/coactivation.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from rpb.coactivation import CoactivationCounter
from rpb.numerics import cpu_model

TARGET_TOKENS_PER_S = 1_000_000
CONFIGS = [(128, 8), (16, 2)]  # (E, k): Qwen3-30B-A3B scale, tiny testbed scale


def _matmul_counts(idx: torch.Tensor, e: int, chunk: int) -> torch.Tensor:
    total = torch.zeros(e, e, dtype=torch.int64)
    for c in idx.split(chunk):
        m = torch.zeros(c.shape[0], e).scatter_(1, c, 1.0)
        total += (m.T @ m).round().long()
    return total


def _best_rate(fn, n_tokens: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n_tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/coactivation.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    results = []
    for e, k in CONFIGS:
        gen = torch.Generator().manual_seed(0)
        idx = torch.rand(args.tokens, e, generator=gen).topk(k, dim=1).indices
        counter = CoactivationCounter(1, e)
        counter.update(0, idx)
        # Both schemes must agree exactly before their speed means anything.
        assert torch.equal(counter.counts[0], _matmul_counts(idx, e, 4096)), (e, k)
        row = {
            "n_experts": e,
            "top_k": k,
            "tokens_per_batch": args.tokens,
            "bincount_tokens_per_s": _best_rate(
                lambda idx=idx, c=counter: c.update(0, idx), args.tokens, args.repeats
            ),
        }
        for chunk in (4096, 65536):
            row[f"matmul_chunk{chunk}_tokens_per_s"] = _best_rate(
                lambda idx=idx, e=e, chunk=chunk: _matmul_counts(idx, e, chunk),
                args.tokens,
                args.repeats,
            )
        row["meets_target"] = row["bincount_tokens_per_s"] >= TARGET_TOKENS_PER_S
        results.append(row)
        print(json.dumps(row))

    report = {
        "benchmark": "co-activation counting throughput",
        "implementation": "bincount over pair ids, 4096-token chunks (CoactivationCounter)",
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
