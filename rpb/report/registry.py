"""The report wing's registry: every report job (a table, the claims, the sweep, ...), with its
builder, its outputs as the Snakemake report shows them, and the columns its MLflow run logs as
headline metrics. Plain data, light to import: the Snakefile, the CLI, the config check and the
tracking read it without importing a builder.

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

from dataclasses import dataclass

# Captions in workflow/report/ (the Snakemake report's text beside each item).
DATA, TABLE, COACTIVATION = "data.rst", "table.rst", "coactivation.rst"


@dataclass(frozen=True)
class Output:
    """One output of a report job: its rule's name for it and its path under the results folder;
    with a `caption` it is an item of the Snakemake report (`subcategory` under the job's
    category); `runs`: a folder of per-run co-activation figures, one item per run."""

    name: str
    path: str
    caption: str | None = None
    subcategory: str | None = None
    runs: bool = False


@dataclass(frozen=True)
class ReportJob:
    key: str
    builder: str | None  # "module:function"; None: a job of its own (table 1)
    help: str
    category: str | None = None  # the Snakemake report's category of its items
    outputs: tuple[Output, ...] = ()
    # The columns naming a row, and the columns logged as its headline metrics.
    headline: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    planned: bool = False  # its rule is made from this entry (a table of the plain kind)

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
                runs=True,
            ),
        )
    return outputs


_TABLE1_HEADLINE = (
    ("method",),
    ("in_domain", "in_domain_ci_low", "in_domain_ci_high", "in_domain_p", "in_domain_p_ci_low",
     "in_domain_p_ci_high", "ood_mean", "ood_mean_p"),
)  # fmt: skip


def _registry(*jobs: ReportJob) -> dict[str, ReportJob]:
    return {job.key: job for job in jobs}


REPORTS: dict[str, ReportJob] = _registry(
    ReportJob(
        "table1",
        None,
        "table 1: each method's accuracy and structure retention (family A)",
        headline=_TABLE1_HEADLINE,
    ),
    ReportJob(
        "table2",
        "rpb.report.tables:build_table2",
        "table 2: table 1's rows for the family-B model",
        "Table 2",
        table_outputs("table2"),
        _TABLE1_HEADLINE,
        planned=True,
    ),
    ReportJob(
        "table3",
        "rpb.report.tables:build_table3",
        "table 3: method vs reference on the independent corpus",
        "Table 3",
        table_outputs("table3", heatmaps=False),
        (
            ("metric", "method", "reference"),
            (
                "diff",
                "diff_ci_low",
                "diff_ci_high",
                "p_value",
                "diff_p",
                "diff_p_ci_low",
                "diff_p_ci_high",
                "p_value_p",
            ),
        ),
        planned=True,
    ),
    ReportJob(
        "table4",
        "rpb.report.tables:build_table4",
        "table 4: anchors and RPB, ranks and ordering consistency",
        "Table 4",
        table_outputs(
            "table4",
            Output("summary", "table4_summary.csv"),
            Output("consistency", "table4_consistency.csv", DATA, "Data"),
            Output("pairs", "table4_pairs.csv", DATA, "Data"),
        ),
        (("method", "seed"), ("in_domain", "ood_mean", "rank_in_domain", "rank_ood_mean")),
        planned=True,
    ),
    ReportJob(
        "table5",
        "rpb.report.tables:build_table5",
        "table 5: structure retention vs accuracy, hard routing",
        "Table 5",
        table_outputs(
            "table5",
            Output("correlation", "table5_correlation.csv", DATA, "Data"),
            Output("hard", "table5_hard.csv", DATA, "Data"),
            Output("base", "table5_base.csv", DATA, "Data"),
            Output("runs", "table5_runs.csv"),
            Output(
                "retention_in", "figures/retention_vs_in_domain.png", "retention.rst", "Figures"
            ),
            Output(
                "retention_ood", "figures/retention_vs_ood_mean.png", "retention.rst", "Figures"
            ),
        ),
        (
            ("method",),
            (
                "community_nmi",
                "coact_cosine",
                "topk_overlap_with_base",
                "in_domain",
                "in_domain_ci_low",
                "in_domain_ci_high",
                "ood_mean",
            ),
        ),
        planned=True,
    ),
    ReportJob(
        "sweep",
        "rpb.report.exploratory:build_sweep",
        "softness sweep: accuracy and retention against strength",
    ),
    ReportJob(
        "drift",
        "rpb.report.exploratory:build_drift",
        "training-time routing drift curves",
        "Training drift",
        (Output("csv", "drift.csv"), Output("figure", "figures/drift.png", "drift.rst")),
        planned=True,
    ),
    ReportJob(
        "readings",
        "rpb.report.exploratory:build_readings",
        "which RPB reading anchors (the default's rule)",
        "RPB readings",
        table_outputs(
            "rpb_readings",
            Output("runs", "rpb_readings_runs.csv"),
            Output("figure", "figures/rpb_readings.png", "readings_figure.rst", "Figures"),
            heatmaps=False,
        ),
        planned=True,
    ),
    ReportJob(
        "claims",
        "rpb.report.claims:build_claims",
        "claims audit C1-C6 (results/claims.csv)",
        headline=(("part",), ("estimate", "ci_low", "ci_high")),
    ),
    ReportJob(
        "router_swap_table",
        "rpb.report.router_swap_table:build_router_swap_table",
        "router-swap decomposition of a method's change by part (routers, experts, trunk)",
    ),
    ReportJob(
        "diagnostic_table1",
        "rpb.report.tables:build_table1",
        "table 1's rows in the diagnostic regime (posttrain.trainable; results/diagnostic)",
        headline=_TABLE1_HEADLINE,
    ),
)
# The report jobs of `rpb pipeline`: every entry with a builder.
REPORT_JOBS: dict[str, ReportJob] = {k: job for k, job in REPORTS.items() if job.builder}
