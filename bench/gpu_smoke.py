"""GPU smoke test at paper size: one training step per router method on a real-size layer slice.

For each paper model (config/paper.yaml), a random-weight slice with the real hidden size, expert
count, top-k, expert width and attention, but only 2 MoE decoder layers (plus Moonlight's dense
first layer) and a 32k vocabulary, in bf16 on one GPU with gradient checkpointing, at the paper's
per-GPU batch (posttrain.batch_size x max_length). Every method is attached in turn to the same
model and timed round-robin (the order rotates each round); a step is forward + router term +
backward + AdamW step. Prints step time, peak memory and the ratio to `none`; writes
bench/results/gpu_smoke.json. Sized to finish well within 8 minutes on one H200.

    python bench/gpu_smoke.py            # on a GPU machine
    python bench/gpu_smoke.py --tiny     # CPU, small sizes, seconds: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoModelForCausalLM

from rpb.architectures import build_config
from rpb.methods import METHODS, make_method
from rpb.prior import extract_prior
from rpb.routing import find_routers

ROOT = Path(__file__).resolve().parents[1]
# Keys build_config does not take for a family but the real model sets (applied afterwards).
POST_KEYS = {"qwen3_moe": ("head_dim",)}
# --tiny: shrink widths, keep the real expert counts and top-k (what the methods act on).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "config" / "paper.yaml")
    p.add_argument("--models", nargs="+", default=None, help="keys of models (default: all)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--moe-layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=None, help="default: posttrain.batch_size")
    p.add_argument("--seq", type=int, default=None, help="default: posttrain.max_length")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per method")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--steady",
        type=int,
        default=0,
        help="untimed steps after each attach before the timed step (0: time the first step "
        "after attaching the method's hooks)",
    )
    p.add_argument("--no-checkpointing", action="store_true", help="no gradient checkpointing")
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/gpu_smoke.json")
    p.add_argument("--tiny", action="store_true", help="CPU, small widths, seconds")
    args = p.parse_args(argv)
    posttrain = yaml.safe_load(args.config.read_text())["posttrain"]
    # The paper's per-GPU batch and sequence length: activations match one FSDP rank's.
    args.batch = args.batch or posttrain["batch_size"]
    args.seq = args.seq or posttrain["max_length"]
    if args.tiny:
        args.vocab, args.batch, args.seq, args.repeats = 256, 2, 32, 1
    name = "gpu_smoke_tiny.json" if args.tiny else "gpu_smoke.json"
    args.out = args.out or ROOT / "bench" / "results" / name
    if "none" not in args.methods:
        args.methods = ["none", *args.methods]
    return args


def slice_config(entry: dict[str, Any], args: argparse.Namespace):
    """The model's own config with only depth and vocabulary cut (and widths, with --tiny)."""
    model_type = entry["model_type"]
    arch = dict(entry["architecture"])
    if args.tiny:
        mha = arch.get("num_key_value_heads") == arch.get("num_attention_heads")  # MLA needs it
        arch.update({k: v for k, v in TINY.items() if k in arch})
        if mha:
            arch["num_key_value_heads"] = arch["num_attention_heads"]
    post = {k: arch.pop(k) for k in POST_KEYS.get(model_type, ()) if k in arch}
    arch["num_hidden_layers"] = arch.get("first_k_dense_replace", 0) + args.moe_layers
    arch["vocab_size"] = args.vocab
    arch["max_position_embeddings"] = max(arch.get("max_position_embeddings", 0), args.seq)
    config = build_config(model_type, **arch, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    for key, value in post.items():
        setattr(config, key, value)
    return config


def build_model(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights made on the device; routers redrawn so routing is far from uniform."""
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for h in find_routers(model):
            h.module.weight.normal_(0.0, 1.0 / math.sqrt(config.hidden_size))
            bias = h.correction_bias
            if bias is not None:
                bias.normal_(0.0, 0.05)
    return model


def make_batch(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, args.seq // 2 :] = 0  # one half-padded row: masks are exercised
    labels = ids.masked_fill(mask == 0, -100)
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask}.items()} | {
        "labels": labels.to(device)
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model, method, optimizer, batch, device) -> tuple[float, float]:
    """One training step; (seconds, peak GiB allocated during it; 0 on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    out = model(**batch, use_cache=False)
    loss = out.loss + method.router_loss(attention_mask=batch["attention_mask"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.on_step_end()
    _sync(device)
    seconds = time.perf_counter() - start
    value = float(loss.detach())
    if not math.isfinite(value):
        raise RuntimeError(f"{method.name}: non-finite loss {value}")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return seconds, peak


def run_model(name: str, entry: dict[str, Any], args, device, dtype) -> dict[str, Any]:
    config = slice_config(entry, args)
    t0 = time.perf_counter()
    model = build_model(config, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    batch = make_batch(args, device)
    prior = extract_prior(
        model,
        [{k: batch[k] for k in ("input_ids", "attention_mask")}],
        model_id=name,
        revision="random",
        corpus_hash="0" * 64,
        progress=False,
    )
    model.train()
    if not args.no_checkpointing:
        # Non-reentrant by default in transformers 5 (router terms keep their gradient).
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    methods = {m: make_method(m) for m in args.methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, float] = dict.fromkeys(methods, 0.0)
    order = list(methods)
    for round_ in range(args.warmup + args.repeats):
        shift = round_ % len(order)
        for label in order[shift:] + order[:shift]:
            method = methods[label].attach(model, prior)
            try:
                for _ in range(args.steady):  # steady state: hooks attached, caches warm
                    step(model, method, optimizer, batch, device)
                seconds, peak = step(model, method, optimizer, batch, device)
            finally:
                method.detach()
            if round_ >= args.warmup:
                times[label].append(seconds)
                peaks[label] = max(peaks[label], peak)
    base = statistics.median(times["none"])
    rows = {
        label: {
            "step_s": statistics.median(ts),
            "ratio_to_none": statistics.median(ts) / base,
            "peak_gib": peaks[label],
        }
        for label, ts in times.items()
    }
    routers = find_routers(model)
    result = {
        "model": name,
        "model_type": entry["model_type"],
        "params": n_params,
        "layers": config.num_hidden_layers,
        "moe_layers": len(routers),
        "experts": routers[0].num_experts,
        "top_k": routers[0].top_k,
        "hidden": config.hidden_size,
        "setup_s": None,
        "methods": rows,
    }
    result["setup_s"] = round(time.perf_counter() - t0 - sum(sum(t) for t in times.values()), 1)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paper = yaml.safe_load(args.config.read_text())
    names = args.models or list(paper["models"])
    if args.tiny or not torch.cuda.is_available():
        if not args.tiny:
            raise SystemExit("gpu_smoke: no CUDA device; use --tiny for a CPU check")
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    started = time.perf_counter()
    results = []
    for name in names:
        res = run_model(name, paper["models"][name], args, device, dtype)
        results.append(res)
        print(
            f"\n{name} ({res['model_type']}): {res['params'] / 1e9:.2f}B params, "
            f"{res['moe_layers']} MoE layers x {res['experts']} experts top-{res['top_k']}, "
            f"hidden {res['hidden']}, batch {args.batch} x {args.seq} tokens, "
            f"setup {res['setup_s']} s"
        )
        print(f"{'method':<15}{'step s':>10}{'x none':>9}{'peak GiB':>11}")
        for label, row in res["methods"].items():
            print(
                f"{label:<15}{row['step_s']:>10.3f}{row['ratio_to_none']:>9.2f}"
                f"{row['peak_gib']:>11.2f}"
            )
    payload = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "total_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\ntotal {payload['total_s']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
