"""The report wing's registry: every report job (a table, the claims, the sweep, ...), with its
builder, its outputs as the Snakemake report shows them, the columns its MLflow run logs as
headline metrics, and for a table the pipeline plans, its `Shape` (the runs it reads, the keys of
its config entry, what its spec adds). Each job is declared by the module that builds it, in a
module-level tuple `REPORT_ENTRIES` of `ReportJob`s; a new table, of any shape, is one module of
`rpb/report/` with its entry, and nothing else names it.

The Snakefile, the CLI, the config check, the planner and the tracking read the entries at every
parse, so the registry reads them out of the modules' source (`declared_reports`) instead of
importing the builders (pandas, scipy, matplotlib: seconds per parse, and per job where a cluster
parses the Snakefile for each one). An entry is therefore written with the names of this module
alone (`DECLARATION_NAMES`: `ReportJob`, `Output`, `Shape`, `table_outputs`, the captions,
`TABLE1_HEADLINE`); anything else is refused with its file and line. Importing the module evaluates
the same expression, and tests/test_registry.py checks that both readings agree. This module
imports nothing but the standard library, so the pipeline's planner reads it without the report.

Who reads what:

- the CLI makes one job per entry but table 1 (which has its own), `rpb pipeline <key>` with the
  key's underscores as dashes (`router-swap-table`), importing the builder lazily;
- the config check accepts a `tables.<key>` for each entry with a shape, checks its keys against
  the schema its shape gives (where workflow/schemas/config.schema.yaml names no entry of its
  own) and its method labels, models and corpora against the config;
- `workflow/rules/tables.smk` makes the rule of every `planned` entry (one with a shape) from it:
  inputs and spec from the planner (`rpb.pipeline.plan.Plan.table_inputs`, `.table_spec`, which
  read the shape), outputs, log and command from here; the other entries keep a rule of their own
  (their inputs are special);
- rpb.pipeline.tracking logs each entry's `headline` columns as metrics of its run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from pathlib import Path

# Captions in workflow/report/ (the Snakemake report's text beside each item).
DATA, TABLE, COACTIVATION = "data.rst", "table.rst", "coactivation.rst"
# A folder of per-run co-activation figures: one report item per run.
RUN_FIGURES = ("{corpus}_base{base}_seed{seed}.png",)
RUN_LABELS = (("run", "{corpus} base {base} seed {seed}"),)


@dataclass(frozen=True)
class Output:
    """One output of a report job: its rule's name for it and its path under the results folder.
    With a `caption` it is an item of the Snakemake report, under the job's category (or its own
    `category`) and `subcategory`. With `patterns` it is a folder, whose files matching them are
    one report item each, named by `labels`."""

    name: str
    path: str
    caption: str | None = None
    subcategory: str | None = None
    patterns: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    category: str | None = None


# A shape's vocabulary. The run outputs a table may read (rpb.specs.PATHS' kinds of one run:
# model, corpus, method label, base and seed).
RUN_KINDS = ("eval", "analysis", "analysis_counts", "train_history")
# Whose own runs (label `base`) a table reads beside its methods': none, on every corpus it reads,
# or on its first corpus only.
BASE_RUNS = (None, "every corpus", "first corpus")
# The claims' method labels a table may read or must list (`claims.<role>`).
CLAIMS_ROLES = ("method", "reference")
# The keys of a table's config entry that say where its runs are, never labels.
PLACE_KEYS = ("model", "models", "corpus", "corpora", "seeds")
# What a table's spec may add to its config entry, its seeds and the statistics
# (rpb.pipeline.plan.Plan.table_spec).
SPEC_EXTRAS = {
    "family": "`family`: its model's family",
    "families": "`families`: each of its models' family, by model",
    "claims": "`method` and `reference`: claims.method and claims.reference",
    "kinds": "`kinds`: each of its `methods`' family, by label",
    "trunk_frozen": "`trunk_frozen`: whether post-training leaves the non-MoE trunk unchanged",
}


@dataclass(frozen=True)
class Shape:
    """What a table the pipeline plans reads and is given: the planner (rpb.pipeline.plan) makes
    its rule's inputs and spec from it, the config check the keys its config entry takes.

    - `labels`: the keys of its config entry that name method labels (a list, or one label), in
      the order its runs are read, and `claims.method` / `claims.reference` for the claims' pair;
      a label named twice is read once. Each key but the claims' is a required list of labels in
      the schema the shape gives (a table workflow/schemas/config.schema.yaml names keeps its own).
    - `models`, `corpora`: it reads several `models` (else one `model`), several `corpora` (else
      one `corpus`); it reads every label on every model and corpus.
    - `base`: each base's own runs too (label `base`), on "every corpus" or the "first corpus".
    - `reads`: the outputs of each run it reads (`RUN_KINDS`).
    - `spec`: what its spec adds (`SPEC_EXTRAS`).
    - `exploratory`: it may run its own `seeds` (fewer than the confirmatory tables';
      docs/claims.md, "Seeds per table").
    - `audited`: the claims audit reads it: a config with `claims` needs its entry, and the
      claims job gets its spec and reads its runs; `lists_claims`: the claims roles its `methods`
      must list.

    The default, `Shape()`, is the plain table: `methods` on one `model` and `corpus`.
    """

    labels: tuple[str, ...] = ("methods",)
    models: bool = False
    corpora: bool = False
    base: str | None = None
    reads: tuple[str, ...] = ("eval", "analysis")
    spec: tuple[str, ...] = ()
    exploratory: bool = False
    audited: bool = False
    lists_claims: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        claims = tuple(f"claims.{role}" for role in CLAIMS_ROLES)
        for field, values, known in (
            ("reads", self.reads, RUN_KINDS),
            ("spec", self.spec, tuple(SPEC_EXTRAS)),
            ("lists_claims", self.lists_claims, CLAIMS_ROLES),
        ):
            if not isinstance(values, tuple):
                raise ValueError(f"Shape.{field} must be a tuple")
            for value in values:
                if value not in known:
                    raise ValueError(f"Shape.{field}: {value!r} is not one of {', '.join(known)}")
        if not isinstance(self.labels, tuple) or not self.labels or not self.reads:
            raise ValueError("Shape.labels and Shape.reads must be non-empty tuples")
        for key in self.labels:
            if key not in claims and (
                not isinstance(key, str) or not key.isidentifier() or key in PLACE_KEYS
            ):
                raise ValueError(
                    f"Shape.labels: {key!r} is neither a key of its entry naming labels (not "
                    f"{', '.join(PLACE_KEYS)}) nor one of {', '.join(claims)}"
                )
        if self.base not in BASE_RUNS:
            raise ValueError(f"Shape.base: {self.base!r} is not one of {BASE_RUNS}")
        if "methods" not in self.labels and ("kinds" in self.spec or self.lists_claims):
            raise ValueError("Shape: spec 'kinds' and lists_claims read its `methods`: add them")
        if self.models and "family" in self.spec:
            raise ValueError("Shape.spec: a table of several models has 'families', not 'family'")

    @property
    def entry_keys(self) -> tuple[str, ...]:
        """The keys of its config entry that name method labels (`labels` but the claims')."""
        return tuple(key for key in self.labels if not key.startswith("claims."))

    @property
    def claims_roles(self) -> tuple[str, ...]:
        """The claims roles whose labels it reads or is given: it needs a `claims` section."""
        read = [key.removeprefix("claims.") for key in self.labels if key.startswith("claims.")]
        return tuple(dict.fromkeys(read + (list(CLAIMS_ROLES) if "claims" in self.spec else [])))


@dataclass(frozen=True)
class ReportJob:
    key: str
    builder: str | None  # its function in the declaring module; None: a job of its own (table 1)
    help: str
    category: str | None = None  # the Snakemake report's category of its items
    outputs: tuple[Output, ...] = ()
    # The columns naming a row, and the columns logged as its headline metrics.
    headline: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    # A table the pipeline plans: tables.smk makes its whole rule from this entry and its shape.
    shape: Shape | None = None
    module: str = ""  # the module that declares it (filled in by `declared_reports`)

    @property
    def planned(self) -> bool:
        return self.shape is not None

    @property
    def command(self) -> str:
        """Its job's name on the command line: `rpb pipeline <command>`."""
        return self.key.replace("_", "-")


def table_outputs(stem: str, *extra: Output, heatmaps: bool = True) -> tuple[Output, ...]:
    """A table's outputs: its CSV, Markdown and rendered page, `extra`, and with `heatmaps` the
    first seed's co-activation figure and every run's (the CSV first: its path is `--out`)."""
    outputs = (
        Output("csv", f"{stem}.csv", DATA, "Data"),
        Output("md", f"{stem}.md"),
        Output("html", f"{stem}.html", TABLE, "Table"),
        *extra,
    )
    if heatmaps:
        outputs += (
            Output("heatmaps", f"figures/{stem}_coactivation.png"),
            Output(
                "heatmaps_runs",
                f"figures/{stem}_coactivation_runs",
                COACTIVATION,
                "Co-activation per run",
                RUN_FIGURES,
                RUN_LABELS,
            ),
        )
    return outputs


# Table 1's and table 2's rows: the columns naming a row, and those logged as its metrics.
TABLE1_HEADLINE = (
    ("method",),
    ("in_domain", "in_domain_ci_low", "in_domain_ci_high", "in_domain_p", "in_domain_p_ci_low",
     "in_domain_p_ci_high", "ood_mean", "ood_mean_p"),
)  # fmt: skip

# What a module's `REPORT_ENTRIES` may name.
DECLARATION_NAMES = {
    "ReportJob": ReportJob,
    "Output": Output,
    "Shape": Shape,
    "table_outputs": table_outputs,
    "DATA": DATA,
    "TABLE": TABLE,
    "COACTIVATION": COACTIVATION,
    "TABLE1_HEADLINE": TABLE1_HEADLINE,
}
ENTRIES_NAME = "REPORT_ENTRIES"


class RegistryError(ValueError):
    """A module's report entries cannot be read (one line, naming its file and line)."""


def _entries_node(tree: ast.Module) -> ast.expr | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == ENTRIES_NAME for t in node.targets
        ):
            return node.value
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == ENTRIES_NAME
        ):
            return node.value
    return None


