"""Part swap: put some parts of one saved model into another, and decompose a post-training change
by part with a full factorial of such swaps.

A MoE model's state falls into three parts (`rpb.trainable.parameter_parts`, found by role):
`routers` (each router's weight and, for DeepSeek-V3, its `e_score_correction_bias`),
`routed_experts` (the fused or listed per-expert tensors beside each router) and `trunk`
(everything else: attention, norms, embeddings, output head, dense layers, shared experts).
A trained model T and its base B then span 2^k models, k the number of factors: each factor's
tensors come from B or from T. The factors are the configured `parts` (default all three), plus
one factor `rest` holding the parts not listed (`parts: [routers]` is the 2x2 of routers against
everything else). With the three parts, 6 of the 8 cells are new models, each one part away from
B or from T:

| cell                        | routers | routed experts | trunk |
|-----------------------------|---------|----------------|-------|
| base                        | B       | B              | B     |
| base_with_trained_routers   | T       | B              | B     |
| trained_with_base_routers   | B       | T              | T     |
| ... (likewise per part)     |         |                |       |
| trained                     | T       | T              | T     |

For a score v (cell -> number) and S the factors taken from T, the change `total = v(all) -
v({})` splits exactly into the factorial effects (the Moebius inversion of v): `effect(S) = sum
over the subsets R of S of (-1)^(|S|-|R|) v(R)`; a single factor's effect is its **main effect**
`v({i}) - v({})` (B with T's part i, minus B), a larger S's is an **interaction**, and the
effects of all non-empty S add up to `total` by construction. A factor's **Shapley value**
`sum over S containing i of effect(S) / |S|` is its marginal contribution `v(S + i) - v(S)`
averaged over the k! orders of putting the factors in; the Shapley values add up to `total`, and
`shapley_share = shapley / total`. A factor's **put-back** effect `v(all - i) - v(all)` is what
putting B's part back into T does, and `put_back_share = put_back / (v({}) - v(all))` the
share of the change it undoes; for the routers on the OOD mean of p(target) that is the testbed's
premise gate R (docs/testbed.md). The swapped cells are models nobody trained; they show what each
part does on its own.

This module is imported by the Snakefile (labels, paths), so torch is imported where used.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpb.artifacts import atomic_folder
from rpb.specs import Run, base_of_run, eval_path, results_path, spec_runs

if TYPE_CHECKING:
    from torch import Tensor, nn

log = logging.getLogger(__name__)

# rpb.trainable.PARTS (that module imports torch and transformers; a test checks they agree).
PARTS: tuple[str, ...] = ("routers", "routed_experts", "trunk")
# The factor of the parts not listed in `parts`.
REST = "rest"
# A swapped model's label names the one part it takes from the other model (every swapped cell of
# a factorial over at most three parts is one part away from B or from T):
# `base_with_<method>_<part>` (B with T's part), `<method>_with_base_<part>` (T with B's part).
_PART_RE = "|".join(PARTS)
LABEL_PATTERN = (
    rf"(?:[a-z][a-z0-9_]*_with_base_(?:{_PART_RE})|base_with_[a-z][a-z0-9_]*_(?:{_PART_RE}))"
)
# Files of a saved model folder that hold weights (rewritten by save_pretrained); all other files
# (tokenizer, chat template, generation config) are copied from the target's folder.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


# --- swapping tensors ----------------------------------------------------------------------------


def router_state(model: nn.Module) -> dict[str, Tensor]:
    """Every router's parameters and buffers (its state dict), keyed by full model name."""
    from rpb.routing import find_routers

    state: dict[str, Tensor] = {}
    for handle in find_routers(model):
        for key, value in handle.module.state_dict(keep_vars=True).items():
            state[f"{handle.name}.{key}"] = value
    return state


def _check_same_class(target: nn.Module, source: nn.Module, what: str) -> None:
    if type(target) is not type(source):
        raise ValueError(
            f"swap: a {type(source).__name__}'s {what} cannot go into a {type(target).__name__}"
        )


