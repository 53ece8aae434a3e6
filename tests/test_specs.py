"""rpb.specs, the names every part agrees on: each method spec is a registered method class that
reads it (and nothing else is registered), option kinds, unknown names, the eval sets, and the
results layout the rules write and the loaders read."""

from __future__ import annotations

import math
import re
import string
from pathlib import Path

import numpy as np
import pytest
from smoke_pipeline import snakemake_in_repo

from rpb.specs import (
    CORPORA,
    EVAL_SETS,
    METHOD_SPECS,
    PATHS,
    Option,
    Run,
    method_spec,
    results_path,
)

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"model": "tinyA", "corpus": "math2", "method": "rpb_keep", "base": 1, "seed": 3}


def test_every_spec_is_a_registered_method_and_every_method_has_a_spec() -> None:
    from rpb.methods import METHODS, make_method

    assert set(METHOD_SPECS) == set(METHODS)
    for name, spec in METHOD_SPECS.items():
        cls = METHODS[name]
        assert cls.spec is spec and spec.name == name, name
        assert cls.needs_prior == spec.needs_prior, name
        assert cls.uses_strength == spec.uses_strength, name
        method = make_method(name)
        assert method.options == spec.option_defaults, name
        assert method.strength == (spec.default_strength if spec.uses_strength else 0.0), name


def test_option_kinds_follow_choices_or_the_default() -> None:
    assert Option("a", ("a", "b")).kind == "choice"
    assert Option(True).kind == "bool"
    assert Option(0.001).kind == "float"
    for spec in METHOD_SPECS.values():
        for key, option in spec.options.items():
            if option.choices is not None:
                assert option.default in option.choices, (spec.name, key)
    assert all(s.max_strength >= (s.default_strength or 0) for s in METHOD_SPECS.values())
    assert not math.isfinite(method_spec("rpb").max_strength)


def test_an_unknown_method_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"^unknown router method 'rbp' \(known: none, lbl, rpb,"):
        method_spec("rbp")


def test_each_corpus_is_its_own_in_domain_eval_set() -> None:
    assert EVAL_SETS["in_domain"] == CORPORA
    assert not set(EVAL_SETS["in_domain"]) & set(EVAL_SETS["ood"])


@pytest.mark.parametrize("kind", list(PATHS))
def test_results_path_templates_render(kind: str) -> None:
    names = {name for _, name, _, _ in string.Formatter().parse(PATHS[kind]) if name}
    assert names <= set(FIELDS), kind
    path = results_path(kind, **FIELDS)
    assert not re.search(r"[{}]", path) and not Path(path).is_absolute(), path
    for name in names:
        assert f"{FIELDS[name]}" in path, (kind, name)
    with pytest.raises(KeyError):
        results_path(kind)  # a field left out


@pytest.mark.workflow
def test_the_rules_write_where_the_loaders_read(tmp_path: Path) -> None:
    """Every template, filled in, is a file a rule writes: a dry run of the smoke config with
    each as a target plans a job listing it among its outputs, so the layout the tables read is
    the one the jobs write."""
    results = tmp_path / "results"
    # Seed 0 on base 1: the replicate base names its runs, models and priors alike.
    fields = {"model": "tinyA", "corpus": "math", "method": "rpb", "run": Run(1, 0)}
    targets = {kind: f"{results}/{results_path(kind, **fields)}" for kind in PATHS}
    # A swapped model lies in the router-swap diagnostic's tree, under a label naming its parts.
    swapped = fields | {"method": "none_with_base_trunk", "run": Run(0, 0)}
    targets["swapped_model"] = f"{results}/diagnostic/router_swap/" + results_path(
        "swapped_model", **swapped
    )
    proc = snakemake_in_repo(
        *("-n", "--cores", "1", "--configfile", "config/smoke.yaml"),
        *("--config", f"results_dir={results}", "--", *targets.values()),
    )
    planned = {
        path
        for line in proc.stdout.splitlines()
        if line.strip().startswith("output: ")
        for path in line.strip().removeprefix("output: ").split(", ")
    }
    assert {k: t for k, t in targets.items() if t not in planned} == {}


def test_runs_pool_seeds_over_bases_and_name_themselves() -> None:
    from rpb.specs import Run, base_of_run, runs_on, spec_runs

    models = {"tinyA": {"replicates": [7]}, "tinyA_base1": {"replicate_of": "tinyA"}, "hub": {}}
    runs = runs_on(2, [0, 1, 2])
    assert runs == [Run(b, s) for b in (0, 1) for s in (0, 1, 2)] == sorted(runs)
    assert [base_of_run(models, "tinyA", r) for r in runs] == ["tinyA"] * 3 + ["tinyA_base1"] * 3
    # Paths, specs and tables name a run by its base and seed; the pretraining seed (7) is not
    # the base's name.
    assert (
        [r.name for r in runs[2:4]] == ["base0/seed2", "base1/seed0"] == list(map(str, runs[2:4]))
    )
    assert [Run.parse(r.name) for r in runs] == runs
    assert spec_runs({"runs": ["base1/seed0", "base0/seed2"]}) == [Run(1, 0), Run(0, 2)]
    assert Run(np.int64(1), 2) == Run(1, 2) and type(Run(np.int64(1), 2).base) is int
    with pytest.raises(ValueError, match="needs base 1, but hub has 1"):
        base_of_run(models, "hub", Run(1, 3))
    for bad in ("seed2", "base1/seed", "1002", "base-1/seed0"):
        with pytest.raises(ValueError, match="not a run name"):
            Run.parse(bad)
    for base, seed in ((-1, 0), (0, "1"), (0, 1.0)):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            Run(base, seed)


def test_the_torch_seed_of_a_run_is_the_one_every_run_so_far_had() -> None:
    """Runs were seeded with 1000 * base + seed before they were named by base and seed; the
    same numbers keep every model, evaluation and analysis made so far reproducible bit for bit."""
    from rpb.specs import torch_seed

    pairs = [(0, 0), (0, 1), (0, 999), (1, 0), (1, 2), (2, 5), (7, 123)]
    assert [torch_seed(b, s) for b, s in pairs] == [1000 * b + s for b, s in pairs]
    assert [torch_seed(b, s) for b, s in pairs] == [0, 1, 999, 1000, 1002, 2005, 7123]
    with pytest.raises(ValueError, match=r"\[0, 1000\)"):
        torch_seed(1, 1000)  # would be base 2's seed 0
