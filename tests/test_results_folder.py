"""rpb/pipeline/results_folder.py: the integrity records of what the library's atomic writes put
under the results folder, the check of a results folder before any job runs and its one-line
rebuild command. Its locks: tests/test_concurrency.py and tests/test_faults.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_artifacts import _prior

from rpb import artifacts
from rpb.artifacts import write_text
from rpb.pipeline.results_folder import (
    RECORDS,
    RESULTS_ENV,
    IntegrityRecords,
    Problem,
    check_results,
    integrity_message,
    rebuild_target,
    record_artifact,
    record_folder,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A results folder whose writes are recorded (as the workflow sets it for every job)."""
    folder = tmp_path / "results"
    folder.mkdir()
    monkeypatch.setenv(RESULTS_ENV, str(folder))
    return folder


# --- the check of a results folder ----------------------------------------------------------------


def test_recorded_files_must_keep_their_size_and_content(results: Path) -> None:
    prior = results / "priors" / "m" / "math.safetensors"
    artifacts.save_safetensors({"usage": torch.arange(64, dtype=torch.float32)}, prior)
    table = write_text(results / "table1.csv", "method,acc\nnone,1\n")
    assert check_results(results) == []
    data = prior.read_bytes()
    prior.write_bytes(data[: len(data) // 2])  # truncated, with a fresh mtime
    table.write_text("method,acc\nnone,2\n")  # same size, other content
    problems = check_results(results)
    assert [Path(p.path).name for p in problems] == ["math.safetensors", "table1.csv"]
    assert problems[0].what.startswith(f"{len(data) // 2} bytes, {len(data)} when it was written")
    assert "other content" in problems[1].what


def test_a_touched_file_with_its_bytes_passes_and_its_record_is_refreshed(results: Path) -> None:
    table = write_text(results / "table1.csv", "method,acc\n")
    record = results / RECORDS / "table1.csv.json"
    os.utime(table, ns=(1, 1))  # Snakemake touches finished outputs
    assert check_results(results, update=False) == []
    assert json.loads(record.read_text())["mtime_ns"] != 1
    assert check_results(results, update=True) == []
    assert json.loads(record.read_text())["mtime_ns"] == 1  # no rehash next time


def test_records_of_deleted_outputs_are_dropped(results: Path) -> None:
    write_text(results / "eval" / "seed0.json", "{}").unlink()  # Snakemake reruns its job
    assert check_results(results, update=False) == []
    assert (results / RECORDS / "eval" / "seed0.json.json").exists()  # a dry run writes nothing
    check_results(results, update=True)
    assert not (results / RECORDS / "eval" / "seed0.json.json").exists()


def test_unrecorded_files_get_a_format_check(tmp_path: Path) -> None:
    """Files written by code that does not record them yet (lm-eval's output, transformers'
    save_pretrained): JSON parses, safetensors is as long as its header, model folders are
    complete. Checkpoints and lm-eval work folders are not looked at."""
    results = tmp_path / "results"
    (results / "eval").mkdir(parents=True)
    (results / "eval" / "seed0.json").write_text('{"tasks": {"math": [1, 0')
    _prior(results / "priors" / "m" / "base0" / "math.safetensors")
    prior = results / "priors" / "m" / "base0" / "math.safetensors"
    prior.write_bytes(prior.read_bytes()[:-10])
    model = results / "models" / "m" / "base0" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    sharded = results / "runs" / "m" / "model"
    sharded.mkdir(parents=True)
    (sharded / "config.json").write_text("{}")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    _prior(sharded / "model-1.safetensors")
    (results / "runs" / "checkpoints").mkdir()
    (results / "runs" / "checkpoints" / "trainer_state.json").write_text("{")
    (results / "eval" / "seed0.work").mkdir()
    (results / "eval" / "seed0.work" / "cache.json").write_text("{")
    found = {Path(p.path).relative_to(results).as_posix(): p.what for p in check_results(results)}
    assert found == {
        "eval/seed0.json": (
            "not valid JSON (Expecting ',' delimiter at line 1 column 25): truncated or damaged"
        ),
        "models/m/base0/model": (
            "model folder without model.safetensors (no weights file): incomplete"
        ),
        "priors/m/base0/math.safetensors": found["priors/m/base0/math.safetensors"],
        "runs/m/model": (
            "model folder without model-2.safetensors (listed in model.safetensors.index.json): "
            "incomplete"
        ),
    }
    assert found["priors/m/base0/math.safetensors"].endswith(": truncated")


def test_a_damaged_record_is_named_and_its_file_still_gets_the_format_check(results: Path) -> None:
    """Issue 47: a damaged record used to switch off both checks of its file (a half eval JSON
    then failed table1 after 12 files were deleted; a 100-byte table1.csv was kept for good)."""
    table = write_text(results / "table1.csv", "method,acc,ci\n" + "none,0.51,0.02\n" * 20)
    score = write_text(results / "eval" / "seed0.json", json.dumps({"acc": [0.5] * 40}) + "\n")
    intact = write_text(results / "table2.csv", "method,acc\nnone,1\n")
    for path in (table, score, intact):
        record_artifact(path)
        record = results / RECORDS / f"{path.relative_to(results)}.json"
        record.write_text('{"size": 3')  # cut short
    table.write_bytes(table.read_bytes()[:100])
    score.write_bytes(score.read_bytes()[: score.stat().st_size // 2])
    problems = check_results(results, update=True)
    found = [(Path(p.path).relative_to(results).as_posix(), p.record_of) for p in problems]
    assert found == [
        ("eval/seed0.json", None),
        ("table1.csv", None),
        (f"{RECORDS}/eval/seed0.json.json", str(score)),
        (f"{RECORDS}/table1.csv.json", str(table)),
        (f"{RECORDS}/table2.csv.json", str(intact)),
    ]
    assert problems[1].what == "CSV whose last line has no line end: truncated"
    assert problems[4].what.startswith(f"damaged integrity record of {intact} (not valid JSON")
    assert (results / RECORDS / "table2.csv.json").exists()  # named, not dropped unseen
    line = integrity_message(problems[4:], lambda p: p, ["snakemake", "--cores", "1"])
    assert line.endswith(
        f"; rebuild: rm -rf {results / RECORDS / 'table2.csv.json'} && snakemake --cores 1"
    )
    # Issue 59, item 4: the advice kept no target, so it built rule `all` (89 smoke jobs) after
    # a table 1 run; it repeats the invocation's targets, as the kill recovery does.
    line = integrity_message(problems[4:], lambda p: p, ["snakemake", "--cores", "1"], [str(table)])
    assert line.endswith(
        f"; rebuild: rm -rf {results / RECORDS / 'table2.csv.json'} && snakemake --cores 1 -- "
        f"{table}"
    )


def test_every_output_format_gets_a_content_check(tmp_path: Path) -> None:
    """CSV/TSV, JSON lines, PNG, HTML and Markdown without a record: complete files pass, cut or
    empty ones are named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    results = tmp_path / "results"
    results.mkdir()
    frame = pd.DataFrame({"method": ["none", 'a,"b"\nc'], "acc": [0.5, float("nan")]})
    frame.to_csv(results / "good.csv", index=False)
    frame.to_csv(results / "good.tsv", index=False, sep="\t")
    (results / "good.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    fig = plt.figure(figsize=(1, 1))
    fig.savefig(results / "good.png")
    plt.close(fig)
    (results / "good.html").write_text("<!DOCTYPE html>\n<html>\n<body>x</body>\n</html>\n")
    (results / "good.md").write_text("| a |\n|---|\n| 1 |")
    good = {name: (results / name).read_bytes() for name in os.listdir(results)}
    assert check_results(results) == []
    bad = results / "bad"
    bad.mkdir()
    for name, data in good.items():
        (bad / name).write_bytes(data[: len(data) * 2 // 3])
    (bad / "good.md").write_bytes(b"")
    (bad / "ragged.csv").write_text("a,b\n1,2,3\n")
    (bad / "header_only.csv").write_text("a,b\n")  # a header alone is a table
    (bad / "latin1.csv").write_bytes("m\u00e9thode\n1\n".encode("latin-1"))
    found = {Path(p.path).name: p.what for p in check_results(results)}
    assert found == {
        "good.csv": "CSV whose last line has no line end: truncated",
        "good.tsv": "TSV whose last line has no line end: truncated",
        "good.jsonl": "JSON-lines file whose last line has no line end: truncated",
        "good.png": found["good.png"],
        "good.html": "HTML page without its closing </html>: truncated",
        "good.md": "empty Markdown file (0 bytes): truncated or damaged",
        "ragged.csv": "CSV row 2 has 3 fields, its header 2: truncated or damaged",
        "latin1.csv": "not a UTF-8 CSV file (invalid byte at offset 1): damaged",
    }
    assert found["good.png"].endswith("a PNG image without its end (IEND chunk): truncated")


def test_an_unrecorded_eval_output_with_a_nan_score_is_named(tmp_path: Path) -> None:
    """Issue 47: an eval JSON written before integrity records, with a NaN score, passed the
    check; table1 then failed after Snakemake had deleted its outputs. Now the check names it,
    before any job runs. Other NaNs (lm-eval's statistics) are left alone."""
    results = tmp_path / "results"
    (results / "eval").mkdir(parents=True)
    scores = {"rpb_math": {"items": [1, 0], "stderr": float("nan")}}
    (results / "eval" / "good.json").write_text(json.dumps({"tasks": scores}))
    scores |= {"rpb_math_ll": {"items": [-0.5, -1.0], "p_target": [0.2, float("nan")]}}
    (results / "eval" / "nan.json").write_text(json.dumps({"tasks": scores}))
    assert [(Path(p.path).name, p.what) for p in check_results(results)] == [
        (
            "nan.json",
            "task rpb_math_ll: 1 of 2 p_target scores are not finite (NaN or inf): damaged, or "
            "its evaluation failed",
        )
    ]


def test_rebuild_target_is_the_declared_output_that_rewrites_a_damaged_file(
    tmp_path: Path,
) -> None:
    """A declared file is its own target; a file inside a declared folder (a model's weights)
    is that folder; an undeclared side file is the declared output beside it sharing the
    longest prefix of its name; with none beside it, the file itself."""
    results = str(tmp_path / "results")
    model = f"{results}/models/tinyA/base0/model"
    os.makedirs(model)
    os.makedirs(f"{results}/logs")
    for name in ("table1.md", "table1.csv", "table2.md", "table1.meta.json", "logs/table1.log"):
        Path(results, name).write_text("")
    declared = {model, f"{results}/table1.md", f"{results}/table1.csv", f"{results}/table2.md"}

    def target(path: str) -> str:
        return rebuild_target(path, results, declared.__contains__)

    assert target(f"{results}/table1.csv") == f"{results}/table1.csv"
    assert target(f"{model}/model.safetensors") == model
    assert target(f"{results}/table1.meta.json") == f"{results}/table1.md"
    assert target(f"{results}/logs/table1.log") == f"{results}/logs/table1.log"


def test_integrity_message_is_one_line_with_a_rebuild_command() -> None:
    problems = [
        Problem(
            "results/priors/m/base0/math.safetensors", "10 bytes, 20 when it was written: truncated"
        ),
        Problem("results/table1.meta.json", "not valid JSON (...): truncated or damaged"),
    ]
    targets = {"results/table1.meta.json": "results/table1.md"}
    line = integrity_message(
        problems,
        lambda p: targets.get(p, p),
        ["snakemake", "--cores", "2", "--configfile", "config/smoke.yaml"],
    )
    assert "\n" not in line
    assert line == (
        "integrity error: results/priors/m/base0/math.safetensors: 10 bytes, 20 when it was "
        "written: truncated (+1 more); rebuild: rm -rf results/priors/m/base0/math.safetensors "
        "results/table1.meta.json && snakemake --cores 2 --configfile config/smoke.yaml --force "
        "-- results/priors/m/base0/math.safetensors results/table1.md"
    )


def test_writes_under_the_results_folder_are_recorded(results: Path, tmp_path: Path) -> None:
    path = write_text(results / "eval" / "m" / "seed0.json", '{"a": 1}\n')
    record = json.loads((results / RECORDS / "eval" / "m" / "seed0.json.json").read_text())
    assert record["size"] == 9 and record["sha256"] == artifacts.sha256_of(path)
    write_text(tmp_path / "elsewhere.json", "{}")  # outside the results folder: no record
    assert sorted(p.name for p in (results / RECORDS).rglob("*.json")) == ["seed0.json.json"]


def test_record_artifact_with_an_explicit_root(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b.json"
    path.parent.mkdir()
    path.write_text("{}")
    record = record_artifact(path, root=tmp_path)
    assert record == tmp_path / RECORDS / "a" / "b.json.json"


def test_a_recorded_model_folder_is_checked_file_by_file(results: Path) -> None:
    """`record_folder`, which `atomic_folder` calls for the model folders of rpb.pipeline.training
    and rpb.router_swap (tests/test_faults.py runs them)."""
    model = results / "models" / "m" / "base0" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    _prior(model / "model.safetensors")
    (model / ".snakemake_timestamp").write_text("")
    records = record_folder(model)
    assert [r.name for r in records] == ["config.json.json", "model.safetensors.json"]
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[:100])
    (problem,) = check_results(results)
    assert problem == Problem(
        str(model / "model.safetensors"),
        f"100 bytes, {len(weights)} when it was written: truncated or changed since",
    )


# --- model folders: written whole, recorded, a lost file named ------------------------------------


def _model_files(folder: Path) -> None:
    (folder / "config.json").write_text("{}")
    _prior(folder / "model.safetensors")


def test_atomic_folder_appears_whole_with_its_records(results: Path) -> None:
    model = results / "runs" / "m" / "model"
    with artifacts.atomic_folder(model) as tmp:
        assert tmp == artifacts.partial_folder(model) and tmp.name.startswith(".")
        _model_files(tmp)
        (tmp / "eval_routing").mkdir()
        write_text(tmp / "eval_routing" / "method.json", "{}")  # an atomic writer inside it
        assert not model.exists()  # nothing to read until it is complete
    assert sorted(p.name for p in model.parent.iterdir()) == ["model"]
    records = results / RECORDS / "runs" / "m"
    assert sorted(p.relative_to(records).as_posix() for p in records.rglob("*.json")) == [
        "model/config.json.json",
        "model/eval_routing/method.json.json",
        "model/model.safetensors.json",
    ]  # none left for the temporary folder
    assert check_results(results) == []
    # Written again without eval_routing: the folder is replaced whole, its old records go.
    with artifacts.atomic_folder(model) as tmp:
        _model_files(tmp)
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in records.rglob("*.json")) == [
        "config.json.json",
        "model.safetensors.json",
    ]
    assert check_results(results, update=True) == []


def test_atomic_folder_leaves_nothing_when_its_writer_fails(results: Path) -> None:
    model = results / "runs" / "m" / "model"
    with pytest.raises(RuntimeError), artifacts.atomic_folder(model) as tmp:
        _model_files(tmp)
        write_text(tmp / "method.json", "{}")  # recorded under the temporary folder's name
        raise RuntimeError("killed mid-save")
    assert list(model.parent.iterdir()) == []
    assert not list((results / RECORDS).rglob("*.json"))
    with artifacts.atomic_folder(model) as tmp:
        _model_files(tmp)
    before = sorted(p.name for p in model.iterdir())
    # An OSError on a file of the temporary folder names that file in the model folder.
    with pytest.raises(OSError) as raised, artifacts.atomic_folder(model) as tmp:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))
    assert raised.value.filename == str(model / "model.safetensors")
    assert sorted(p.name for p in model.iterdir()) == before  # the previous folder is kept
    assert sorted(p.name for p in model.parent.iterdir()) == ["model"]


def test_a_lost_file_of_a_recorded_model_folder_is_named(results: Path) -> None:
    """A recorded file missing from a model folder that is still there is damage (Snakemake
    removes a model folder whole before its job rewrites it); named as the file, not as an
    incomplete folder, and its record kept until the folder is rebuilt."""
    model = results / "models" / "m" / "base" / "model"
    with artifacts.atomic_folder(model) as tmp:
        _model_files(tmp)
    (model / "model.safetensors").unlink()
    for update in (False, True):
        assert check_results(results, update=update) == [
            Problem(
                str(model / "model.safetensors"), "missing, recorded when its folder was written"
            )
        ]
    shutil.rmtree(model)
    assert check_results(results, update=True) == []
    assert not list((results / RECORDS).rglob("*.json"))


def test_a_pipeline_job_records_what_the_library_writes(tmp_path: Path) -> None:
    """Importing rpb.pipeline (every job's first import) installs the integrity records, so a
    library write in a job under the results folder is recorded; the library alone records
    nothing."""
    results = tmp_path / "results"
    script = (
        "import sys; from rpb import artifacts\n"
        "if sys.argv[1] == 'pipeline': import rpb.pipeline.cli\n"
        "artifacts.write_text(sys.argv[2] + '/table1.csv', 'a\\n1\\n')\n"
    )
    env = {**os.environ, RESULTS_ENV: str(results)}
    for kind in ("library", "pipeline"):
        subprocess.run([sys.executable, "-c", script, kind, str(results)], env=env, check=True)
        recorded = sorted(p.name for p in (results / RECORDS).rglob("*.json"))
        assert recorded == ([] if kind == "library" else ["table1.csv.json"]), kind
    assert type(artifacts.install_recorder(IntegrityRecords())) is IntegrityRecords