def read_entries(path: Path, module: str) -> tuple[ReportJob, ...]:
    """The report jobs a module's source declares in `REPORT_ENTRIES` (none without one), each
    with `module` set; evaluated with `DECLARATION_NAMES` alone, without importing the module."""
    source = path.read_text(encoding="utf-8")
    if ENTRIES_NAME not in source:
        return ()
    node = _entries_node(ast.parse(source, filename=str(path)))
    if node is None:
        return ()
    where = f"{path}:{node.lineno}"
    for part in ast.walk(node):
        if isinstance(part, ast.Attribute):
            named = f"'{ast.unparse(part)}'"
        elif isinstance(part, ast.Name) and part.id not in DECLARATION_NAMES:
            named = f"'{part.id}'"
        else:
            continue
        raise RegistryError(
            f"{path}:{part.lineno}: {ENTRIES_NAME} names {named}; an entry may use only "
            f"{', '.join(DECLARATION_NAMES)} and literals (the registry reads it unimported)"
        )
    try:
        # Safe to evaluate: checked above to be calls of the registry's names on literals.
        jobs = eval(
            compile(ast.Expression(node), str(path), "eval"),
            {"__builtins__": {}, **DECLARATION_NAMES},
        )
    except Exception as err:  # a wrong argument, say: name the entry's place, not a traceback
        raise RegistryError(f"{where}: {ENTRIES_NAME} cannot be read: {err}") from None
    if not isinstance(jobs, tuple) or not all(isinstance(j, ReportJob) for j in jobs):
        raise RegistryError(f"{where}: {ENTRIES_NAME} must be a tuple of ReportJob")
    return tuple(replace(job, module=module) for job in jobs)


def declared_reports(
    folder: Path = Path(__file__).parent, package: str = __package__
) -> dict[str, ReportJob]:
    """Every report job declared by a module of `folder` (the report wing), by key, in the
    order of the modules' names and then of their declarations."""
    reports: dict[str, ReportJob] = {}
    for path in sorted(folder.glob("*.py")):
        for job in read_entries(path, f"{package}.{path.stem}"):
            if job.key in reports:
                raise RegistryError(
                    f"{path}: report job '{job.key}' is also declared by {reports[job.key].module}"
                )
            reports[job.key] = job
    return reports


REPORTS: dict[str, ReportJob] = declared_reports()
# The report jobs of `rpb pipeline`: every entry with a builder.
REPORT_JOBS: dict[str, ReportJob] = {k: job for k, job in REPORTS.items() if job.builder}
