"""Move a results folder written before runs were named `base{b}/seed{s}` to the current layout
(rpb.specs.PATHS), so that Snakemake finds what is already computed instead of recomputing it.

The first layout named a run by its run id alone (`runs/tinyA/math/rpb/seed1002`: seed 2 on base
1) and a replicate base as a model of its own (`models/tinyA_p1/base`, `priors/tinyA_p1/`, after
its pretraining seed). The current one names both the same way from pretraining to evaluation:

    models/tinyA_p1/base/model             -> models/tinyA/base1/model
    models/tinyA/base/model                -> models/tinyA/base0/model
    priors/tinyA_p1/math.safetensors       -> priors/tinyA/base1/math.safetensors
    priors/tinyA/permuted/math.safetensors -> priors/tinyA/base0/permuted/math.safetensors
    runs/tinyA/math/rpb/seed1002/          -> runs/tinyA/math/rpb/base1/seed2/
    eval/tinyA/math/base/seed1000.json     -> eval/tinyA/math/base/base1/seed0.json
    figures/table1_coactivation_runs/math_seed1002.png -> .../math_base1_seed2.png

and the same under `diagnostic/` and for the integrity records (`.integrity/<path>.json`,
rpb.pipeline.results_folder). Logs, benchmarks and the MLflow store stay where they are. `rpb
relayout` prints the moves; with `--apply` it makes them, refusing any move onto an existing
path, so nothing computed is lost. Report jobs run again afterwards (their inputs have new
names); training, evaluation and analysis do not.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rpb.pipeline.results_folder import RECORDS
from rpb.specs import Run

__all__ = [
    "apply_moves",
    "current_path",
    "legacy_bases",
    "legacy_named_runs",
    "misread_diagnostics",
    "moves",
    "read_config",
]

# Folders a results tree keeps beside the layout (MLflow's store, logs, timings).
_UNTOUCHED = {"mlartifacts", "logs", "benchmarks", "downloads"}
# A run id in a path: `<kind>/<model>/<corpus>/<method>/seed<id>` then its suffix (a folder's
# files, `.json`, `.run/...`, `.work`, `.safetensors`); kinds in the main tree and in diagnostic/.
_RUN = re.compile(
    r"^(?P<head>(?:diagnostic/(?:router_swap/)?)?(?:runs|eval|analysis|models)/[^/]+/[^/]+/[^/]+)"
    r"/seed(?P<run>\d+)(?P<rest>(?:[./].*)?)$"
)
_BASE_MODEL = re.compile(r"^models/(?P<key>[^/]+)/base(?P<rest>/.*)?$")
_PRIOR = re.compile(r"^priors/(?P<key>[^/]+)/(?!base\d+(?:/|$))(?P<rest>.+)$")
_FIGURE = re.compile(r"^(?P<head>figures/[^/]+_runs/.+)_seed(?P<run>\d+)(?P<rest>\.[a-z]+)$")
# The first layout's run id packed a run into one integer, 1000 * base + seed. Only this module
# (and bench/compare_results.py through it) still reads such ids; the current code names a run
# by its base and seed (rpb.specs.Run) and derives its torch seed alone so (rpb.specs.torch_seed).
_LEGACY_STRIDE = 1000


def _legacy_run(run_id: int | str) -> Run:
    """The run of a first-layout run id: 1002 is seed 2 on base 1."""
    return Run(*divmod(int(run_id), _LEGACY_STRIDE))


def legacy_named_runs(frame: Any) -> Any:
    """A first-layout table (a pandas DataFrame) with its column `seed` of run ids split into
    `base` and `seed`, as the current tables write them; any other frame as it is."""
    import pandas as pd

    if "seed" not in frame or "base" in frame or not pd.api.types.is_integer_dtype(frame["seed"]):
        return frame
    base, seed = divmod(frame["seed"], _LEGACY_STRIDE)
    named = frame.assign(seed=seed)
    named.insert(named.columns.get_loc("seed"), "base", base)
    return named


def read_config(configfiles: Sequence[Path | str]) -> dict[str, Any]:
    """The config as the Snakefile reads it: config/config.yaml, then each of `configfiles` over
    it (nested mappings merged key by key, the last file winning), unchecked."""
    import yaml

    config: dict[str, Any] = {}
    for path in dict.fromkeys([Path("config/config.yaml"), *map(Path, configfiles)]):
        _merge(config, yaml.safe_load(path.read_text()) or {})
    return config


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def legacy_bases(models: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, int]]:
    """The first layout's name of every base -> (model, base index): `tinyA` -> (tinyA, 0),
    `tinyA_p1` (pretraining seed 1, its first replicate) -> (tinyA, 1). `models` is the config's
    `models` section as written (before rpb.pipeline.config_check adds the replicates)."""
    names: dict[str, tuple[str, int]] = {}
    for model, entry in models.items():
        if (entry or {}).get("replicate_of"):
            continue
        names[model] = (model, 0)
        for k, seed in enumerate((entry or {}).get("replicates") or [], start=1):
            names[f"{model}_p{seed}"] = (model, k)
    return names


def current_path(relative: str, bases: Mapping[str, tuple[str, int]]) -> str | None:
    """The current layout's name of `relative` (a path under a results folder, `/`-separated)
    when the first layout named it otherwise, else None. Current names map to None, so moving
    twice moves nothing."""
    if relative.startswith(f"{RECORDS}/"):
        inner = current_path(relative.removeprefix(f"{RECORDS}/"), bases)
        return None if inner is None else f"{RECORDS}/{inner}"
    if match := _RUN.match(relative):
        return f"{match['head']}/{_legacy_run(match['run'])}{match['rest']}"
    if (match := _BASE_MODEL.match(relative)) and match["key"] in bases:
        model, k = bases[match["key"]]
        return f"models/{model}/base{k}{match['rest'] or ''}"
    if (match := _PRIOR.match(relative)) and match["key"] in bases:
        model, k = bases[match["key"]]
        return f"priors/{model}/base{k}/{match['rest']}"
    if (match := _FIGURE.match(relative)) and not re.search(r"_base\d+$", match["head"]):
        return f"{match['head']}_{_legacy_run(match['run']).name.replace('/', '_')}{match['rest']}"
    return None


def moves(results: Path, bases: Mapping[str, tuple[str, int]]) -> list[tuple[Path, Path]]:
    """(from, to) for everything under `results` whose name changed: a folder moves whole (its
    files are not listed again)."""
    results = Path(results)
    found: list[tuple[Path, Path]] = []
    stack = [results]
    while stack:
        for path in sorted(stack.pop().iterdir()):
            relative = path.relative_to(results).as_posix()
            if relative in _UNTOUCHED:
                continue
            target = current_path(relative, bases)
            if target is not None:
                found.append((path, results / target))
            elif path.is_dir() and not path.is_symlink():
                stack.append(path)
    return sorted(found)


def misread_diagnostics(planned: list[tuple[Path, Path]]) -> list[Path]:
    """The moved routing-regime diagnostic outputs of replicate bases' runs. The first layout
    evaluated their `base` row on base 0 and analysed them against base 0's model and prior;
    Snakemake does not rerun them by itself (their new inputs are older than they are)."""
    pattern = re.compile(
        r"/diagnostic/(?:eval|analysis)/[^/]+/[^/]+/[^/]+/base[1-9]\d*/seed\d+\.json$"
    )
    return [target for _, target in planned if pattern.search(target.as_posix())]


def apply_moves(results: Path, planned: list[tuple[Path, Path]]) -> None:
    """Make `planned` moves under `results`; refuses (ValueError naming both paths) before moving
    anything when a target exists or two sources share one."""
    targets = [to for _, to in planned]
    for source, target in planned:
        if target.exists() or targets.count(target) > 1:
            raise ValueError(f"{source} -> {target}: the target exists; moved nothing")
    for source, target in planned:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, target)  # same file system: keeps mtimes, which Snakemake compares
    # Folders the moves emptied (models/tinyA_p1, priors/tinyA_p1, ...).
    for source, _ in planned:
        for parent in source.parents:
            if parent == Path(results):
                break
            try:
                parent.rmdir()
            except OSError:
                break
