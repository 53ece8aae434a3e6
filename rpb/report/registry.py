"""The report wing's registry: every report job (a table, the claims, the sweep, ...), with its
builder, its outputs as the Snakemake report shows them, and the columns its MLflow run logs as
headline metrics. Each job is declared by the module that builds it, in a module-level tuple
`REPORT_ENTRIES` of `ReportJob`s; a new table is one module of `rpb/report/` with its entry, and
nothing else names it.

The Snakefile, the CLI, the config check and the tracking read the entries at every parse, so the
registry reads them out of the modules' source (`declared_reports`) instead of importing the
builders (pandas, scipy, matplotlib: seconds per parse, and per job where a cluster parses the
Snakefile for each one). An entry is therefore written with the names of this module alone
(`DECLARATION_NAMES`: `ReportJob`, `Output`, `table_outputs`, the captions, `TABLE1_HEADLINE`);
anything else is refused with its file and line. Importing the module evaluates the same
expression, and tests/test_registry.py checks that both readings agree.

Who reads what:

- the CLI makes one job per entry but table 1 (which has its own), `rpb pipeline <key>` with the
  key's underscores as dashes (`router-swap-table`), importing the builder lazily;
- the config check accepts a `tables.<key>` for each entry;
- `workflow/rules/tables.smk` makes the rule of every `planned` entry from it: inputs and spec
  from the planner (`rpb.pipeline.plan.Plan.table_inputs`, `.table_spec`), outputs, log and
  command from here; the other entries keep a rule of their own (their inputs are special);
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


@dataclass(frozen=True)
class ReportJob:
    key: str
    builder: str | None  # its function in the declaring module; None: a job of its own (table 1)
    help: str
    category: str | None = None  # the Snakemake report's category of its items
    outputs: tuple[Output, ...] = ()
    # The columns naming a row, and the columns logged as its headline metrics.
    headline: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    planned: bool = False  # tables.smk makes its whole rule from this entry
    module: str = ""  # the module that declares it (filled in by `declared_reports`)

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
