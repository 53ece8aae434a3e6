"""Training-step overhead of each router method relative to `none`, at two sizes.

One process; methods are attached in turn and timed round-robin (rotating the order every round),
so machine-load drift hits every method alike. The reported ratio is the median over rounds of
(method step time / `none` step time in the same round).

- `model`: a random mid-size qwen3_moe model (hidden 256, 4 layers, 32 experts top-4, 8 x 256
  tokens); a step is forward + router term + backward + AdamW step (+ on_step_end).
- `qwen3_30b_a3b_layer`: ONE MoE layer (router + experts, no attention) at Qwen3-30B-A3B's
  proportions: 128 experts, hidden 2048, top-8, expert width 768; bf16 where the CPU has bf16
  instructions, else fp32. A step is forward + router term + backward (+ on_step_end): no
  optimizer, whose cost does not depend on the method and would hide the router's share.

    python bench/overhead.py            # both -> bench/results/overhead.json (minutes)
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
from types import SimpleNamespace

import torch

from rpb.architectures import random_model
from rpb.methods import METHODS, make_method
from rpb.prior import extract_prior

QUICK = {"hidden": 64, "layers": 2, "experts": 8, "top_k": 2, "batch": 2, "seq": 32, "repeats": 3}
# Qwen3-30B-A3B (its config.json): hidden 2048, 128 experts, 8 per token, moe_intermediate 768.
QWEN3_30B_A3B = {"hidden": 2048, "experts": 128, "top_k": 8, "expert_width": 768}
QUICK_LAYER = {"hidden": 128, "experts": 16, "top_k": 4, "expert_width": 48}


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
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overhead.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check that it runs")
    p.add_argument(
        "--only", choices=["model", "qwen3_30b_a3b_layer"], help="run one benchmark, keep the other"
    )
    p.add_argument("--layer-tokens", type=int, default=1024, help="tokens per layer step (b x s)")
    p.add_argument("--layer-repeats", type=int, default=15)
    args = p.parse_args(argv)
    args.layer = dict(QWEN3_30B_A3B)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.layer, args.layer_tokens, args.layer_repeats = dict(QUICK_LAYER), 64, 2
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


class MoELayer(torch.nn.Module):
    """One qwen3_moe MoE block (router + experts) behind a token embedding, as a causal LM would
    hold it; its loss is the mean square of the block's output (the methods' terms are added)."""

    def __init__(self, config, vocab: int):
        super().__init__()
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        self.config = config  # the prior records and checks its model_type
        self.embed = torch.nn.Embedding(vocab, config.hidden_size)
        self.mlp = Qwen3MoeSparseMoeBlock(config)

    def forward(self, input_ids, attention_mask=None, labels=None, use_cache=None):
        out = self.mlp(self.embed(input_ids))
        return SimpleNamespace(loss=out.float().pow(2).mean())


def build_layer(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.dtype]:
    from rpb.architectures import build_config

    sizes = args.layer
    config = build_config(
        "qwen3_moe",
        hidden_size=sizes["hidden"],
        moe_intermediate_size=sizes["expert_width"],
        num_experts=sizes["experts"],
        num_experts_per_tok=sizes["top_k"],
        vocab_size=args.vocab,
    )
    # Outside a PreTrainedModel nobody picks the experts kernel: transformers' default.
    config._experts_implementation = "grouped_mm"
    dtype = torch.bfloat16 if _cpu_has_bf16() else torch.float32
    torch.manual_seed(0)
    layer = MoELayer(config, args.vocab)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, sizes["hidden"] ** -0.5)
    return layer.to(dtype), dtype


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def time_step(model, method, optimizer, batch) -> tuple[float, float]:
    """Wall and CPU seconds of one step. With one torch thread the CPU time is what the step
    costs whatever else the machine runs; the wall time also counts waiting for a core."""
    start, start_cpu = time.perf_counter(), time.process_time()
    out = model(**batch, use_cache=False)
    loss = out.loss + method.router_loss(attention_mask=batch["attention_mask"])
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    method.on_step_end()
    return time.perf_counter() - start, time.process_time() - start_cpu


def _batch(vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids.clone(),
    }


def _interval(values: list[float]) -> list[float]:
    from rpb.report.stats import t_interval

    mean, low, high, _ = t_interval(values)
    return [float(mean), float(low), float(high)]


def round_robin(model, optimizer, batch, methods, warmup: int, repeats: int) -> dict:
    """Median step CPU time and median per-round ratio to `none` of every method (wall times
    beside them)."""
    prior = extract_prior(
        model, [batch], model_id="random", revision="0", corpus_hash="bench", progress=False
    )
    model.train()
    times: dict[str, list[float]] = {m: [] for m in methods}
    walls: dict[str, list[float]] = {m: [] for m in methods}
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    wall_ratios: dict[str, list[float]] = {m: [] for m in methods}
    order = list(methods)
    for rnd in range(warmup + repeats):
        shift = rnd % len(order)
        this_round = {}
        for name in order[shift:] + order[:shift]:
            with make_method(name).attach(model, prior) as method:
                this_round[name] = time_step(model, method, optimizer, batch)
        if rnd >= warmup:
            for name, (wall, cpu) in this_round.items():
                times[name].append(cpu)
                walls[name].append(wall)
                ratios[name].append(cpu / this_round["none"][1])
                wall_ratios[name].append(wall / this_round["none"][0])
        print(f"round {rnd}: " + ", ".join(f"{k} {v[1]:.3f}s" for k, v in this_round.items()))
    return {
        "ratio_to_none": {m: statistics.median(r) for m, r in ratios.items()},
        # The mean per-round ratio and its 95% t-interval over rounds: a method is shown within a
        # target only if the interval's upper end is (the median alone cannot say that).
        "ratio_interval_95": {m: _interval(r) for m, r in ratios.items()},
        "worst_ratio": max(statistics.median(r) for r in ratios.values()),
        "median_seconds": {m: statistics.median(t) for m, t in times.items()},
        "seconds": times,
        "timing": "CPU seconds per step (time.process_time, one torch thread)",
        "wall_ratio_to_none": {m: statistics.median(r) for m, r in wall_ratios.items()},
        "wall_seconds": walls,
    }


def bench_model(args: argparse.Namespace) -> dict:
    model = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _batch(args.vocab, args.batch, args.seq)
    result = round_robin(model, optimizer, batch, args.methods, args.warmup, args.repeats)
    keys = ("hidden", "layers", "experts", "top_k", "batch", "seq", "vocab")
    result["config"] = {k: getattr(args, k) for k in keys} | {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "step": "forward + router term + backward + AdamW",
    }
    return result


def bench_layer(args: argparse.Namespace) -> dict:
    layer, dtype = build_layer(args)
    seq = min(args.layer_tokens, 256)
    batch = _batch(args.vocab, max(1, args.layer_tokens // seq), seq)
    result = round_robin(layer, None, batch, args.methods, args.warmup, args.layer_repeats)
    result["config"] = dict(args.layer) | {
        "batch": int(batch["input_ids"].shape[0]),
        "seq": seq,
        "dtype": str(dtype).removeprefix("torch."),
        "experts_implementation": "grouped_mm",
        "repeats": args.layer_repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "step": "forward + router term + backward (no optimizer)",
    }
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    previous = json.loads(args.out.read_text()) if args.only and args.out.is_file() else {}
    result = dict(previous)
    if args.only in (None, "model"):
        result.update(bench_model(args))
    if args.only in (None, "qwen3_30b_a3b_layer"):
        result["qwen3_30b_a3b_layer"] = bench_layer(args)
    result["machine"] = {
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"model": result.get("ratio_to_none")}, indent=2))
    print(
        json.dumps(
            {"qwen3_30b_a3b_layer": result.get("qwen3_30b_a3b_layer", {}).get("ratio_to_none")},
            indent=2,
        )
    )
    return result


if __name__ == "__main__":
    main()
