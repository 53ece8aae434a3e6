"""Where a post-training step's time goes, and whether it can be had cheaper (docs/regime.md,
"After the confirmation").

Per tiny base (tinyA, tinyB: the pretrained seed-0 bases; one torch thread; the default config's
post-training batch and length), in one invocation:

- `trainer_step_ms`: the pipeline's own post-training path (`rpb.pipeline.training.posttrain`,
`none`,   the base's prior attached for the drift statistics) at the regime's S = 800 steps: its
whole   wall time (load, tokenisation, Trainer) per step, as a run pays it;
- `bare_step_ms`: the same model, batches and optimiser (fused AdamW, gradient clipping at 1.0,
  as the Trainer has them) in a plain loop: what is left without the Trainer, callbacks and
  tracking;
- `compiled_step_ms` and `compile_s`: the plain loop with `torch.compile(dynamic=True)`, after
  its warm-up, and the warm-up's seconds (paid by every run: each run is its own process);
- `op_share`: the share of the plain loop's CPU time in each of the five costliest aten ops
  (torch.profiler), and `mm_share` for matrix products alone.

    .venv/bin/python bench/step_cost.py      # -> bench/results/step_cost.json (~10 min)

Needs the bases and their priors on `math`: `snakemake --cores 2
results/priors/tinyA/base0/math.safetensors results/priors/tinyB/base0/math.safetensors`.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from router_drift_map import pipeline_settings  # bench/, beside this script
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

from rpb.method_config import MethodConfig
from rpb.pipeline.training import (
    RightPadCollator,
    TrainSpec,
    posttrain,
    tokenize_prompt_completion,
)

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = pipeline_settings()  # batch_size, max_length as the pipeline post-trains


def trainer_step_ms(base: Path, prior: Path, corpus: Path, steps: int, lr: float) -> float:
    spec = TrainSpec(
        steps=steps,
        batch_size=SETTINGS["batch_size"],
        lr=lr,
        max_length=SETTINGS["max_length"],
        seed=0,
        log_every=steps,
    )
    with tempfile.TemporaryDirectory(prefix="rpb-stepcost-") as tmp:
        for attempt in ("untimed", "timed"):  # the first pays imports and first-call set-up
            start = time.perf_counter()
            posttrain(
                base_dir=base,
                prior_path=prior,
                corpus=corpus,
                method=MethodConfig("none"),
                spec=spec,
                out_dir=Path(tmp) / attempt,
                save_model=False,
            )
    return (time.perf_counter() - start) / steps * 1000


def bare_loop(base: Path, corpus: Path, steps: int, lr: float, compiled: bool) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    data = tokenize_prompt_completion(corpus, tokenizer, SETTINGS["max_length"])
    collate = RightPadCollator(tokenizer.pad_token_id)
    n, size = len(data), SETTINGS["batch_size"]  # cycled, as the Trainer runs epochs
    batches = [
        collate([data[i % n] for i in range(j * size, (j + 1) * size)]) for j in range(steps + 10)
    ]
    # The Trainer's optimiser on the CPU (TrainingArguments' default optim adamw_torch_fused).
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    forward = torch.compile(model, dynamic=True) if compiled else model

    def step(batch: dict) -> None:
        forward(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    start = time.perf_counter()
    for batch in batches[:10]:
        step(batch)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    for batch in batches[10:]:
        step(batch)
    out = {"step_ms": (time.perf_counter() - start) / steps * 1000, "warmup_s": warmup}
    if not compiled:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for batch in batches[10:30]:
                step(batch)
        rows = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        out["op_share"] = {e.key: round(e.self_cpu_time_total / total, 3) for e in rows[:5]}
        out["mm_share"] = round(
            sum(e.self_cpu_time_total for e in rows if e.key in ("aten::mm", "aten::bmm")) / total,
            3,
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/step_cost.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = args.results
    corpus = results / "data" / "post" / "math.jsonl"
    report = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "steps": args.steps,
        "models": {},
    }
    for name in ("tinyA", "tinyB"):
        base = results / "models" / name / "base0" / "model"
        prior = results / "priors" / name / "base0" / "math.safetensors"
        row = {"trainer_step_ms": trainer_step_ms(base, prior, corpus, args.steps, args.lr)}
        eager = bare_loop(base, corpus, args.steps, args.lr, compiled=False)
        compiled = bare_loop(base, corpus, args.steps, args.lr, compiled=True)
        row |= {
            "bare_step_ms": eager["step_ms"],
            "op_share": eager["op_share"],
            "mm_share": eager["mm_share"],
            "compiled_step_ms": compiled["step_ms"],
            "compile_s": compiled["warmup_s"],
        }
        row["trainer_overhead_share"] = 1 - row["bare_step_ms"] / row["trainer_step_ms"]
        row["compiled_over_bare"] = row["compiled_step_ms"] / row["bare_step_ms"]
        report["models"][name] = row
        print(name, json.dumps(row, indent=1))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
