"""The planner: the checked config, parsed once into frozen dataclasses (`PipelineConfig`), and
pure functions from it to what each job reads and the spec it gets (`Plan`).

`workflow/rules/common.smk` builds one `Plan` after rpb.pipeline.config_check has validated and
expanded the config, and its rules hand their wildcards to it; nothing here knows Snakemake, so
tests/test_plan.py calls it directly, and tests/test_plan_snapshot.py checks that Snakemake still
plans the same jobs through it. Within the plan a post-training run is a `rpb.specs.Run` (its base
and its seed within the base), as the rules' `{base}` and `{seed}` wildcards name it (`Plan.run`);
its paths come from `rpb.specs.PATHS` (`base{b}/seed{s}`), and a table's spec names its runs so.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from rpb.method_config import MethodConfig
from rpb.pipeline.bases import base_identity, find_fixed_base
from rpb.report.registry import REPORTS, Shape
from rpb.specs import (
    Run,
    base_of_run,
    bases_of,
    results_path,
    run_names,
    runs_on,
)

# The diagnostics `all` builds at tiny and smoke scale, by their output.
# Checkpoint settings say how a training job may be resumed, not what it computes: they reach a
# job in its environment (CHECKPOINTS_ENV, set by the workflow), never in its params, which are
# Snakemake's rerun trigger, so adding or changing one reruns no finished job (like threads).
CHECKPOINT_SETTINGS = ("save_every",)
CHECKPOINTS_ENV = "RPB_CHECKPOINTS"

DIAGNOSTIC_OUTPUTS = {"router_swap": "router_swap.csv", "regime": "diagnostic_table1.csv"}
# The router-swap tree below the results folder (rpb.router_swap reads it from the table's spec).
SWAP_TREE = "diagnostic/router_swap"
DIAGNOSTIC_TREE = "diagnostic"


def frozen(value: Any) -> Any:
    """A read-only copy of a config value: mappings become MappingProxyType, lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(frozen(v) for v in value)
    return value


def plain(value: Any) -> Any:
    """The JSON-ready copy of a frozen value (dicts and lists again)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


@dataclass(frozen=True)
class MethodEntry:
    """One `methods.<label>` entry: its method (rpb.method_config.MethodConfig: family, strength
    and options, checked and completed when parsed) and the router prior it trains with."""

    label: str
    method: MethodConfig
    prior: str | None = None

    @classmethod
    def parse(cls, label: str, entry: Mapping[str, Any] | None) -> MethodEntry:
        entry = entry or {}
        return cls(label, MethodConfig.from_entry(label, entry), entry.get("prior"))


@dataclass(frozen=True)
class ModelConfig:
    """One `models.<name>` entry (after config_check added each replicate base as a model)."""

    name: str
    source: str
    family: str
    entry: Mapping[str, Any]

    @property
    def replicate_of(self) -> str | None:
        return self.entry.get("replicate_of")

    @property
    def trust_remote_code(self) -> bool:
        return bool(self.entry.get("trust_remote_code"))

    @property
    def experts_implementation(self) -> str | None:
        return self.entry.get("experts_implementation")


@dataclass(frozen=True)
class Evaluation:
    in_domain: tuple[str, ...]
    ood: tuple[str, ...]
    corpus_tasks: Mapping[str, Any]
    limit: int
    batch_size: int
    lm_eval: Mapping[str, Any]

    @property
    def tasks(self) -> list[str]:
        return [*self.in_domain, *self.ood]


@dataclass(frozen=True)
class Table1:
    model: str
    corpus: str
    methods: tuple[str, ...]


@dataclass(frozen=True)
class DataConfig:
    seed: int
    preset: str
    level: int
    holdout: str | None
    corpora: Mapping[str, Any]


def _own_seeds(entry: Mapping[str, Any]) -> tuple[int, ...] | None:
    """A section's own `seeds` (None: the top-level seeds)."""
    return tuple(entry["seeds"]) if entry.get("seeds") else None


