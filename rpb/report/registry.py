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
    builder: str | None  # "module:function"; None: a job of its own (table 1)
    help: str
    category: str | None = None  # the Snakemake report's category of its items
    outputs: tuple[Output, ...] = ()
    # The columns naming a row, and the columns logged as its headline metrics.
    headline: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    planned: bool = False  # tables.smk makes its whole rule from this entry

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
        "Sweep",
        table_outputs(
            "sweep",
            Output("runs", "sweep_runs.csv"),
            Output("matched", "sweep_table4_matched.csv", DATA, "Data"),
            Output("matched_md", "sweep_table4_matched.md"),
            Output("matched_html", "sweep_table4_matched.html", TABLE, "Table"),
            Output("figure", "figures/sweep.png", "sweep_figure.rst", "Figures"),
            heatmaps=False,
        ),
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
        "Claims",
        (
            Output("csv", "claims.csv", DATA, "Data"),
            Output("md", "claims.md"),
            Output("html", "claims.html", "claims.rst", "Verdicts"),
            # One page per table: its claims, their verdicts and the premises they depend on,
            # shown in that table's category.
            Output(
                "by_table",
                "claims_by_table",
                "claims_by_table.rst",
                "Claims on this table",
                ("table{n}_claims.html",),
                category="Table {n}",
            ),
        ),
        (("part",), ("estimate", "ci_low", "ci_high")),
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
