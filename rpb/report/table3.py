"""Table 3: method vs reference on the independently generated corpus, per model, as a paired
per-run difference with its t-interval, p-value and minimum detectable effect
(`rpb.report.tables.TableContext.compare`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from rpb.report.registry import ReportJob, Shape, table_outputs
from rpb.report.render import write_table
from rpb.report.run_records import in_domain_tasks, runs_text
from rpb.report.tables import (
    TableContext,
    in_domain_text,
    interval_text,
    measures_text,
    run_level,
)
from rpb.specs import spec_runs

# The report jobs this module builds (rpb.report.registry reads them from this source).
REPORT_ENTRIES = (
    ReportJob(
        "table3",
        "build_table3",
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
        # claims.method against claims.reference on each model.
        Shape(
            ("claims.method", "claims.reference"),
            models=True,
            spec=("claims", "families"),
            audited=True,
        ),
    ),
)


def table3_frame(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """Per model and metric: method - reference on `spec['corpus']` (see `TableContext.compare`)."""
    corpus, method, reference = spec["corpus"], spec["method"], spec["reference"]
    rows = []
    for model in spec["models"]:
        for metric in ("in_domain", "ood"):
            family = spec.get("families", {}).get(model, "")
            rows.append(
                {"model": model, "family": family, "corpus": corpus, "metric": metric}
                | TableContext(Path(results), spec, model).compare_row(
                    [corpus], method, reference, metric, spec_runs(spec), other_name="reference"
                )
            )
    return pd.DataFrame(rows)


def build_table3(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 3 (CSV and Markdown): method vs reference per model on the independent corpus,
    paired per run (base and seed), with a t-interval, p-value and MDE (scores in percent)."""
    table = table3_frame(results, spec)
    note = (
        f"{spec['method']} minus {spec['reference']} after post-training on the independently "
        f"generated corpus `{spec['corpus']}` ({spec.get('scale')} scale, "
        f"{runs_text(spec_runs(spec))}). {measures_text(spec)} diff: mean of the per-run paired "
        f"differences (a run's in_domain: {in_domain_text(in_domain_tasks(spec, spec['corpus']))}"
        "; ood: the mean of the OOD tasks), "
        f"{interval_text(spec, 'runs')} and the paired t-test's p-value, so p < 1 - level "
        "exactly when the CI excludes zero; mde: the difference found with "
        f"{100 * run_level(spec)['power']:g}% power (docs/claims.md)."
    )
    write_table(Path(out_csv), table, title="Table 3", note=note)
    return table