@dataclass(frozen=True)
class TableConfig:
    """One `tables.<name>` entry: its `model` (or `models`), `corpus` (or `corpora`), `methods`,
    and its own `seeds`. Which of its keys name the labels it reads, and what else it reads, its
    module declares in its shape (rpb.report.registry.Shape, read by `Plan.table_inputs`); table
    5's `correlate` and the readings' `lower` and `upper` are kept here for the claims. `entry` is
    the entry as the config check left it: its job's spec starts from it."""

    entry: Mapping[str, Any]
    model: str | None
    models: tuple[str, ...]
    corpus: str | None
    corpora: tuple[str, ...]
    methods: tuple[str, ...]
    correlate: tuple[str, ...] = ()
    lower: str | None = None
    upper: str | None = None
    seeds: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, entry: Mapping[str, Any]) -> TableConfig:
        model, corpus = entry.get("model"), entry.get("corpus")
        return cls(
            entry=frozen(entry),
            model=model,
            models=tuple(entry.get("models") or [model]),
            corpus=corpus,
            corpora=tuple(entry.get("corpora") or [corpus]),
            methods=tuple(entry.get("methods") or ()),
            correlate=tuple(entry.get("correlate") or ()),
            lower=entry.get("lower"),
            upper=entry.get("upper"),
            seeds=_own_seeds(entry),
        )


@dataclass(frozen=True)
class ClaimsConfig:
    """The `claims` section: the method and reference the claims compare, the controls (placebo,
    permuted prior), the margins and the statistics (docs/claims.md). `entry` (every key, the
    schema's defaults filled in) is the start of the claims job's spec."""

    entry: Mapping[str, Any]
    method: str
    reference: str
    placebo: str | None
    permuted: str | None
    confidence: float
    n_resamples: int
    power: float

    @classmethod
    def parse(cls, entry: Mapping[str, Any]) -> ClaimsConfig:
        return cls(
            entry=frozen(entry),
            method=entry["method"],
            reference=entry["reference"],
            placebo=entry.get("placebo"),
            permuted=entry.get("permuted"),
            confidence=entry["confidence"],
            n_resamples=entry["n_resamples"],
            power=entry["power"],
        )


@dataclass(frozen=True)
class SweepCurve:
    name: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class SweepConfig:
    """The softness sweep: its curves of method labels on one model, corpus and seeds, on the
    model's first `bases` bases (None: every base)."""

    model: str
    corpus: str
    seeds: tuple[int, ...]
    curves: tuple[SweepCurve, ...]
    bases: int | None = None

    @classmethod
    def parse(cls, entry: Mapping[str, Any]) -> SweepConfig:
        curves = tuple(SweepCurve(c["name"], tuple(c["labels"])) for c in entry["curves"])
        seeds = tuple(entry["seeds"])
        return cls(entry["model"], entry["corpus"], seeds, curves, entry.get("bases"))


@dataclass(frozen=True)
class RouterSwapDiagnostic:
    """`diagnostics.router_swap`: which parts of `method`'s runs are swapped back to the base's."""

    models: tuple[str, ...]
    corpus: str
    method: str
    parts: tuple[str, ...]
    seeds: tuple[int, ...] | None

    @classmethod
    def parse(cls, e: Mapping[str, Any]) -> RouterSwapDiagnostic:
        return cls(tuple(e["models"]), e["corpus"], e["method"], tuple(e["parts"]), _own_seeds(e))


@dataclass(frozen=True)
class RegimeDiagnostic:
    """`diagnostics.regime`: table 1's methods post-trained with `trainable` (and the rest of
    the model at `trunk_lr_scale` of the rate) instead."""

    model: str
    corpus: str
    methods: tuple[str, ...]
    trainable: Any  # a preset name or a list of parameter patterns, as posttrain.trainable
    seeds: tuple[int, ...] | None
    trunk_lr_scale: float | None = None  # None: posttrain.trunk_lr_scale

    @classmethod
    def parse(cls, e: Mapping[str, Any]) -> RegimeDiagnostic:
        trainable = frozen(e["trainable"])
        scale = e.get("trunk_lr_scale")
        scale = float(scale) if scale is not None else None
        return cls(e["model"], e["corpus"], tuple(e["methods"]), trainable, _own_seeds(e), scale)

    @property
    def described(self) -> str:
        """The regime as a caption names it."""
        scale = self.trunk_lr_scale
        damped = f", trunk_lr_scale: {scale:g}" if scale is not None else ""
        return f"posttrain.trainable: {plain(self.trainable)}{damped}"


@dataclass(frozen=True)
class Diagnostics:
    router_swap: RouterSwapDiagnostic | None
    regime: RegimeDiagnostic | None

    @classmethod
    def parse(cls, section: Mapping[str, Any]) -> Diagnostics:
        swap, regime = section.get("router_swap"), section.get("regime")
        return cls(
            RouterSwapDiagnostic.parse(swap) if swap is not None else None,
            RegimeDiagnostic.parse(regime) if regime is not None else None,
        )