def _matched(
    into: dict[str, Tensor], new: dict[str, Tensor], what: str
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """`into` and `new` after checking they hold the same names, shapes and dtypes."""
    if set(into) != set(new):
        only = sorted(set(into) ^ set(new))
        raise ValueError(f"swap: the models' {what} differ ({only[0]} is in only one)")
    for name, tensor in into.items():
        if tensor.shape != new[name].shape or tensor.dtype != new[name].dtype:
            raise ValueError(
                f"swap: {name} is {tuple(tensor.shape)} {tensor.dtype} in the target and "
                f"{tuple(new[name].shape)} {new[name].dtype} in the source"
            )
    return into, new


def _copy(into: dict[str, Tensor], new: dict[str, Tensor]) -> list[str]:
    import torch

    with torch.no_grad():
        for name, tensor in into.items():
            tensor.copy_(new[name])
    return sorted(into)


def _part_pairs(
    target: nn.Module, source: nn.Module, parts: Sequence[str]
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, str]]:
    """The two models' live tensors of `parts` (checked to match) and target's name -> part."""
    from rpb.trainable import parameter_parts

    _check_parts(parts)
    what = "+".join(p for p in PARTS if p in parts)
    _check_same_class(target, source, what)
    mine, theirs = parameter_parts(target), parameter_parts(source)
    if mine != theirs:  # the same class split another way (another module layout)
        other = next(n for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n))
        raise ValueError(f"swap: the models do not put {other} in the same part")
    sa, sb = target.state_dict(keep_vars=True), source.state_dict(keep_vars=True)
    names = [n for n, part in mine.items() if part in parts]
    into, new = _matched({n: sa[n] for n in names}, {n: sb[n] for n in names}, what)
    return into, new, mine


def part_state(model: nn.Module, parts: Sequence[str]) -> dict[str, Tensor]:
    """The state-dict tensors (parameters and persistent buffers, live) of `parts`, by full name."""
    from rpb.trainable import parameter_parts

    _check_parts(parts)
    state = model.state_dict(keep_vars=True)
    return {name: state[name] for name, part in parameter_parts(model).items() if part in parts}


def swap_parts(target: nn.Module, source: nn.Module, parts: Sequence[str]) -> list[str]:
    """Copy `source`'s tensors of `parts` into `target` in place (exact copies); return their names.

    The two models must be of one class with the same parts (names, shapes, dtypes); every tensor
    of `target` outside `parts` is left untouched.
    """
    into, new, _ = _part_pairs(target, source, parts)
    return _copy(into, new)


def swap_routers(target: nn.Module, source: nn.Module) -> list[str]:
    """`swap_parts(target, source, ["routers"])` by the routers alone (no routed-expert lookup)."""
    _check_same_class(target, source, "routers")
    return _copy(*_matched(router_state(target), router_state(source), "routers"))


def part_distances(a: nn.Module, b: nn.Module, parts: Sequence[str]) -> dict[str, float]:
    """Per part, the Frobenius distance between two models' tensors of that part."""
    ta, tb, part_of = _part_pairs(a, b, parts)
    squares = dict.fromkeys(parts, 0.0)
    seen: set[int] = set()
    for name, tensor in ta.items():
        # Tied weights (embeddings = output head) are one tensor under two names: count it once.
        if id(tensor) not in seen:
            seen.add(id(tensor))
            diff = tensor.detach().double() - tb[name].detach().double()
            squares[part_of[name]] += float(diff.pow(2).sum())
    return {part: math.sqrt(s) for part, s in squares.items()}


