"""The GPU checks of issue 46 in one command: what a CPU cannot show, measured and recorded.

On one GPU (under 5 minutes), writes bench/results/gpu_check.json with:

- `equivalence`: 30 AdamW steps (fixed seed and data) of a tiny random model of each family
  (qwen3_moe, deepseek_v3, mixtral, olmoe) under each method (none, lbl, rpb, rpb_adaptive,
  anchor_kl, hard), CPU fp32 against CUDA fp32 (TF32 off): the largest relative difference of the
  task loss over the steps; and the same run in CUDA bf16 stays finite;
- `trainer`: rpb.trainer.RouterMethodTrainer on CUDA (bf16), a few steps of a tiny model;
- `fsdp`: the Trainer under FSDP2 through `accelerate launch --config_file
  config/accelerate/fsdp.yaml --num_processes 1` (this script's `--fsdp-worker`): the parameters
  are sharded DTensors, the steps finite, the gathered final model (`_save_model`'s) reloads
  with `from_pretrained` to the trained weights, and a run stopped at half its steps with a
  sharded checkpoint resumes to the uninterrupted weights (within 1e-5);
- `syncs`: host-device synchronisations in one profiled training step of each method
  (`cudaStreamSynchronize` + `cudaDeviceSynchronize` events of torch.profiler), minus none's, at
  most the method's own allowance (`RouterMethod.host_waits_per_moe_layer` x MoE layers, as in
  tests/test_no_sync.py);
- `overhead` (last, the longest): step time of each method over none's on bench/gpu_smoke.py's
  paper-width slices (Moonlight: deepseek_v3 64 experts top-6; Qwen3: qwen3_moe 128 experts
  top-8), 4 MoE layers, bf16, batch 8 x 1024, each timed step a steady one (`--overhead-steady`
  untimed steps after attaching the method first).

The record is written after each check (`complete: false` until the last): a run stopped by a
timeout keeps the checks that finished.

`--cpu` runs the CPU half at a small size in well under a minute: equivalence becomes determinism
(two identical CPU runs give identical bits), the Trainer runs on the CPU, the overhead table uses
gpu_smoke's tiny widths, and syncs are counted by tests/test_no_sync.py's dispatch-mode recorder.

    python bench/gpu_check.py                      # on a GPU machine
    python bench/gpu_check.py --cpu --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import hashlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import transformers
import yaml

from rpb.architectures import random_model
from rpb.methods import METHODS, make_method
from rpb.numerics import cpu_model
from rpb.prior import RouterPrior, extract_prior

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "olmoe")
CHECK_METHODS = ("none", "lbl", "rpb", "rpb_adaptive", "anchor_kl", "hard")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")
# The host waits a method makes on purpose come from the method itself
# (`RouterMethod.host_waits_per_moe_layer`: lbl's sequence-wise loss on DeepSeek-V3, 2 per MoE
# layer), the one allowance tests/test_no_sync.py applies too.
LR = 1e-3
VOCAB = 64  # rpb.architectures' tiny vocabulary
BATCH, SEQ, PAD = 4, 16, 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU half only, small sizes")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default bench/results/gpu_check.json (--cpu: gpu_check_cpu.json, so a CPU run "
        "never replaces a GPU record)",
    )
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    p.add_argument("--methods", nargs="+", default=list(CHECK_METHODS), choices=list(METHODS))
    p.add_argument("--steps", type=int, default=None, help="equivalence steps (30; --cpu: 6)")
    p.add_argument("--rtol", type=float, default=1e-3, help="CPU vs CUDA task-loss tolerance")
    p.add_argument("--trainer-steps", type=int, default=4)
    p.add_argument("--overhead-repeats", type=int, default=3, help="timed rounds per method")
    p.add_argument(
        "--overhead-steady",
        type=int,
        default=2,
        help="untimed steps after each attach before the timed one (a steady step, not the "
        "first after attaching the hooks)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny models)")
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["equivalence", "trainer", "fsdp", "overhead", "syncs"],
    )
    p.add_argument("--fsdp-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = args.steps or (6 if args.cpu else 30)
    if args.out is None:
        name = "gpu_check_cpu.json" if args.cpu else "gpu_check.json"
        args.out = ROOT / "bench" / "results" / name
    if "none" not in args.methods:
        args.methods = ["none", *args.methods]
    return args


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _load_bench(name: str) -> ModuleType:
    """A sibling bench script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- data and tiny models


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    """Random ids with a right-padded last row (the masks are exercised) and LM labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, SEQ - PAD :] = 0
    ids[-1, SEQ - PAD :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@functools.cache
def family_base(model_type: str) -> tuple[torch.nn.Module, RouterPrior]:
    """tests/family_models.py's tiny base of `model_type` (fp32, CPU) and its router prior."""
    base = random_model(model_type, seed=0)
    prior = extract_prior(
        base,
        [make_batch(1000 + s) for s in range(2)],
        model_id="tiny",
        revision="r0",
        corpus_hash="0",
        progress=False,
    )
    return base, prior