@dataclass(frozen=True)
class Execution:
    """How the jobs run: torch threads per job, the CPU numeric path (`cpu_numerics`: a path of
    rpb.numerics, on which a CPU model computes the same bits run after run; or free), the
    training launcher,
    one process per post-training run, the job server, and where MLflow records (a tracking URI
    of the config; `MLFLOW_TRACKING_URI` wins over it) under which experiment."""

    threads_per_job: int
    cpu_numerics: str
    train_launcher: str
    one_process_per_run: bool
    job_server: bool
    tracking_uri: str | None
    experiment: str

    @classmethod
    def parse(cls, config: Mapping[str, Any]) -> Execution:
        """From a checked config: the schema filled in every default but the tracking section's."""
        tracking = config.get("tracking") or {}
        return cls(
            threads_per_job=config["threads_per_job"],
            cpu_numerics=config["cpu_numerics"],
            train_launcher=config["train_launcher"],
            one_process_per_run=config["one_process_per_run"],
            job_server=config["job_server"],
            tracking_uri=tracking.get("uri"),
            experiment=tracking.get("experiment", "rpb"),
        )


@dataclass(frozen=True)
class PipelineConfig:
    """The whole config, read once: rpb.pipeline.config_check.check_config validates it, fills in
    its defaults and parses it here (a method's strength and options are checked as its
    MethodConfig is made, in `MethodEntry.parse`). `posttrain` (the training job's spec, passed
    on as is) and `calibration` stay read-only mappings."""

    results: str
    scale: str
    seeds: tuple[int, ...]
    models: Mapping[str, ModelConfig]
    methods: Mapping[str, MethodEntry]
    evaluation: Evaluation
    table1: Table1
    data: DataConfig
    posttrain: Mapping[str, Any]
    bases: str
    probe_tasks: tuple[str, ...]
    probe_limit: int
    tables: Mapping[str, TableConfig]
    table_seeds: tuple[int, ...] | None  # `tables.seeds`: tables 2-5's and the controls' seeds
    claims: ClaimsConfig | None
    sweep: SweepConfig | None
    diagnostics: Diagnostics
    calibration: Mapping[str, Any]
    execution: Execution

    @property
    def raw_models(self) -> Mapping[str, Mapping[str, Any]]:
        """The `models` section as the config check left it (rpb.specs' base helpers read it)."""
        return {name: model.entry for name, model in self.models.items()}

    @classmethod
    def parse(cls, config: Mapping[str, Any]) -> PipelineConfig:
        """From a config that rpb.pipeline.config_check.check_config has validated."""
        ev = config["evaluation"]
        evaluation = Evaluation(
            in_domain=tuple(ev["in_domain"]),
            ood=tuple(ev["ood"]),
            corpus_tasks=frozen(ev.get("corpus_tasks") or {}),
            limit=ev.get("limit") or 0,
            batch_size=ev.get("batch_size", 64),
            lm_eval=frozen(ev.get("lm_eval") or {}),
        )
        data = config["data"]
        analysis = config.get("analysis", {})
        t1 = config["table1"]
        tables = config.get("tables") or {}
        claims, sweep = config.get("claims"), config.get("sweep")
        return cls(
            results=config.get("results_dir", "results"),
            scale=config["scale"],
            seeds=tuple(config["seeds"]),
            models=MappingProxyType(
                {
                    name: ModelConfig(name, e["source"], e["family"], frozen(e))
                    for name, e in config["models"].items()
                }
            ),
            methods=MappingProxyType(
                {label: MethodEntry.parse(label, e) for label, e in config["methods"].items()}
            ),
            evaluation=evaluation,
            table1=Table1(t1["model"], t1["corpus"], tuple(t1["methods"])),
            data=DataConfig(
                data["seed"],
                data["preset"],
                data.get("level", 1),
                data.get("holdout"),
                frozen(data.get("corpora") or {}),
            ),
            posttrain=frozen(config["posttrain"]),
            bases=config["bases"],
            probe_tasks=tuple(analysis.get("probe_tasks", evaluation.tasks)),
            probe_limit=analysis.get("probe_limit", 200),
            tables=MappingProxyType(
                {
                    name: TableConfig.parse(entry)
                    for name, entry in tables.items()
                    if name != "seeds"
                }
            ),
            table_seeds=tuple(tables["seeds"]) if tables.get("seeds") else None,
            claims=ClaimsConfig.parse(claims) if claims is not None else None,
            sweep=SweepConfig.parse(sweep) if sweep is not None else None,
            diagnostics=Diagnostics.parse(config.get("diagnostics") or {}),
            calibration=frozen(config.get("calibration") or {}),
            execution=Execution.parse(config),
        )


