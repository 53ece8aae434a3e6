"""rpb.report.render, the one writer of every table: CSV with 4 decimals, side CSVs beside it,
Markdown `<title>. <note>` with its sections, the provenance side file, and the co-activation
heatmaps."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from result_worlds import PAPER_WORLD, write_run

from rpb.report.render import coactivation_figure, side_path, write_table
from rpb.specs import Run

TABLE = pd.DataFrame({"method": ["none", "rpb"], "score": [1 / 3, 12.345678]})


def test_a_table_its_sides_markdown_and_provenance(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "mytable.csv"
    empty = TABLE.iloc[:0]
    stem = write_table(
        out,
        TABLE,
        title="My table",
        note="A note.",
        sections=[("Rows", TABLE), ("", empty)],
        side={"runs": TABLE.head(1)},
        meta={"seeds": [0, 1]},
    )
    assert stem == tmp_path / "sub" / "mytable"
    assert out.read_text() == "method,score\nnone,0.3333\nrpb,12.3457\n"
    assert side_path(out, "runs") == tmp_path / "sub" / "mytable_runs.csv"
    assert pd.read_csv(side_path(out, "runs"))["method"].tolist() == ["none"]
    assert json.loads(out.with_suffix(".meta.json").read_text()) == {"seeds": [0, 1]}
    markdown = out.with_suffix(".md").read_text()
    body = TABLE.to_markdown(index=False, floatfmt=".3g")
    assert markdown == f"My table. A note.\n\nRows\n\n{body}\n\n(no rows)\n"
    assert "|  12.3   |" in markdown and "0.333 |" in markdown  # 3 significant digits


def test_no_title_writes_the_csv_alone(tmp_path: Path) -> None:
    write_table(tmp_path / "t.csv", TABLE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]
    write_table(tmp_path / "u.csv", TABLE, title="U", floatfmt=".2f")
    assert (tmp_path / "u.md").read_text().startswith("U. \n\n| method")
    assert "12.35" in (tmp_path / "u.md").read_text()


def test_coactivation_heatmaps_of_the_base_and_the_methods(tmp_path: Path) -> None:
    for label in ("base", "none", "rpb"):
        write_run(tmp_path, "m", "math", label, Run(0, 0), PAPER_WORLD[label])
    stem = tmp_path / "figures" / "mytable_coactivation"
    paths = coactivation_figure(tmp_path, "m", "math", ["none", "rpb"], Run(0, 0), stem)
    assert [p.name for p in paths] == ["mytable_coactivation.png", "mytable_coactivation.pdf"]
    assert all(p.stat().st_size > 1000 for p in paths)