def _count_syncs(prof: Any) -> dict[str, int]:
    counts = Counter(e.name for e in prof.events() if e.name in SYNC_EVENTS)
    return {name: counts.get(name, 0) for name in SYNC_EVENTS}


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_run(
    model_type: str,
    method_name: str,
    device: torch.device,
    dtype: torch.dtype,
    steps: int,
    profile_step: int | None = None,
) -> dict[str, Any]:
    """`steps` AdamW steps of the family's tiny base under a method. Losses stay on the device
    until the end, so a step makes no wait of ours; with `profile_step`, that step (warm caches
    by then) runs under torch.profiler and its sync events are counted."""
    base, prior = family_base(model_type)
    model = copy.deepcopy(base).to(device=device, dtype=dtype).train()
    batches = [{k: v.to(device) for k, v in make_batch(s).items()} for s in range(steps)]
    torch.manual_seed(0)
    method = make_method(method_name).attach(model, prior)
    moe_layers = method.control.num_layers
    allowed_per_layer = method.host_waits_per_moe_layer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    task: list[torch.Tensor] = []
    router: list[torch.Tensor] = []
    syncs: dict[str, int] | None = None
    try:
        for step, batch in enumerate(batches):
            profiling = step == profile_step
            with contextlib.ExitStack() as stack:
                if profiling:
                    from torch.profiler import ProfilerActivity, profile

                    acts = [ProfilerActivity.CPU]
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # earlier steps' work is not this step's
                        acts.append(ProfilerActivity.CUDA)
                    prof = stack.enter_context(profile(activities=acts))
                method.set_progress(step, steps)
                out = model(**batch)
                term = method.router_loss(attention_mask=batch["attention_mask"])
                (out.loss + term).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                method.on_step_end()
            if profiling:
                syncs = _count_syncs(prof)
            task.append(out.loss.detach().float())
            router.append(term.detach().float())
    finally:
        method.detach()
    result = {
        "task_loss": torch.stack(task).cpu().double().tolist(),
        "router_loss": torch.stack(router).cpu().double().tolist(),
        "digest": _digest(model),
    }
    if syncs is not None:
        result["syncs"] = syncs
        result["moe_layers"] = moe_layers
        result["allowed_syncs_per_moe_layer"] = allowed_per_layer
    return result


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _max_abs(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- checks


def _equivalence_row(
    args: argparse.Namespace, family: str, name: str, cuda: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One family and method: its row, and (on CUDA) its profiled syncs."""
    cpu = torch.device("cpu")
    ref = train_run(family, name, cpu, torch.float32, args.steps)
    row: dict[str, Any] = {"task_loss_first_last": [ref["task_loss"][0], ref["task_loss"][-1]]}
    if not cuda:
        other = train_run(family, name, cpu, torch.float32, args.steps)
        row["identical_losses"] = (
            other["task_loss"] == ref["task_loss"] and other["router_loss"] == ref["router_loss"]
        )
        row["identical_weights"] = other["digest"] == ref["digest"]
        row["finite"] = all(map(math.isfinite, ref["task_loss"] + ref["router_loss"]))
        row["passed"] = row["identical_losses"] and row["identical_weights"] and row["finite"]
        return row, None
    gpu = torch.device("cuda")
    other = train_run(family, name, gpu, torch.float32, args.steps, profile_step=2)
    bf16 = train_run(family, name, gpu, torch.bfloat16, args.steps)
    row["task_loss_max_rel_diff"] = _max_rel(other["task_loss"], ref["task_loss"])
    row["router_loss_max_abs_diff"] = _max_abs(other["router_loss"], ref["router_loss"])
    row["bf16_finite"] = all(map(math.isfinite, bf16["task_loss"] + bf16["router_loss"]))
    row["bf16_task_loss_last"] = bf16["task_loss"][-1]
    row["passed"] = row["task_loss_max_rel_diff"] <= args.rtol and row["bf16_finite"]
    keys = ("syncs", "moe_layers", "allowed_syncs_per_moe_layer")
    return row, {k: other[k] for k in keys}


def check_equivalence(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """CPU fp32 vs CUDA fp32 (+ a finite bf16 CUDA run); with --cpu, CPU vs a CPU repeat. A
    pair that raises is recorded as failed with its error; the other pairs still run."""
    results: dict[str, dict[str, Any]] = {}
    syncs: dict[str, dict[str, Any]] = {}
    for family in args.families:
        results[family], syncs[family] = {}, {}
        for name in args.methods:
            start = time.perf_counter()
            try:
                row, profiled = _equivalence_row(args, family, name, cuda)
            except Exception as exc:
                row, profiled = {"passed": False, "error": repr(exc)}, None
            if profiled is not None:
                syncs[family][name] = profiled
            row["seconds"] = round(time.perf_counter() - start, 2)
            results[family][name] = row
            if "error" in row:
                shown = f"FAILED: {row['error']}"
            elif cuda:
                diff = row["task_loss_max_rel_diff"]
                shown = f"max rel diff {diff:.2e}, bf16 finite {row['bf16_finite']}"
            else:
                shown = f"identical {row['identical_losses'] and row['identical_weights']}"
            log(f"equivalence {family:<12} {name:<13} {shown} ({row['seconds']} s)")
    rows = [r for fam in results.values() for r in fam.values()]
    out = {
        "passed": all(r["passed"] for r in rows),
        "kind": "cpu_fp32_vs_cuda_fp32" if cuda else "cpu_repeat_determinism",
        "steps": args.steps,
        "optimizer": f"AdamW lr {LR}",
        "batch": f"{BATCH} x {SEQ}, last row {PAD} padded",
        "rtol": args.rtol if cuda else 0.0,
        "results": results,
    }
    if cuda:
        diffs = [r["task_loss_max_rel_diff"] for r in rows if "task_loss_max_rel_diff" in r]
        out["worst_task_loss_rel_diff"] = max(diffs, default=None)
    # Only families whose every method was profiled: the excess is over none's of the same family.
    complete = {f: m for f, m in syncs.items() if m.keys() == set(args.methods)}
    return out | {"_syncs": complete}


def syncs_from_profiles(raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per family and method: profiled sync events of one step, and the excess over none's."""
    results: dict[str, dict[str, Any]] = {}
    passed = True
    for family, methods in raw.items():
        baseline = sum(methods["none"]["syncs"].values())
        results[family] = {}
        for name, entry in methods.items():
            total = sum(entry["syncs"].values())
            layers = entry["moe_layers"] or 0
            allowed = entry["allowed_syncs_per_moe_layer"] * layers
            extra = total - baseline
            ok = extra <= allowed
            passed &= ok
            results[family][name] = entry["syncs"] | {
                "per_step": total,
                "extra_over_none": extra,
                "allowed_extra": allowed,
                "passed": ok,
            }
            log(f"syncs {family:<12} {name:<13} {total} per step, {extra:+d} over none")
    return {
        "passed": passed,
        "kind": "torch.profiler: " + " + ".join(SYNC_EVENTS) + " in step 3 of the CUDA fp32 run",
        "results": results,
    }


def syncs_by_recorder(args: argparse.Namespace) -> dict[str, Any]:
    """--cpu: tests/test_no_sync.py's dispatch-mode recorder plays a GPU step on the CPU."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_no_sync  # the recorder and its step (needs pytest and the test helpers)
    except Exception as exc:  # an install without the tests: skip, say why
        return {"passed": None, "skipped": f"tests/test_no_sync.py not importable: {exc!r}"}
    finally:
        sys.path.remove(str(ROOT / "tests"))
    results: dict[str, dict[str, Any]] = {}
    passed = True
    for arch in ("deepseek_v3", "qwen3_moe"):  # test_no_sync's unit-tier models
        results[arch] = {}
        baseline = len(test_no_sync._step_events(arch, "none", {}))
        n_layers = len(test_no_sync._base_and_prior(arch)[1].base_weights)
        for name in args.methods:
            events, per_layer = test_no_sync._step_run(arch, name, {})
            # rpb's events beyond the method's allowance, counted (test_no_sync.excess)
            unexpected = sorted(test_no_sync.excess(events, per_layer, n_layers)[0].elements())
            ok = not unexpected
            passed &= ok
            results[arch][name] = {
                "events": len(events),
                "extra_over_none": len(events) - baseline,
                "allowed_waits_per_moe_layer": per_layer,
                "from_rpb": unexpected,
                "passed": ok,
            }
            log(
                f"syncs {arch:<12} {name:<13} {len(events)} recorded waits, "
                f"rpb's beyond its allowance: {unexpected or 'none'}"
            )
    return {
        "passed": passed,
        "kind": "tests/test_no_sync.py SyncRecorder: waits and host<->device copies, step 3",
        "results": results,
    }


def _examples(n: int = 32) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 16, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(3, VOCAB, (k,), generator=g).tolist()} for k in lengths]


def _collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class _StopAt(transformers.TrainerCallback):
    """Saves a checkpoint at `step` and stops there, as a preempted job does."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True


def run_trainer(
    method_name: str,
    steps: int,
    use_cpu: bool,
    bf16: bool,
    output_dir: str,
    stop_at: int = 0,
    resume_from: str | None = None,
) -> tuple[Any, torch.nn.Module]:
    """RouterMethodTrainer on the tiny qwen3_moe base (examples/trainer.py's settings);
    `stop_at` saves a checkpoint at that step and stops, `resume_from` resumes from one."""
    from transformers import PrinterCallback, TrainingArguments

    from rpb.trainer import RouterMethodTrainer

    base, prior = family_base("qwen3_moe")
    model = copy.deepcopy(base).train()
    method = make_method(method_name).attach(model, prior)
    training = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=use_cpu,
        bf16=bf16,
        disable_tqdm=True,
        seed=0,
    )
    trainer = RouterMethodTrainer(
        model=model,
        args=training,
        train_dataset=_examples(),
        data_collator=_collate,
        router_method=method,
        callbacks=[_StopAt(stop_at)] if stop_at else None,
    )
    trainer.remove_callback(PrinterCallback)  # its raw log dicts: router_history keeps them
    with method:
        trainer.train(resume_from_checkpoint=resume_from)
    return trainer, model


def _history_ok(history: list[dict[str, float]], steps: int) -> bool:
    values = [e[k] for e in history for k in ("task_loss", "router_loss")]
    return len(history) == steps and all(map(math.isfinite, values))


def check_trainer(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-trainer-") as tmp:
        trainer, model = run_trainer("rpb", args.trainer_steps, not cuda, cuda, tmp)
    device = next(model.parameters()).device.type
    history = trainer.router_history
    passed = _history_ok(history, args.trainer_steps) and device == ("cuda" if cuda else "cpu")
    log(f"trainer on {device}: {len(history)} steps logged, passed {passed}")
    return {
        "passed": passed,
        "method": "rpb",
        "device": device,
        "bf16": cuda,
        "steps": args.trainer_steps,
        "task_loss": [e["task_loss"] for e in history],
        "router_loss": [e["router_loss"] for e in history],
        "seconds": round(time.perf_counter() - start, 1),
    }


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, in fp32 on the CPU: under FSDP a collective on every rank (the full
    tensors behind the DTensor shards)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
        for n, p in model.named_parameters()
    }


def fsdp_worker(args: argparse.Namespace) -> int:
    """Inside `accelerate launch` (FSDP2): the Trainer, then its gathered checkpoint reloaded."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-fsdp-") as tmp:
        # Off CUDA (no FSDP) it still runs, so its own code can be tried on a CPU.
        cuda = torch.cuda.is_available()
        trainer, _ = run_trainer("anchor_weight", args.trainer_steps, not cuda, cuda, tmp)
        params = dict(trainer.model.named_parameters())
        full = _full_weights(trainer.model)
        # As rpb.pipeline.training._save_model: the checkpoints are sharded (fsdp.yaml), with
        # which trainer.save_model writes nothing; the final model is gathered (a collective).
        state_dict = trainer.accelerator.get_state_dict(trainer.model)
        if trainer.is_world_process_zero():
            trainer._save(str(Path(tmp) / "model"), state_dict=state_dict)
        # The same run stopped at half its steps with a checkpoint (sharded under fsdp.yaml),
        # then resumed from it by a fresh trainer: the weights must be the uninterrupted run's.
        half = max(1, args.trainer_steps // 2)
        stopped = Path(tmp) / "stopped"
        run_trainer("anchor_weight", args.trainer_steps, not cuda, cuda, str(stopped), half)
        checkpoint = stopped / f"checkpoint-{half}"
        saved = sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else []
        resumed, _ = run_trainer(
            "anchor_weight", args.trainer_steps, not cuda, cuda, str(stopped), 0, str(checkpoint)
        )
        resumed_full = _full_weights(resumed.model)
        if trainer.is_world_process_zero():
            loaded = AutoModelForCausalLM.from_pretrained(str(Path(tmp) / "model"))
            state = {k: v.float() for k, v in loaded.state_dict().items()}
            common = sorted(set(state) & set(full))
            diffs = [(state[k] - full[k]).abs().max().item() for k in common]
            results = {
                "method": "anchor_weight",  # the method with FSDP-specific code (its hook term)
                "is_fsdp_enabled": bool(trainer.is_fsdp_enabled),
                "distributed_type": str(trainer.accelerator.distributed_type),
                "mixed_precision": str(trainer.accelerator.mixed_precision),
                "param_types": sorted({type(p).__name__ for p in params.values()}),
                "steps": args.trainer_steps,
                "history_ok": _history_ok(trainer.router_history, args.trainer_steps),
                "task_loss": [e["task_loss"] for e in trainer.router_history],
                "router_loss": [e["router_loss"] for e in trainer.router_history],
                "reloaded_tensors": len(common),
                "reloaded_max_abs_diff": max(diffs, default=math.inf),
                "checkpoint_files": saved,  # pytorch_model_fsdp_0/, optimizer_0/: sharded
                "checkpoint_sharded": "pytorch_model_fsdp_0" in saved,
                "resumed_steps": resumed.state.global_step,
                "resumed_max_abs_diff": max(
                    ((resumed_full[k] - full[k]).abs().max().item() for k in full),
                    default=math.inf,
                ),
            }
    if results:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def check_fsdp(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-fsdp-out-") as tmp:
        out = Path(tmp) / "fsdp.json"
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "config" / "accelerate" / "fsdp.yaml"),
            "--num_processes",
            "1",
            str(Path(__file__).resolve()),
            "--fsdp-worker",
            "--out",
            str(out),
            "--trainer-steps",
            str(args.trainer_steps),
        ]
        # This checkout's rpb in the launched process, whatever is installed.
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        log("fsdp: " + " ".join(cmd[2:]))
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
            )
        except subprocess.TimeoutExpired:
            return {"passed": False, "error": "timed out after 300 s"}
        worker = json.loads(out.read_text()) if out.is_file() else {}
    result: dict[str, Any] = {"returncode": proc.returncode, "command": " ".join(cmd[2:])} | worker
    result["passed"] = bool(
        proc.returncode == 0
        and worker.get("is_fsdp_enabled")
        and "DTensor" in worker.get("param_types", [])
        and worker.get("history_ok")
        and worker.get("reloaded_tensors", 0) > 0
        and worker.get("reloaded_max_abs_diff", math.inf) == 0.0
        and worker.get("checkpoint_sharded")
        # A lost optimizer or schedule state moves weights by about LR; kernels' own order, less.
        and worker.get("resumed_max_abs_diff", math.inf) <= 1e-5
    )
    if proc.returncode != 0 or not worker:
        result["stderr_tail"] = proc.stderr[-3000:]
    result["seconds"] = round(time.perf_counter() - start, 1)
    log(f"fsdp: rc {proc.returncode}, passed {result['passed']} ({result['seconds']} s)")
    return result


def check_overhead(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """bench/gpu_smoke.py's paper-width slices, 4 MoE layers, 8 x 1024, bf16 (--cpu: its --tiny)."""
    smoke = _load_bench("gpu_smoke")
    argv = ["--moe-layers", "4", "--batch", "8", "--seq", "1024", "--methods", *args.methods]
    argv += ["--repeats", str(args.overhead_repeats), "--warmup", "1"]
    argv += ["--steady", str(args.overhead_steady)]
    smoke_args = smoke.parse_args([*argv, "--tiny"] if not cuda else argv)
    paper = yaml.safe_load(smoke_args.config.read_text())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    results = {}
    for name, entry in paper["models"].items():
        res = smoke.run_model(name, entry, smoke_args, device, dtype)
        results[name] = res
        ratios = ", ".join(f"{m} {r['ratio_to_none']:.2f}" for m, r in res["methods"].items())
        log(f"overhead {name}: {res['experts']} experts top-{res['top_k']}: {ratios}")
    finite = all(
        math.isfinite(r["step_s"]) and r["step_s"] > 0
        for res in results.values()
        for r in res["methods"].values()
    )
    note = "paper widths: the overhead table" if cuda else "tiny widths, one round: it runs"
    return {
        "passed": finite,
        "note": note,  # --cpu's ratios are timing noise on a tiny slice, not an overhead
        "sizes": {
            "moe_layers": smoke_args.moe_layers,
            "batch": smoke_args.batch,
            "seq": smoke_args.seq,
            "vocab": smoke_args.vocab,
            "dtype": str(dtype),
            "tiny_widths": not cuda,
            "repeats": smoke_args.repeats,
            "untimed_steps_after_each_attach": smoke_args.steady,
        },
        "ratio_to_none": {
            name: {m: r["ratio_to_none"] for m, r in res["methods"].items()}
            for name, res in results.items()
        },
        "results": results,
    }


# ---------------------------------------------------------------- record


def _git(*cmd: str) -> str:
    try:
        proc = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def _run_check(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A check that raises is recorded as failed with its error; the others still run."""
    start = time.perf_counter()
    try:
        result = fn()
        result.setdefault("seconds", round(time.perf_counter() - start, 1))
        return result
    except Exception as exc:
        log(f"{name}: FAILED with {exc!r}")
        return {
            "passed": False,
            "error": repr(exc),
            "seconds": round(time.perf_counter() - start, 1),
        }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fsdp_worker:
        return fsdp_worker(args)
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; use --cpu for the CPU half")
    torch.set_num_threads(args.threads)
    if cuda:  # fp32 means fp32: TF32 matmuls would differ from the CPU by ~1e-3 by design
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    warnings.simplefilter("ignore")  # lbl's double-count warning and the like, once per run
    checks: dict[str, dict[str, Any]] = {}
    record = functools.partial(_write_record, args, cuda, checks, started)
    record(complete=False)  # what ran is on disk at every point: a timeout keeps it
    skipped = "skipped: --skip"
    if "equivalence" in args.skip:
        checks["equivalence"] = {"passed": None, "skipped": skipped}
    else:
        checks["equivalence"] = _run_check("equivalence", lambda: check_equivalence(args, cuda))
    profiled = checks["equivalence"].pop("_syncs", None)
    record(complete=False)
    if "trainer" in args.skip:
        checks["trainer"] = {"passed": None, "skipped": skipped}
    else:
        checks["trainer"] = _run_check("trainer", lambda: check_trainer(args, cuda))
    record(complete=False)
    if "fsdp" in args.skip:
        checks["fsdp"] = {"passed": None, "skipped": skipped}
    elif not cuda:
        checks["fsdp"] = {"passed": None, "skipped": "GPU only (accelerate's FSDP needs CUDA)"}
    else:
        checks["fsdp"] = _run_check("fsdp", lambda: check_fsdp(args))
    record(complete=False)
    if "syncs" in args.skip:
        checks["syncs"] = {"passed": None, "skipped": skipped}
    elif cuda:
        checks["syncs"] = (
            _run_check("syncs", lambda: syncs_from_profiles(profiled))
            if profiled
            else {"passed": None, "skipped": "no profiled steps (equivalence did not run)"}
        )
    else:
        checks["syncs"] = _run_check("syncs", lambda: syncs_by_recorder(args))
    record(complete=False)
    if "overhead" in args.skip:  # the longest check last: a timeout loses only its own
        checks["overhead"] = {"passed": None, "skipped": skipped}
    else:
        checks["overhead"] = _run_check("overhead", lambda: check_overhead(args, cuda))
    payload = record(complete=True)
    log(f"summary {payload['summary']}, total {payload['total_s']} s -> {args.out}")
    return 0 if payload["passed"] else 1


def _write_record(
    args: argparse.Namespace,
    cuda: bool,
    checks: dict[str, dict[str, Any]],
    started: float,
    complete: bool,
) -> dict[str, Any]:
    """Write the record of the checks run so far (atomically: a reader never sees half a file);
    `complete` false while checks are still to run, and `passed` is then false."""
    ran = [c["passed"] for c in checks.values() if c["passed"] is not None]
    payload = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "mode": "gpu" if cuda else "cpu",
        "device": torch.cuda.get_device_name(0) if cuda else cpu_model(),
        "cpu": cpu_model(),  # the equivalence reference ran on it
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "families": args.families,
        "methods": args.methods,
        "complete": complete,
        "passed": complete and bool(ran) and all(ran),
        "summary": {name: c["passed"] for name, c in checks.items()},
        "total_s": round(time.perf_counter() - started, 1),
        "checks": checks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2) + "\n")
    partial.replace(args.out)
    return payload


if __name__ == "__main__":
    raise SystemExit(main())