class Plan:
    """Every job's inputs and spec, as functions of the config and a job's (model, corpus,
    method, run). Paths are strings under `config.results`, as Snakemake takes them."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.results = config.results

    # --- models, bases and runs ------------------------------------------------------------

    @functools.cached_property
    def pretrained_models(self) -> list[str]:
        return [m for m, e in self.config.models.items() if e.source == "pretrain"]

    @functools.cached_property
    def original_pretrained(self) -> list[str]:
        """The pretrained models the config names (replicate bases are reached through them)."""
        return [m for m in self.pretrained_models if self.config.models[m].replicate_of is None]

    @functools.cached_property
    def hub_models(self) -> list[str]:
        return [m for m, e in self.config.models.items() if e.source == "hub"]

    def bases(self, model: str) -> list[str]:
        """`model` and its replicate bases (models.<model>.replicates)."""
        return bases_of(self.config.raw_models, model)

    def runs(self, model: str, seeds: Sequence[int]) -> list[Run]:
        """The runs of `seeds` on each of `model`'s bases, base by base (rpb.specs.runs_on)."""
        return runs_on(len(self.bases(model)), seeds)

    def base_runs(self, model: str) -> list[Run]:
        """The runs under which each base of `model` is evaluated and analysed (label `base`:
        `base<b>/seed0`)."""
        return self.runs(model, [0])

    def run_base(self, model: str, run: Run) -> str:
        """The base model (a key of `models`) run `run` of `model` was trained from."""
        return base_of_run(self.config.raw_models, model, run)

    @staticmethod
    def run(base: Any, seed: Any) -> Run:
        """The run of the rules' `{base}` and `{seed}` wildcards (text)."""
        return Run(int(base), int(seed))

    def base_model(self, model: str, base: Any) -> str:
        """The config entry (a key of `models`) of base `base` of `model` (`tinyA`, 1:
        `tinyA_base1`)."""
        return self.run_base(model, Run(int(base), 0))

    # --- paths -------------------------------------------------------------------------------

    def path(self, kind: str, **fields: Any) -> str:
        return f"{self.results}/{results_path(kind, **fields)}"

    def model_dir(self, model: str, method: str, corpus: str | None, run: Run) -> str:
        """The model folder of a (model, method, corpus, run); label `base`: the run's base."""
        if method == "base":
            return self.base_model_dir(model, run)
        return self.path("model", model=model, corpus=corpus, method=method, run=run)

    def _base_index(self, model: str, run: Run) -> int:
        """The base run `run` of `model` starts from (a base it lacks: ValueError naming it)."""
        self.run_base(model, run)
        return run.base

    def base_model_dir(self, model: str, run: Run) -> str:
        """The pretrained (or downloaded) base run `run` of `model` starts from."""
        return self.path("base_model", model=model, base=self._base_index(model, run))

    def evaluated_model(self, model: str, corpus: str, method: str, run: Run) -> str:
        """The model an evaluation or analysis job reads (label `base`: the run's base)."""
        return self.model_dir(model, method, corpus, run)

    def base_prior(self, model: str, corpus: str, run: Run) -> str:
        """The routing prior of run `run`'s base on `corpus`."""
        return self.path("prior", model=model, base=self._base_index(model, run), corpus=corpus)

    def permuted_prior(self, model: str, corpus: str, run: Run) -> str:
        base = self._base_index(model, run)
        return self.path("permuted_prior", model=model, base=base, corpus=corpus)

    @functools.cached_property
    def permuted_prior_labels(self) -> list[str]:
        return [label for label, m in self.config.methods.items() if m.prior == "permuted"]

    def method_prior(self, model: str, corpus: str, method: str, run: Run) -> str:
        """The prior a run trains with: its base's, or for a method whose entry says `prior:
        permuted` its base's with the experts permuted per layer (control P2)."""
        if method in self.permuted_prior_labels:
            return self.permuted_prior(model, corpus, run)
        return self.base_prior(model, corpus, run)

    def model_holdout(self, model: str) -> str | None:
        """A model's post-training hold-out: models.<m>.holdout, else data.holdout."""
        entry = self.config.models[model].entry if model in self.config.models else {}
        return entry.get("holdout", self.config.data.holdout)

    def post_corpus(self, model: str, corpus: str) -> str:
        """The post-training corpus a (model, corpus) job trains on or reads its prior from."""
        holdout = self.model_holdout(model)
        if self.config.data.corpora or holdout == self.config.data.holdout:
            return f"{self.results}/data/post/{corpus}.jsonl"
        return f"{self.results}/data/holdout/{holdout or 'none'}/post/{corpus}.jsonl"

    def run_outputs(
        self,
        model: str,
        corpus: str,
        methods: Sequence[str],
        seeds: Sequence[int],
        base: bool = False,
        root: str | None = None,
        kinds: Sequence[str] = ("eval", "analysis"),
        runs: Sequence[Run] | None = None,
    ) -> list[str]:
        """Evaluation and analysis outputs (or other `kinds` of rpb.specs.PATHS) of `methods` x
        `seeds` on one corpus, on every base of `model` (or of `methods` x `runs`, where given),
        and with `base` each base's own."""
        root = self.results if root is None else root
        runs = self.runs(model, seeds) if runs is None else runs
        labels = [("base", self.base_runs(model))] if base else []
        labels += [(m, runs) for m in methods]
        return [
            f"{root}/{results_path(kind, model=model, corpus=corpus, method=label, run=run)}"
            for label, runs in labels
            for run in runs
            for kind in kinds
        ]

    # --- job specs ---------------------------------------------------------------------------

    def method_entry(self, label: str) -> dict[str, Any]:
        """What a job gets of method `label` (a training job's `--method`): its MethodConfig
        with the options off their family's default, so a new option reruns nothing."""
        return self.config.methods[label].method.to_dict(defaults=False)

    def posttrain_spec(self, model: str, run: Run) -> dict[str, Any]:
        """The TrainSpec of a post-training job of config entry `model` on run `run` (its `base`
        and `seed`; TrainSpec.torch_seed seeds it); its threads come from `--threads`.
        `posttrain.lr_by_base` gives a base its own learning rate (testbed v3: a rate per base,
        docs/testbed.md); any other base trains at `posttrain.lr`."""
        spec = plain(self.config.posttrain)
        by_base = spec.pop("lr_by_base", None) or {}
        for name in CHECKPOINT_SETTINGS:  # in the environment: `checkpoint_settings`
            spec.pop(name, None)
        base = f"base{run.base}"
        if base in by_base.get(model, {}):
            spec["lr"] = by_base[model][base]
        return spec | {"base": run.base, "seed": run.seed}

    @property
    def checkpoint_settings(self) -> dict[str, Any]:
        """The post-training jobs' checkpoint settings (CHECKPOINT_SETTINGS) that the config
        sets, which the workflow puts in CHECKPOINTS_ENV and `rpb pipeline` adds to `--spec`."""
        posttrain = plain(self.config.posttrain)
        return {name: posttrain[name] for name in CHECKPOINT_SETTINGS if name in posttrain}

    def base_identity(self, model: str) -> dict[str, Any]:
        """What decides the bytes of config entry `model`'s pretrained base (rpb.pipeline.bases)."""
        entry, data = self.config.models[model].entry, self.config.data
        return base_identity(
            entry["model_type"],
            plain(entry["architecture"]),
            self.pretrain_spec(model),
            entry["pretrain"]["lbl_coef"],
            {
                "seed": data.seed,
                "preset": data.preset,
                "level": data.level,
                "holdout": data.holdout,
            },
        )

    def fixed_base(self, model: str, root: str, any_source: bool = False) -> str | None:
        """The committed base (`<model>/base<b>` under `root`) of config entry `model`'s identity:
        the base it starts from with config `bases: fixed` (else None: pretrain), or with
        `any_source` the one a base pretrained here is compared with."""
        if (self.config.bases != "fixed" and not any_source) or self.config.data.corpora:
            return None
        if self.config.models[model].source != "pretrain":
            return None
        return find_fixed_base(Path(root), self.base_identity(model))

    def pretrain_spec(self, model: str) -> dict[str, Any]:
        spec = plain(self.config.models[model].entry["pretrain"])
        spec.pop("lbl_coef")
        spec.setdefault("seed", 0)
        return spec

    def common_spec(self) -> dict[str, Any]:
        """What every table's spec carries: each model's bases, the OOD tasks, the corpus tasks,
        the scale, and with a claims section its statistics."""
        config = self.config
        spec = {
            "bases": {m: self.bases(m) for m, e in config.models.items() if e.replicate_of is None},
            "ood": list(config.evaluation.ood),
            "corpus_tasks": plain(config.evaluation.corpus_tasks),
            "scale": config.scale,
        }
        if (claims := config.claims) is not None:
            spec |= {
                "confidence": claims.confidence,
                "n_resamples": claims.n_resamples,
                "power": claims.power,
            }
        return spec

    # --- table 1 and the testbed -------------------------------------------------------------

    def table1_inputs(self) -> list[str]:
        """Table 1's runs, and the readings runs its check M2 reads where they are on table 1's
        model and corpus, so that table 1's own verdicts are judged from what its target builds
        (without them M2 is undetermined and C1/C2 read "not testable" after `make table1`)."""
        t1 = self.config.table1
        paths = self.run_outputs(t1.model, t1.corpus, t1.methods, self.config.seeds, base=True)
        readings = self.config.tables.get("readings")
        if readings is not None and (readings.model, readings.corpus) == (t1.model, t1.corpus):
            paths += self.readings_check_runs()
        return list(dict.fromkeys(paths))

    def m2_runs(self) -> list[Run]:
        """The runs check M2 reads on the readings' model: the confirmatory seeds (`tables.seeds`)
        on each base. M2 guards confirmatory parts, so it reads their power even where the
        exploratory readings table runs fewer seeds."""
        return self.runs(self.config.tables["readings"].model, self.confirmatory_seeds)

    def readings_check_runs(self) -> list[str]:
        """The run outputs manipulation check M2 reads: the readings rule's lower end, the
        configured method and its upper end on `m2_runs`; none without readings or claims."""
        readings = self.config.tables.get("readings")
        if readings is None or self.config.claims is None:
            return []
        labels = [readings.lower, self.config.claims.method, readings.upper]
        runs = self.m2_runs()
        return self.run_outputs(readings.model, readings.corpus, labels, [], runs=runs)

    def table1_spec(self) -> dict[str, Any]:
        config, t1 = self.config, self.config.table1
        return self.common_spec() | {
            "model": t1.model,
            "family": config.models[t1.model].family,
            "corpus": t1.corpus,
            "methods": list(t1.methods),
            "runs": run_names(self.runs(t1.model, config.seeds)),
            "in_domain": list(config.evaluation.in_domain),
        }

    def testbed_inputs(self) -> list[str]:
        corpus = self.config.table1.corpus
        paths = []
        for model in self.original_pretrained:
            # The testbed reads each model's own base (base 0) alone.
            paths += [
                self.path("eval", model=model, corpus=corpus, method="base", run=Run(0, 0)),
                self.base_prior(model, corpus, Run(0, 0)),
            ]
            paths += [
                self.path("eval", model=model, corpus=corpus, method="none", run=run)
                for run in runs_on(1, self.config.seeds)
            ]
        return paths

    def testbed_spec(self) -> dict[str, Any]:
        return {
            "models": self.original_pretrained,
            "corpus": self.config.table1.corpus,
            "seeds": list(self.config.seeds),
            "tasks": self.config.evaluation.tasks,
        }

    # --- tables 2-5, readings, drift, the sweep, the claims ------------------------------------

    def table_shape(self, name: str) -> Shape:
        """What table `name` reads and is given, as its module declares it (rpb.report.registry)."""
        job = REPORTS.get(name)
        if job is None or job.shape is None:
            raise KeyError(f"tables.{name}: no report job declares a table of that name")
        return job.shape

    @functools.cached_property
    def audited_tables(self) -> list[str]:
        """The tables the claims audit reads, in the registry's order (tables 2-5)."""
        return [key for key, job in REPORTS.items() if job.shape and job.shape.audited]

    def table_seeds(self, name: str) -> list[int]:
        """The seeds per base of table `name`: its own `seeds` (exploratory tables only), else
        `tables.seeds`, else the top-level seeds."""
        table = self.config.tables.get(name)
        own = table.seeds if table is not None and self.table_shape(name).exploratory else None
        return list(own or self.confirmatory_seeds)

    @property
    def confirmatory_seeds(self) -> list[int]:
        """The seeds per base of tables 2-5 and the controls: `tables.seeds`, else the top-level."""
        return list(self.config.table_seeds or self.config.seeds)

    def table_labels(self, name: str) -> list[str]:
        """The method labels whose runs table `name` reads: its shape's `labels`, each a key of
        its config entry (a list of labels or one) or a claims role, in order, each once."""
        labels: list[str] = []
        for key in self.table_shape(name).labels:
            if key.startswith("claims."):
                labels.append(getattr(self.config.claims, key.removeprefix("claims.")))
                continue
            value = self.config.tables[name].entry.get(key)
            labels += [value] if isinstance(value, str) else list(value or ())
        return list(dict.fromkeys(labels))

    def table_inputs(self, name: str) -> list[str]:
        """Every run output table `name` reads, as its shape says: its labels' runs on each of its
        models and corpora, with its bases' own runs on every corpus or on the first."""
        t, shape = self.config.tables[name], self.table_shape(name)
        seeds, labels = self.table_seeds(name), self.table_labels(name)
        paths = []
        for model in t.models:
            for i, corpus in enumerate(t.corpora):
                base = shape.base == "every corpus" or (shape.base == "first corpus" and i == 0)
                paths += self.run_outputs(model, corpus, labels, seeds, base, kinds=shape.reads)
        return paths

    def table_spec(self, name: str) -> dict[str, Any]:
        """The JSON spec a table job gets: the table's config entry, its runs (`runs`, by name)
        and statistics, and what its shape's `spec` adds (rpb.report.registry.SPEC_EXTRAS)."""
        config = self.config
        t = config.tables[name]
        # Runs pooled over each model's bases; config_check gives every pretrained model as many.
        # They spell out the entry's own `seeds` (seeds per base), which they replace.
        runs = run_names(self.runs(t.models[0], self.table_seeds(name)))
        entry = {k: v for k, v in plain(t.entry).items() if k != "seeds"}
        spec = self.common_spec() | entry | {"runs": runs}
        extras = {
            "family": lambda: {"family": config.models[t.model].family},
            "families": lambda: {"families": {m: config.models[m].family for m in t.models}},
            "claims": lambda: {
                "method": config.claims.method,
                "reference": config.claims.reference,
            },
            "kinds": lambda: {"kinds": {m: config.methods[m].method.kind for m in t.methods}},
            "trunk_frozen": lambda: {"trunk_frozen": self.trunk_frozen()},
        }
        for extra in self.table_shape(name).spec:
            spec |= extras[extra]()
        return spec

    def trunk_frozen(self) -> bool:
        """Whether post-training leaves the non-MoE trunk bitwise unchanged (`trainable` moe or
        narrower, no `trunk_lr_scale`): `hard`, whose routing is the base's, can then adapt
        through its routed experts alone, a handicap by construction that table 5 states."""
        posttrain = plain(self.config.posttrain)
        return posttrain.get("trainable", "all") != "all" and not posttrain.get("trunk_lr_scale")

    def _sweep_labels(self) -> list[str]:
        return list(dict.fromkeys(lb for c in self.config.sweep.curves for lb in c.labels))

    def sweep_runs(self) -> list[Run]:
        """The sweep's runs: its seeds on the model's first `sweep.bases` bases (all by default;
        testbed v3 trims the sweep to base 0 to keep `all` near its budget)."""
        sweep = self.config.sweep
        n_bases = len(self.bases(sweep.model))
        return runs_on(min(sweep.bases or n_bases, n_bases), sweep.seeds)

    def sweep_inputs(self) -> list[str]:
        sweep = self.config.sweep
        labels = self._sweep_labels()
        return self.run_outputs(sweep.model, sweep.corpus, labels, [], runs=self.sweep_runs())

    def sweep_spec(self) -> dict[str, Any]:
        sweep = self.config.sweep
        return self.common_spec() | {
            "model": sweep.model,
            "corpus": sweep.corpus,
            # Pooled over the bases it trains, as sweep_inputs.
            "runs": run_names(self.sweep_runs()),
            "curves": {c.name: list(c.labels) for c in sweep.curves},
            "methods": {lb: self.method_entry(lb) for lb in sorted(self._sweep_labels())},
        }

    def claims_spec(self) -> dict[str, Any]:
        config, t1 = self.config, self.config.table1
        spec = self.common_spec() | plain(config.claims.entry)
        spec["table1"] = {"model": t1.model, "corpus": t1.corpus, "methods": list(t1.methods)}
        spec["table1"]["runs"] = run_names(self.runs(t1.model, config.seeds))
        for name in self.audited_tables:
            spec[name] = self.table_spec(name)
        if "readings" in config.tables:  # manipulation check M2 applies the readings rule
            # ... on the runs readings_check_runs plans, not the readings table's own.
            runs = run_names(self.m2_runs())
            spec["readings"] = self.table_spec("readings") | {"runs": runs}
        # M0: the families whose premise the screen found not met (docs/testbed.md). The screen
        # judged the tiny testbed; the smoke scale is a plumbing run and the paper's models others.
        unmet = config.calibration.get("premise_not_met") or {}
        tiny = config.scale == "tiny"
        spec["premise_not_met"] = {m: why for m, why in unmet.items() if why} if tiny else {}
        return spec

    def controls_inputs(self) -> list[str]:
        """Runs the audit's controls compare (table 1's model and corpus, the tables' seeds)."""
        claims = self.config.claims
        if claims is None:
            return []
        labels = [label for label in (claims.placebo, claims.permuted) if label]
        t1 = self.config.table1
        return self.run_outputs(t1.model, t1.corpus, labels, self.confirmatory_seeds)

    def claims_runs(self) -> list[str]:
        """Every run output the claims audit reads, sorted: table 1's and the audited tables' (2-5)
        runs, and what its manipulation checks read beyond them: the readings rule's runs (M2),
        the testbed report's split-half stability (M6, tiny scale), and the controls."""
        paths = self.table1_inputs()
        for name in self.audited_tables:
            paths += self.table_inputs(name)
        paths += self.controls_inputs()
        paths += self.readings_check_runs()
        if self.config.scale != "paper":
            paths.append(f"{self.results}/testbed.json")
        return sorted(set(paths))

    # --- diagnostics -------------------------------------------------------------------------

    def diagnostic_targets(self) -> list[str]:
        """The diagnostics `all` builds: at tiny and smoke scale each configured one; at paper
        scale none (request them by name)."""
        if self.config.scale == "paper":
            return []
        diagnostics = self.config.diagnostics
        return [
            f"{self.results}/{out}"
            for name, out in DIAGNOSTIC_OUTPUTS.items()
            if getattr(diagnostics, name) is not None
        ]

    def diagnostic_seeds(self, section: str) -> list[int]:
        return list(getattr(self.config.diagnostics, section).seeds or self.config.seeds)

    @property
    def swap_root(self) -> str:
        return f"{self.results}/{SWAP_TREE}"

    @property
    def diagnostic_root(self) -> str:
        return f"{self.results}/{DIAGNOSTIC_TREE}"

    def router_swap_spec(self) -> dict[str, Any]:
        swap = self.config.diagnostics.router_swap
        return self.common_spec() | {
            "models": list(swap.models),
            "corpus": swap.corpus,
            "method": swap.method,
            # Each model's own base (base 0) alone, as this table has always read.
            "runs": run_names(runs_on(1, self.diagnostic_seeds("router_swap"))),
            "in_domain": list(self.config.evaluation.in_domain),
            "swap_tree": SWAP_TREE,
        }

    def swapped_model(self, model: str, corpus: str, method: str, run: Run) -> str:
        """A router-swap diagnostic's model folder (label `method`: rpb.router_swap)."""
        fields = {"model": model, "corpus": corpus, "method": method, "run": run}
        return f"{self.swap_root}/{results_path('swapped_model', **fields)}"

    def diagnostic_model_dir(self, model: str, corpus: str, method: str, run: Run) -> str:
        if method == "base":
            return self.base_model_dir(model, run)
        fields = {"model": model, "corpus": corpus, "method": method, "run": run}
        return f"{self.diagnostic_root}/{results_path('model', **fields)}"

    def diagnostic_table1_inputs(self) -> list[str]:
        """The diagnostic tree's evaluation and analysis outputs, laid out as table 1's."""
        regime = self.config.diagnostics.regime
        seeds = self.diagnostic_seeds("regime")
        return self.run_outputs(
            regime.model, regime.corpus, list(regime.methods), seeds, True, self.diagnostic_root
        )

    def diagnostic_spec(self, run: Run) -> dict[str, Any]:
        regime = self.config.diagnostics.regime
        spec = self.posttrain_spec(regime.model, run) | {"trainable": plain(regime.trainable)}
        if regime.trunk_lr_scale is not None:
            spec["trunk_lr_scale"] = regime.trunk_lr_scale
        return spec

    def diagnostic_table1_spec(self) -> dict[str, Any]:
        config, regime = self.config, self.config.diagnostics.regime
        return {
            "title": (
                f"Diagnostic table 1 ({regime.described}; the paper's "
                "numbers are for full post-training, not this regime)"
            ),
            "model": regime.model,
            "family": config.models[regime.model].family,
            "corpus": regime.corpus,
            "methods": list(regime.methods),
            # Every base's runs, as its inputs train them and table 1 reads them (the damped-trunk
            # arm is written as 2 seeds per base; the table read base 0 alone until 2026-12-05).
            "runs": run_names(self.runs(regime.model, self.diagnostic_seeds("regime"))),
            "in_domain": list(config.evaluation.in_domain),
            "ood": list(config.evaluation.ood),
            "corpus_tasks": plain(config.evaluation.corpus_tasks),
            "scale": config.scale,
        }
