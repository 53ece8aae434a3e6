"""The project's names in one torch-free place: method families and their options, the tiny
testbed's corpora and eval sets, and the results path layout.

Everything that must agree reads this module: `rpb.method_config` and `rpb.methods` (a method's
strength and options, checked and completed by `check_method` alone), `rpb.pipeline.config_check`
(what a config may name), the Snakemake rules (paths), the tables and the CLI. It imports nothing
heavy, because the Snakefile imports it at every parse.

A new method is a class in `rpb.methods` plus its `MethodSpec` here; a new tiny eval set is a
generator in `rpb.pipeline.data` plus its name in `EVAL_SETS` (under `eval_only` it retrains no
base: `rpb.pipeline.data.EVAL_ONLY_ITEMS`).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CORPORA",
    "EVAL_SETS",
    "FAMILY_STRENGTH",
    "METHOD_SPECS",
    "PATHS",
    "SEED_LIMIT",
    "TRAINABLE",
    "MethodSpec",
    "Option",
    "Run",
    "base_of_run",
    "bases_of",
    "check_method",
    "method_spec",
    "replicate_name",
    "results_path",
    "run_names",
    "runs_on",
    "spec_runs",
    "torch_seed",
]


# Post-training parameter selections (`posttrain.trainable`; rpb.trainable implements them).
TRAINABLE = ("all", "moe", "routed_experts_and_routers")


def install_hint(extra: str | None = None) -> str:
    """How to install rpb, or one of its extras: from a checkout of its repository (no package
    index has rpb, so no message sends a user to one)."""
    what = "." if extra is None else f"'.[{extra}]'"
    return f"pip install {what} in a checkout of the rpb repository"


@dataclass(frozen=True)
class Option:
    """One method option: its default and what values it accepts.

    `choices` (a tuple) for a fixed set; otherwise the default's type decides: `bool` accepts true
    or false, `float` any finite number >= 0.
    """

    default: Any
    choices: tuple[str, ...] | None = None
    doc: str = ""

    @property
    def kind(self) -> str:
        if self.choices is not None:
            return "choice"
        return "bool" if isinstance(self.default, bool) else "float"


@dataclass(frozen=True)
class MethodSpec:
    """A method family: its strength (None: it takes none), its options, and whether it reads
    the base's router prior (`needs_prior`: the method's `attach` requires one, and a permuted
    prior is a meaningful control of it)."""

    name: str
    default_strength: float | None
    options: dict[str, Option] = field(default_factory=dict)
    doc: str = ""
    max_strength: float = math.inf
    needs_prior: bool = True

    @property
    def uses_strength(self) -> bool:
        return self.default_strength is not None

    @property
    def option_defaults(self) -> dict[str, Any]:
        return {key: opt.default for key, opt in self.options.items()}


_KEEP = Option(False, doc="steer at evaluation too (the steering travels with the saved model)")
_BIAS_ON = Option(
    "selection",
    ("selection", "logits"),
    doc="selection: bias the top-k choice only; logits: bias the gate weights too",
)


def _specs(*specs: MethodSpec) -> dict[str, MethodSpec]:
    return {spec.name: spec for spec in specs}


METHOD_SPECS: dict[str, MethodSpec] = _specs(
    MethodSpec(
        "none", None, doc="plain fine-tuning, router trainable, no router term", needs_prior=False
    ),
    MethodSpec(
        "lbl",
        0.001,
        {
            "pooling": Option(
                "auto",
                ("auto", "per_layer", "pooled"),
                doc="auto: DeepSeek-V3's per-layer sequence loss on deepseek_v3, else pooled",
            )
        },
        doc="re-applied load-balancing loss, as the family was pretrained",
        needs_prior=False,
    ),
    MethodSpec(
        "rpb",
        1.0,
        {
            "bias_on": _BIAS_ON,
            # On by default: the reading table 1 measures (docs/methods.md, "What the rule
            # found"); false is the selection-only reading (config label rpb_select).
            "keep_bias_at_eval": Option(
                True, doc="keep the bias at evaluation (false: dropped, the model's own router)"
            ),
        },
        doc="Router Prior Bias: select by top-k of s + lambda * s0 (base router's score)",
    ),
    MethodSpec(
        "rpb_marginal",
        1.0,
        {"bias_on": _BIAS_ON, "keep_bias_at_eval": _KEEP},
        doc="a per-expert bias toward the base's mean routing distribution",
    ),
    MethodSpec(
        "rpb_interp",
        0.5,
        {"keep_bias_at_eval": _KEEP},
        doc="interpolated logits z + lambda * stopgrad(z0 - z), lambda in [0, 1]",
        max_strength=1.0,
    ),
    MethodSpec(
        "rpb_anneal",
        1.0,
        {
            "bias_on": _BIAS_ON,
            "schedule": Option("cosine", ("linear", "cosine"), doc="decay of the bias to 0"),
        },
        doc="rpb's bias annealed to 0 over training (no train/eval mismatch)",
    ),
    MethodSpec(
        "rpb_coact",
        1.0,
        {"bias_on": _BIAS_ON, "keep_bias_at_eval": _KEEP},
        doc="a per-token bias toward experts co-activating in the base with its other choices",
    ),
    MethodSpec(
        "rpb_adaptive",
        1.0,
        {
            "update_rate": Option(0.001, doc="bias step per update"),
            "keep_bias_at_eval": _KEEP,
            "bias_in": Option(
                "auto",
                ("auto", "correction_bias", "selection_bias"),
                doc="auto: the router's correction bias where it has one, else a hook bias",
            ),
        },
        doc="a per-expert bias updated each step toward the base's usage prior",
    ),
    MethodSpec("anchor_weight", 0.01, doc="+ mu * sum_l ||W_l - W0_l||^2"),
    MethodSpec("anchor_logit", 0.01, doc="+ mu * mean over tokens ||z - z0||^2"),
    MethodSpec("anchor_kl", 1.0, doc="+ mu * mean over tokens KL(p0 || p)"),
    MethodSpec(
        "hard",
        None,
        {
            "gate_from": Option("live", ("live", "base"), doc="which router's gate weights"),
            "keep_bias_at_eval": Option(True, doc="route by the base at evaluation too"),
        },
        doc="selection by the base router's top-k (the lambda -> infinity limit)",
    ),
)


def method_spec(name: str) -> MethodSpec:
    """The spec of method family `name` (ValueError naming the known ones otherwise)."""
    try:
        return METHOD_SPECS[name]
    except KeyError:
        known = ", ".join(METHOD_SPECS)
        raise ValueError(f"unknown router method {name!r} (known: {known})") from None


# The one text strength: the coefficient of the model family's own load-balancing loss, read from
# the model's config when the method attaches (rpb.methods.family_lbl_coefficient).
FAMILY_STRENGTH = "family"
FAMILY_STRENGTH_METHODS = ("lbl",)


def _finite_at_least_0(value: Any) -> bool:
    # YAML's .nan passes every comparison, and True is an int to Python.
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def check_method(
    kind: str,
    strength: float | str | None = None,
    options: Mapping[str, Any] | None = None,
    key: str | None = None,
) -> tuple[float | str | None, dict[str, Any]]:
    """The strength and options of a method of family `kind`, checked and completed: the one
    place that does either (`rpb.method_config.MethodConfig` and `rpb.methods.make_method` call
    it). The strength comes back a float (None: the family's default), None for a family that
    takes none, or `FAMILY_STRENGTH` where the family takes it; the options with the family's
    defaults filled in (a float option as a float).

    A bad value raises one ValueError line that starts with where it was written: `key` (a
    config's `methods.<label>`) followed by `.strength` or `.options.<name>`, or without a key
    `strength of method '<kind>'` and `option <name> of method '<kind>'`."""
    spec = method_spec(kind)
    where = f"{key}.strength" if key else f"strength of method {kind!r}"
    if not spec.uses_strength:
        if strength is not None:
            raise ValueError(f"{where}: {kind!r} takes no strength (got {strength!r})")
    elif strength is None:
        strength = spec.default_strength
    elif isinstance(strength, str):
        strength = _text_strength(kind, strength, where)
    elif not _finite_at_least_0(strength):
        raise ValueError(f"{where}: {strength!r} is not a finite number >= 0")
    elif strength > spec.max_strength:
        raise ValueError(f"{where}: {kind!r} takes at most {spec.max_strength} (got {strength!r})")
    if isinstance(strength, int | float):
        strength = float(strength)
    if options is not None and not isinstance(options, Mapping):
        where = f"{key}.options" if key else f"options of method {kind!r}"
        raise ValueError(f"{where}: {options!r} is not a mapping of option names to values")
    checked = dict(spec.option_defaults)
    for name, value in (options or {}).items():
        where = f"{key}.options.{name}" if key else f"option {name} of method {kind!r}"
        checked[name] = _option_value(kind, spec.options.get(name), value, where)
    return strength, checked


def _text_strength(kind: str, strength: str, where: str) -> str:
    """`FAMILY_STRENGTH` for a family that takes it; any other text refused in one line."""
    try:
        number = float(strength)
    except ValueError:
        number = None
    # PyYAML (YAML 1.1, Snakemake's) reads `1e-3` as text, `1.0e-3` as a number.
    if number is not None and math.isfinite(number):
        raise ValueError(f"{where}: {strength!r} is text, not a number (write {number!r})")
    takes_family = kind in FAMILY_STRENGTH_METHODS
    if strength != FAMILY_STRENGTH:
        if takes_family:
            raise ValueError(f"{where}: {strength!r} is neither a number >= 0 nor 'family'")
        raise ValueError(f"{where}: {strength!r} is not a number")
    if not takes_family:
        raise ValueError(
            f"{where}: {FAMILY_STRENGTH!r} (the model family's own load-balancing coefficient) "
            f"is a strength of {' or '.join(map(repr, FAMILY_STRENGTH_METHODS))} only; give "
            f"{kind!r} a number"
        )
    return strength


def _option_value(kind: str, option: Option | None, value: Any, where: str) -> Any:
    if option is None:
        known = ", ".join(method_spec(kind).options) or "none"
        raise ValueError(f"{where}: unknown option of {kind!r} (known: {known})")
    if option.kind == "choice" and value not in option.choices:
        raise ValueError(f"{where}: {value!r} is not one of {list(option.choices)}")
    if option.kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{where}: {value!r} is not true or false")
    if option.kind == "float":
        if not _finite_at_least_0(value):
            raise ValueError(f"{where}: {value!r} is not a finite number >= 0")
        return float(value)
    return value


# The tiny testbed's corpora (post-training; each doubles as the in-domain eval set of its name)
# and eval sets (rpb.pipeline.data writes them).
CORPORA: tuple[str, ...] = ("math", "math2")
EVAL_SETS: dict[str, tuple[str, ...]] = {
    "in_domain": CORPORA,
    "ood": ("addition", "facts", "reverse", "sort", "grammar"),
    # Eval-only sets: no base pretrains on them and none is written with the corpora, so naming
    # one in `evaluation.ood` evaluates it without retraining a base (rule eval_only_set).
    "eval_only": ("addition3",),
}

# Results layout, relative to results_dir. `{method}` is a method label (a key of `methods`); a
# run lies under `base{base}/seed{seed}`: its base (0: the model itself, k: its k-th replicate,
# `models.<m>.replicates`) and its post-training seed within that base. Pretraining, priors,
# training, evaluation and analysis name a base the same way: `models/tinyA/base1` is the base of
# `runs/tinyA/math/rpb/base1/seed2`.
PATHS: dict[str, str] = {
    "base_model": "models/{model}/base{base}/model",
    "prior": "priors/{model}/base{base}/{corpus}.safetensors",
    "permuted_prior": "priors/{model}/base{base}/permuted/{corpus}.safetensors",
    "model": "runs/{model}/{corpus}/{method}/base{base}/seed{seed}/model",
    "train_history": "runs/{model}/{corpus}/{method}/base{base}/seed{seed}/train_history.json",
    "eval": "eval/{model}/{corpus}/{method}/base{base}/seed{seed}.json",
    "analysis": "analysis/{model}/{corpus}/{method}/base{base}/seed{seed}.json",
    # The analysis job's co-activation counts, beside its JSON.
    "analysis_counts": "analysis/{model}/{corpus}/{method}/base{base}/seed{seed}.safetensors",
    # A router-swap diagnostic's model, in that diagnostic's own tree (rpb.router_swap).
    "swapped_model": "models/{model}/{corpus}/{method}/base{base}/seed{seed}/model",
}


def results_path(kind: str, **fields: Any) -> str:
    """A results-relative path of `kind` (a key of PATHS) with its fields filled in; `run` (a
    `Run`) stands for `base` and `seed`."""
    if "run" in fields:
        run = fields.pop("run")
        fields |= {"base": run.base, "seed": run.seed}
    return PATHS[kind].format(**fields)


def run_path(kind: str, results: Path, model: str, corpus: str, label: str, run: Run) -> Path:
    """Where output `kind` (a key of PATHS) of run `run` lies under `results`."""
    fields = {"model": model, "corpus": corpus, "method": label, "run": run}
    return Path(results) / results_path(kind, **fields)


def eval_path(results: Path, model: str, corpus: str, label: str, run: Run) -> Path:
    """Where the evaluation output of one trained model lies (label `base`: a base, as its run
    `base<b>/seed0`)."""
    return run_path("eval", results, model, corpus, label, run)


def analysis_path(results: Path, model: str, corpus: str, label: str, run: Run) -> Path:
    """Where the co-activation analysis of one trained model lies (JSON; counts beside it)."""
    return run_path("analysis", results, model, corpus, label, run)


# Replicate bases: a pretrained model's `replicates` (pretraining seeds) become further models of
# the same family, each its own base, named `<model>_base<k>` in the config (k = 1, 2, ... in the
# order of `replicates`). A post-training run is a base and a seed (`Run`); a table pools a
# model's runs over its bases, so its job's spec names every run it reads (`spec_runs`).


def replicate_name(model: str, index: int) -> str:
    """The config name of `model`'s base `index` (its `index`-th replicate; 0: the model)."""
    return model if index == 0 else f"{model}_base{index}"


def bases_of(models: Mapping[str, Mapping[str, Any]], model: str) -> list[str]:
    """`model` and its replicate bases, in the order of its `replicates` (a model without any:
    itself alone). `models` is the config's `models` after rpb.pipeline.config_check expanded it."""
    seeds = (models.get(model) or {}).get("replicates") or []
    return [replicate_name(model, k) for k in range(len(seeds) + 1)]


_RUN_NAME = re.compile(r"base(\d+)/seed(\d+)")


@dataclass(frozen=True, order=True)
class Run:
    """A post-training run's identity: its base (0: the model itself, k: its k-th replicate) and
    its post-training seed within that base. Runs sort base by base, then by seed. `name`
    (`base1/seed2`) is how paths, MLflow run names, table specs and notes name it."""

    base: int
    seed: int

    def __post_init__(self) -> None:
        for key in ("base", "seed"):
            value = getattr(self, key)
            try:
                number = operator.index(value)  # an int or a numpy integer; not "1", not 1.0
            except TypeError:
                number = -1
            if number < 0:
                raise ValueError(f"a run's {key} must be an integer >= 0, got {value!r}")
            object.__setattr__(self, key, number)  # a plain int, whatever integer it was given

    @property
    def name(self) -> str:
        return f"base{self.base}/seed{self.seed}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> Run:
        """The run named `name` (`base1/seed2`; ValueError for anything else)."""
        match = _RUN_NAME.fullmatch(str(name))
        if match is None:
            raise ValueError(f"not a run name (base<b>/seed<s>): {name!r}")
        return cls(int(match[1]), int(match[2]))


# Seeds per base stay below this (the config schema's `seeds` maximum is SEED_LIMIT - 1) so that
# `torch_seed` gives every run of a model its own torch seed.
SEED_LIMIT = 1000


def torch_seed(base: int, seed: int) -> int:
    """The torch and data-order seed of post-training run (`base`, `seed`): SEED_LIMIT * base +
    seed. Every run made so far was seeded so (its seed then also named the run), and this keeps
    them all reproducible bit for bit: same seed, same data order, same weights."""
    if not 0 <= int(seed) < SEED_LIMIT:
        raise ValueError(f"seed {seed} must lie in [0, {SEED_LIMIT}) to seed a run of base {base}")
    return SEED_LIMIT * int(base) + int(seed)


def runs_on(n_bases: int, seeds: Sequence[int]) -> list[Run]:
    """The runs of `seeds` on each of `n_bases` bases, base by base."""
    return [Run(k, int(s)) for k in range(n_bases) for s in seeds]


def run_names(runs: Sequence[Run]) -> list[str]:
    """How a report job's spec names runs (`base1/seed2`; `spec_runs` reads them back)."""
    return [run.name for run in runs]


def spec_runs(spec: Mapping[str, Any], key: str = "runs") -> list[Run]:
    """The runs a report job's spec names under `key` (`run_names`), in order."""
    return [Run.parse(name) for name in spec[key]]


def base_of_run(models: Mapping[str, Mapping[str, Any]], model: str, run: Run) -> str:
    """The base model (a key of `models`) run `run` of `model` was trained from."""
    bases = bases_of(models, model)
    if run.base >= len(bases):
        raise ValueError(
            f"run {run} of {model} needs base {run.base}, but {model} has {len(bases)}"
        )
    return bases[run.base]
