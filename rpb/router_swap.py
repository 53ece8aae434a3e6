"""Router swap: put one saved model's routers into another, and decompose a post-training change
into its routing and non-routing parts.

A trained model differs from its base in two sets of weights: the routers (found by class,
`rpb.routing.find_routers`: their weight and, for DeepSeek-V3, the `e_score_correction_bias`
buffer) and everything else. Swapping them gives the other two cells of a 2x2 factorial
(non-router weights from base or trained x routers from base or trained):

| cell                   | non-router weights | routers |
|------------------------|--------------------|---------|
| base                   | base               | base    |
| trained                | trained            | trained |
| trained_base_routers   | trained            | base    |
| base_trained_routers   | base               | trained |

and any score's change `total = trained - base` splits, exactly and by construction, into

- `routing = base_trained_routers - base` (the trained routers alone, on the base's weights),
- `non_routing = trained_base_routers - base` (the trained weights alone, under the base's
  routers),
- `interaction = total - routing - non_routing` (what the two do only together).

`routing_share` is routing's Shapley share of the change, `(routing + interaction / 2) / total`:
the routing effect averaged over both orders of putting the two parts in. The off-diagonal cells
are models nobody trained; they show what each part does on its own.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from rpb.routing import find_routers

log = logging.getLogger(__name__)

# The two swapped cells, as (non-router weights, routers) sources.
CELLS = {"trained_base_routers": ("trained", "base"), "base_trained_routers": ("base", "trained")}
COLUMNS = ["base", "trained", "trained_base_routers", "base_trained_routers"]
PARTS = ["total", "routing", "non_routing", "interaction"]
# Files of a saved model folder that hold weights (rewritten by save_pretrained); all other files
# (tokenizer, chat template, generation config) are copied from the non-router weights' folder.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Rounding tolerance of the check that the parts add up to the total (they do by construction).
_ADD_UP_TOL = 1e-9


def router_state(model: nn.Module) -> dict[str, Tensor]:
    """Every router's parameters and buffers (its state dict), keyed by full model name."""
    state: dict[str, Tensor] = {}
    for handle in find_routers(model):
        for key, value in handle.module.state_dict(keep_vars=True).items():
            state[f"{handle.name}.{key}"] = value
    return state


def swap_routers(target: nn.Module, source: nn.Module) -> list[str]:
    """Copy `source`'s router tensors into `target` in place (exact copies); return their names.

    The two models must have the same routers (names and shapes); everything else of `target`
    is left untouched.
    """
    if type(target) is not type(source):
        raise ValueError(
            f"swap_routers: a {type(source).__name__}'s routers cannot go into a "
            f"{type(target).__name__}"
        )
    into, new = router_state(target), router_state(source)
    if set(into) != set(new):
        only = sorted(set(into) ^ set(new))
        raise ValueError(f"swap_routers: the models' routers differ ({only[0]} is in only one)")
    with torch.no_grad():
        for name, tensor in into.items():
            if tensor.shape != new[name].shape:
                raise ValueError(
                    f"swap_routers: {name} has shape {tuple(tensor.shape)} in the target and "
                    f"{tuple(new[name].shape)} in the source"
                )
            tensor.copy_(new[name])
    return sorted(into)


def router_distance(a: nn.Module, b: nn.Module) -> float:
    """Frobenius distance between two models' router tensors (all routers together)."""
    sa, sb = router_state(a), router_state(b)
    return math.sqrt(
        sum(float((sa[k].detach().double() - sb[k].detach().double()).pow(2).sum()) for k in sa)
    )


def _load(model_dir: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from rpb.eval_routing import eval_routing_spec

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"router swap: no saved model (config.json) in {model_dir}")
    spec = eval_routing_spec(model_dir)
    if spec is not None:
        # Its evaluation replaces the router's selection (hard: the base's), so swapping its
        # router weights would not swap the routing it is evaluated with.
        raise ValueError(
            f"router swap: {model_dir} keeps method {spec['method']!r} routing at evaluation; "
            "swap only models that route natively"
        )
    # dtype "auto": the saved dtype, so copied tensors stay bitwise what was saved.
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")


def _copy_non_weight_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in Path(src).iterdir():
        if path.is_dir() or path.suffix in _WEIGHT_SUFFIXES or path.name in _WEIGHT_INDEX:
            continue
        shutil.copy2(path, dst / path.name)