def _load(model_dir: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from rpb.eval_routing import eval_routing_spec

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"part swap: no saved model (config.json) in {model_dir}")
    spec = eval_routing_spec(model_dir)
    if spec is not None:
        # Its evaluation replaces the router's selection (hard: the base's), so swapping its
        # router weights would not swap the routing it is evaluated with.
        raise ValueError(
            f"part swap: {model_dir} keeps method {spec.kind!r} routing at evaluation; "
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


def swap_saved_parts(
    target_dir: Path, source_dir: Path, parts: Sequence[str], out_dir: Path
) -> dict[str, Any]:
    """Save to `out_dir` the model of `target_dir` with the `parts` of `source_dir`.

    Both must be saved models of the same architecture that route natively at evaluation. The
    tokenizer and other non-weight files come from `target_dir`. Returns a summary (the tensors
    swapped, and per part how far the two models are apart), also written to `swap.json`. The
    folder appears whole, replacing any previous one, with its integrity records
    (`rpb.artifacts.atomic_folder`).
    """
    target_dir, source_dir, out_dir = Path(target_dir), Path(source_dir), Path(out_dir)
    _check_parts(parts)
    model, donor = _load(target_dir), _load(source_dir)
    distance = part_distances(model, donor, parts)
    swapped = swap_parts(model, donor, parts)
    summary = {
        "target": str(target_dir),
        "source": str(source_dir),
        "parts": list(parts),
        "swapped": swapped,
        "distance": distance,
    }
    with atomic_folder(out_dir) as folder:
        _copy_non_weight_files(target_dir, folder)
        model.save_pretrained(folder)
        (folder / "swap.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("part swap: %d tensors (%s) of %s into %s", len(swapped), parts, source_dir, out_dir)
    return summary


# --- the factorial -------------------------------------------------------------------------------


def _check_parts(parts: Sequence[str]) -> None:
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts or len(set(parts)) != len(parts):
        raise ValueError(f"parts: {list(parts)} must be distinct names among {list(PARTS)}")


def factors(parts: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Factor -> the parts it holds: each of `parts` (in PARTS order), and `rest` for the others."""
    _check_parts(parts)
    out = {p: (p,) for p in PARTS if p in parts}
    rest = tuple(p for p in PARTS if p not in parts)
    return out | ({REST: rest} if rest else {})


def cell_name(from_trained: frozenset[str], names: Sequence[str]) -> str:
    """A cell's column name: `base`, `trained`, or the factor(s) that differ from one of them."""
    others = [f for f in names if f not in from_trained]
    taken = [f for f in names if f in from_trained]
    if not taken:
        return "base"
    if not others:
        return "trained"
    # Name the cell by the side that differs in one factor, not by `rest` where avoidable.
    if len(taken) == 1 and (taken[0] != REST or len(others) != 1):
        return f"base_with_trained_{taken[0]}"
    if len(others) == 1:
        return f"trained_with_base_{others[0]}"
    return "base_with_trained_" + "_and_".join(taken)


def cells(parts: Sequence[str]) -> dict[str, frozenset[str]]:
    """Cell column name -> the factors it takes from the trained model, all 2^k of them (base
    first, trained last, by the number of factors taken)."""
    names = list(factors(parts))
    subsets = [
        frozenset(s) for r in range(len(names) + 1) for s in itertools.combinations(names, r)
    ]

    def order(s: frozenset[str]) -> tuple[int, int]:
        # By size, then by the factor that differs from base or trained (PARTS order).
        odd = s if 2 * len(s) <= len(names) else frozenset(names) - s
        return len(s), min((names.index(f) for f in odd), default=0)

    return {cell_name(s, names): s for s in sorted(subsets, key=order)}


def model_label(method: str, parts: Sequence[str], from_trained: frozenset[str]) -> str:
    """The label a cell's model is stored and evaluated under: `base`, `method`, or a swap label
    (LABEL_PATTERN) named by the actual parts, so a model is the same whatever `parts` says."""
    groups = factors(parts)
    taken = {p for f in from_trained for p in groups[f]}
    if not taken:
        return "base"
    if len(taken) == len(PARTS):
        return method
    if len(taken) == 1:
        return f"base_with_{method}_{next(iter(taken))}"
    (kept,) = set(PARTS) - taken
    return f"{method}_with_base_{kept}"


def parse_label(label: str) -> tuple[str, str, str]:
    """(target, source, part) of a swap label: the model the swap starts from, the model the part
    comes from (`base` or a method label) and the part."""
    if not re.fullmatch(LABEL_PATTERN, label):
        raise ValueError(f"part swap: {label!r} is not a swap label ({LABEL_PATTERN})")
    part = next(p for p in PARTS if label.endswith(f"_{p}"))
    if label.startswith("base_with_"):
        return "base", label.removeprefix("base_with_").removesuffix(f"_{part}"), part
    return label.removesuffix(f"_with_base_{part}"), "base", part


def subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    return [s for r in range(1, len(names) + 1) for s in itertools.combinations(names, r)]


def effect_name(subset: Sequence[str]) -> str:
    """Column of a factorial effect: `main_<f>`, or `interaction_<f>_x_<g>[_x_<h>]`."""
    return f"main_{subset[0]}" if len(subset) == 1 else "interaction_" + "_x_".join(subset)


def decompose(values: Mapping[frozenset[str], float], names: Sequence[str]) -> dict[str, float]:
    """The factorial decomposition of `values` (factors taken from T -> score) over factors
    `names` (module docstring): total, every effect, each factor's Shapley value and share, and
    its put-back effect and share. The effects and the Shapley values each add up to total."""
    full, none = frozenset(names), frozenset()
    missing = [s for s in (frozenset(c) for c in [(), *subsets(names)]) if s not in values]
    if missing:
        raise ValueError(f"decompose: no value for cell {sorted(missing[0])}")
    total = values[full] - values[none]
    out: dict[str, float] = {"total": total}
    effects: dict[tuple[str, ...], float] = {}
    for subset in subsets(names):
        effects[subset] = sum(
            (-1) ** (len(subset) - len(r)) * values[frozenset(r)]
            for k in range(len(subset) + 1)
            for r in itertools.combinations(subset, k)
        )
        out[effect_name(subset)] = effects[subset]
    loss = -total
    for f in names:
        shapley = sum(e / len(s) for s, e in effects.items() if f in s)
        put_back = values[full - {f}] - values[full]
        out[f"shapley_{f}"] = shapley
        out[f"shapley_share_{f}"] = shapley / total if total != 0 else math.nan
        out[f"put_back_{f}"] = put_back
        out[f"put_back_share_{f}"] = put_back / loss if loss != 0 else math.nan
    return out


def decomposition_columns(names: Sequence[str]) -> list[str]:
    """decompose's keys, in order."""
    return list(decompose({frozenset(s): 0.0 for s in [(), *subsets(names)]}, names))


# --- the pipeline's paths ------------------------------------------------------------------------


def swap_input_dirs(
    results: Path | str,
    models: Mapping[str, Mapping[str, Any]],
    model: str,
    corpus: str,
    label: str,
    run: Run,
) -> dict[str, str]:
    """The saved models a swapped model of run `run` is made from: {"target", "source"} (`base`
    is the run's own base, `rpb.specs.base_of_run`)."""

    def folder(method: str) -> str:
        if method == "base":
            base_of_run(models, model, run)  # a base the model does not have: ValueError
            return results_path("base_model", model=model, base=run.base)
        return results_path("model", model=model, corpus=corpus, method=method, run=run)

    target, source, _ = parse_label(label)
    return {"target": f"{results}/{folder(target)}", "source": f"{results}/{folder(source)}"}


def cell_eval_paths(
    results: Path, spec: Mapping[str, Any], model: str, run: Run
) -> dict[str, Path]:
    """Cell -> the evaluation output of its model for run `run` (the base: under the run its
    base was evaluated as, `base<b>/seed0`; the swapped models: under `spec["swap_tree"]`)."""
    results = Path(results)
    corpus, method = spec["corpus"], spec["method"]
    parts = spec.get("parts") or PARTS
    paths = {}
    for cell, taken in cells(parts).items():
        label = model_label(method, parts, taken)
        if label == "base":
            paths[cell] = eval_path(results, model, corpus, "base", Run(run.base, 0))
        elif label == method:
            paths[cell] = eval_path(results, model, corpus, method, run)
        else:
            paths[cell] = eval_path(results / spec["swap_tree"], model, corpus, label, run)
    return paths


def table_inputs(results: Path | str, spec: Mapping[str, Any]) -> list[str]:
    """Every evaluation output the table reads (the Snakefile's inputs of router_swap_table)."""
    paths = [
        str(path)
        for model in spec["models"]
        for run in spec_runs(spec)
        for path in cell_eval_paths(Path(results), spec, model, run).values()
    ]
    return list(dict.fromkeys(paths))