def swap_saved_routers(weights_dir: Path, routers_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Save to `out_dir` the model of `weights_dir` with the routers of `routers_dir`.

    Both must be saved models of the same architecture that route natively at evaluation. The
    tokenizer and other non-weight files come from `weights_dir`. Returns a summary (the router
    tensors swapped and how far the two models' routers are apart).
    """
    weights_dir, routers_dir, out_dir = Path(weights_dir), Path(routers_dir), Path(out_dir)
    model, donor = _load(weights_dir), _load(routers_dir)
    distance = router_distance(model, donor)
    swapped = swap_routers(model, donor)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    _copy_non_weight_files(weights_dir, out_dir)
    model.save_pretrained(out_dir)
    summary = {
        "weights": str(weights_dir),
        "routers": str(routers_dir),
        "swapped": swapped,
        "router_distance": distance,
    }
    (out_dir / "router_swap.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("router swap: %d router tensors of %s into %s", len(swapped), routers_dir, out_dir)
    return summary


# --- the decomposition ---------------------------------------------------------------------------


def decompose(
    base: float, trained: float, trained_base_routers: float, base_trained_routers: float
) -> dict[str, float]:
    """The 2x2 decomposition of `trained - base` (module docstring); parts sum to `total`."""
    total = trained - base
    routing = base_trained_routers - base
    non_routing = trained_base_routers - base
    interaction = trained - trained_base_routers - base_trained_routers + base
    share = (routing + interaction / 2) / total if total != 0 else math.nan
    return {
        "total": total,
        "routing": routing,
        "non_routing": non_routing,
        "interaction": interaction,
        "routing_share": share,
    }


def swap_labels(method: str) -> dict[str, str]:
    """Cell -> the label a swapped model of `method` is stored and evaluated under."""
    return {
        "trained_base_routers": f"{method}_with_base_routers",
        "base_trained_routers": f"base_with_{method}_routers",
    }


def task_scores(result: dict[str, Any], tasks: Sequence[str], path: Path) -> dict[tuple, float]:
    """(task, metric) -> score of one evaluation output: each task's main score in percent
    (exact match of `rpb_<task>`, or a standard task's metric), and for our eval sets also the
    mean per-token log-likelihood of the target (`ll_per_token`, nats) of `rpb_<task>_ll`."""
    entries = result.get("tasks", {})
    scores: dict[tuple, float] = {}
    for task in tasks:
        key = f"rpb_{task}" if f"rpb_{task}" in entries else task
        if key not in entries:
            raise ValueError(f"{path}: no task 'rpb_{task}' or '{task}' in the evaluation output")
        scores[(task, entries[key]["metric"])] = 100.0 * float(np.mean(entries[key]["items"]))
        ll = entries.get(f"rpb_{task}_ll")
        if ll is not None:
            scores[(task, "ll_per_token")] = float(ll["score"])
    return scores


def _cell_paths(results: Path, spec: dict[str, Any], model: str, seed: int) -> dict[str, Path]:
    from rpb.run_records import eval_path

    corpus, method = spec["corpus"], spec["method"]
    swap_root = results / spec["swap_tree"]
    labels = swap_labels(method)
    return {
        "base": eval_path(results, model, corpus, "base", 0),
        "trained": eval_path(results, model, corpus, method, seed),
        **{cell: eval_path(swap_root, model, corpus, labels[cell], seed) for cell in CELLS},
    }


def router_swap_rows(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """One row per (model, seed, task, metric): the four cells and the decomposition, plus the
    `in_domain` and `ood_mean` groups (means over their tasks; the decomposition is linear, so
    their parts add up too)."""
    from rpb.run_records import in_domain_tasks, read_json

    results = Path(results)
    tasks = list(dict.fromkeys([*spec["in_domain"], *spec["ood"]]))
    groups = {"in_domain": in_domain_tasks(spec, spec["corpus"]), "ood_mean": list(spec["ood"])}
    rows = []
    for model in spec["models"]:
        for seed in spec["seeds"]:
            cells = {
                cell: task_scores(read_json(path, "the router-swap table"), tasks, path)
                for cell, path in _cell_paths(results, spec, model, seed).items()
            }
            keys = list(cells["base"])
            for cell, scores in cells.items():
                if list(scores) != keys:
                    raise ValueError(f"router swap: {cell} of {model} seed {seed} has other tasks")
            metrics = list(dict.fromkeys(m for _, m in keys))
            for group, members in groups.items():
                for metric in metrics:
                    if all((t, metric) in cells["base"] for t in members):
                        for scores in cells.values():
                            scores[(group, metric)] = float(
                                np.mean([scores[(t, metric)] for t in members])
                            )
            for task, metric in cells["base"]:
                values = {cell: cells[cell][(task, metric)] for cell in COLUMNS}
                rows.append(
                    {
                        "model": model,
                        "method": spec["method"],
                        "corpus": spec["corpus"],
                        "seed": seed,
                        "task": task,
                        "metric": metric,
                        **values,
                        **decompose(*(values[c] for c in COLUMNS)),
                    }
                )
    frame = pd.DataFrame(rows)
    residual = (frame["total"] - frame[["routing", "non_routing", "interaction"]].sum(axis=1)).abs()
    if len(frame) and float(residual.max()) > _ADD_UP_TOL * max(
        1.0, float(frame["total"].abs().max())
    ):
        raise AssertionError(f"router swap: the parts do not add up (max {residual.max():.3g})")
    return frame


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per (model, task, metric); routing_share recomputed from the means."""
    keys = ["model", "method", "corpus", "task", "metric"]
    mean = rows.groupby(keys, sort=False)[COLUMNS].mean().reset_index()
    n = rows.groupby(keys, sort=False)["seed"].count().reset_index(drop=True)
    parts = pd.DataFrame([decompose(*(r[c] for c in COLUMNS)) for _, r in mean.iterrows()])
    return pd.concat([mean, parts, n.rename("n_seeds")], axis=1)


def build_router_swap_table(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """`router_swap.csv` (per model, seed, task, metric), `router_swap_summary.csv` (mean over
    seeds) and `router_swap.md` from the four cells' evaluation outputs."""
    out_csv = Path(out_csv)
    rows = router_swap_rows(results, spec)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out_csv, index=False, float_format="%.6g")
    summary = summarise(rows)
    summary.to_csv(
        out_csv.with_name(f"{out_csv.stem}_summary.csv"), index=False, float_format="%.6g"
    )
    residual = (rows["total"] - rows[["routing", "non_routing", "interaction"]].sum(axis=1)).abs()
    out_csv.with_suffix(".md").write_text(_markdown(summary, spec, float(residual.max())))
    return rows


def _markdown(summary: pd.DataFrame, spec: dict[str, Any], residual: float) -> str:
    m = spec["method"]
    names = {
        "base": "base",
        "trained": m,
        "trained_base_routers": f"{m} + base routers",
        "base_trained_routers": f"base + {m} routers",
        "total": "total",
        "routing": "routing",
        "non_routing": "non-routing",
        "interaction": "interaction",
        "routing_share": "routing share",
    }
    text = (
        f"Router-swap decomposition ({spec.get('scale')} scale, method {m}, corpus "
        f"{spec['corpus']}, seeds {spec['seeds']}; mean over seeds, per-seed rows in "
        "router_swap.csv). Four cells: the base, the trained model, the trained model with the "
        "base's routers put back, and the base with the trained routers (routers found by class; "
        "DeepSeek-V3 correction biases included). total = trained - base; routing = (base + "
        "trained routers) - base; non-routing = (trained + base routers) - base; interaction = "
        "the rest. The three parts add up to the total exactly, by construction (largest "
        f"|total - sum of parts| over all rows: {residual:.2g}). routing share = (routing + "
        "interaction / 2) / total, routing's Shapley share of the change. On an OOD task the "
        "forgetting is -total, and routing explains the routing share of it.\n"
    )
    for metric, unit in (
        ("exact_match", "exact match, percent"),
        ("ll_per_token", "mean per-token log-likelihood of the target, nats"),
    ):
        part = summary[summary["metric"] == metric]
        if metric == "exact_match":  # standard tasks score by their own metric (acc)
            part = summary[summary["metric"] != "ll_per_token"]
        if not len(part):
            continue
        for model, frame in part.groupby("model", sort=False):
            table = frame[["task", *COLUMNS, *PARTS, "routing_share"]].rename(columns=names)
            body = table.to_markdown(index=False, floatfmt=".3g")
            text += f"\n{model}: {unit}\n\n{body}\n"
    return text
