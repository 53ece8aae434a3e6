"""rpb/artifacts.py: atomic writes (nothing partial after a full disk), the recorder they tell,
the one-line failure descriptions, and `rpb pipeline table1` on a full disk. The results folder's
integrity records and check: tests/test_results_folder.py.

The full-disk cases write to a small tmpfs (`mount -t tmpfs`, root only; skipped otherwise)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rpb import artifacts
from rpb.artifacts import ArtifactRecorder, atomic_path, failure_line, install_recorder, write_text

ROOT = Path(__file__).resolve().parents[1]


def _small_disk(where: Path, size: str) -> Iterator[Path]:
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a full disk needs a tmpfs: root only")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
    if done.returncode != 0:
        pytest.skip("mount -t tmpfs is not allowed here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs."""
    yield from _small_disk(tmp_path / "disk", "1m")


def _fill(disk: Path, leave: int = 0) -> None:
    """Fill `disk` up, then free `leave` bytes again."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    if leave:
        os.truncate(filler, filler.stat().st_size - leave)


def _leftovers(folder: Path) -> list[str]:
    """Partial outputs: 0-byte files and temporary files of an atomic write."""
    return sorted(
        str(p)
        for p in folder.rglob("*")
        if p.is_file() and p.name != "filler" and (p.stat().st_size == 0 or p.name.endswith(".tmp"))
    )


# --- atomic writes --------------------------------------------------------------------------------


def test_a_full_disk_leaves_the_previous_file_and_no_partial_one(disk: Path) -> None:
    old = disk / "table.csv"
    old.write_text("a,b\n1,2\n")
    _fill(disk)
    with pytest.raises(OSError) as raised:
        write_text(old, "a,b\n" + "3,4\n" * 10_000)
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == str(old)  # the user's file, not the temporary one
    assert old.read_text() == "a,b\n1,2\n"
    with pytest.raises(OSError):
        write_text(disk / "new.md", "x" * 100_000)
    assert not (disk / "new.md").exists()
    assert _leftovers(disk) == []


def test_a_failing_writer_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text('{"half": ')
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def _prior(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"usage": torch.arange(64, dtype=torch.float32)}, str(path))


def test_writes_are_told_to_the_installed_recorder_alone(tmp_path: Path) -> None:
    """The library records nothing itself: each completed write, folder and removal is told to
    the recorder installed last (the pipeline's writes integrity records), and none is told of
    a write that failed."""
    told: list[tuple[str, str]] = []

    class Spy(ArtifactRecorder):
        def file_written(self, path: Path) -> None:
            told.append(("file", path.name))

        def folder_written(self, path: Path) -> None:
            told.append(("folder", path.name))

        def folder_discarded(self, path: Path) -> None:
            told.append(("discarded", path.name))

        def file_removed(self, path: Path) -> None:
            told.append(("removed", path.name))

    previous = install_recorder(Spy())
    try:
        write_text(tmp_path / "a.json", "{}")
        with pytest.raises(RuntimeError), atomic_path(tmp_path / "b.json") as tmp:
            tmp.write_text("{")
            raise RuntimeError("killed mid-write")
        with atomic_path(tmp_path / "c.json", record=False) as tmp:
            tmp.write_text("{}")
        with artifacts.atomic_folder(tmp_path / "model") as tmp:
            (tmp / "config.json").write_text("{}")
        assert artifacts.remove_artifact(tmp_path / "a.json")
    finally:
        assert type(install_recorder(previous)) is Spy
    assert told == [
        ("file", "a.json"),
        ("discarded", ".model.partial"),
        ("folder", "model"),
        ("removed", "a.json"),
    ]


# --- one line per failure -------------------------------------------------------------------------


def _read_json(path: Path) -> object:
    return json.loads(path.read_text())  # as rpb.report.run_records reads eval outputs


def test_a_truncated_json_is_named_by_the_failure_line(tmp_path: Path) -> None:
    path = tmp_path / "eval" / "seed0.json"
    path.parent.mkdir()
    path.write_text('{"tasks": {"math": {"items": [1, 0, 1')
    with pytest.raises(json.JSONDecodeError) as raised:
        _read_json(path)
    line = failure_line(raised.value)
    assert line == (
        f"{path}: not valid JSON (Expecting ',' delimiter at line 1 column 38): truncated or "
        "damaged; delete it and rerun the pipeline to rebuild it"
    )


def test_a_truncated_safetensors_file_is_named_by_the_failure_line(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    _prior(path)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(Exception) as raised:
        load_file(str(path))
    line = failure_line(raised.value)
    assert line is not None and line.startswith(f"{path}: Error while deserializing header")
    assert line.endswith("truncated or damaged; delete it and rerun the pipeline to rebuild it")


def test_failure_lines_of_os_errors(tmp_path: Path) -> None:
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "t.csv"))
    assert failure_line(full).startswith(f"{tmp_path / 't.csv'}: No space left on device (")
    nameless = OSError(errno.ENOSPC, "No space left on device")
    assert failure_line(nameless, out=tmp_path / "runs").startswith(f"{tmp_path / 'runs'}: No")
    missing = OSError(f"Error no file named model.safetensors, found in directory {tmp_path}.")
    assert failure_line(missing) == (
        f"Error no file named model.safetensors, found in directory {tmp_path}. The model folder "
        "is incomplete; delete it and rerun the pipeline to rebuild it"
    )
    assert failure_line(RuntimeError("a bug")) is None  # keeps its traceback


def test_a_safetensors_write_on_a_full_disk_is_not_called_damage(tmp_path: Path) -> None:
    """Issue 47 (item 4): safetensors' Rust writer reports ENOSPC as a SafetensorError (its text,
    as on a 64 kB tmpfs). Before: `truncated or damaged; delete it and rerun`, naming no file."""
    from safetensors import SafetensorError

    def save_file(filename: str) -> None:  # the frame of safetensors.torch.save_file
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    target = tmp_path / "checkpoint-3" / "model.safetensors"
    with pytest.raises(SafetensorError) as raised:
        save_file(str(target))
    line = failure_line(raised.value)
    assert line is not None and line.startswith(f"{target}: No space left on device ("), line
    assert "damaged" not in line


# --- rpb pipeline table1 on a full disk -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("free", [0, 24_000], ids=["full", "nearly_full"])
def test_rpb_table1_on_a_full_disk(free: int, disk: Path, tmp_path: Path) -> None:
    """Before: an 18-line traceback naming no file, and a 0-byte table1.meta.json left behind.
    Now: one line naming the file, none of the table's files left (no partial one, and no
    complete one beside a missing table); the MLflow run ends FAILED."""
    from test_tables import SPEC, _fake_results

    from rpb.pipeline.results_folder import RESULTS_ENV

    def table1(results: Path, uri: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rpb", "pipeline", "table1", "--results", str(results)]
        command += ["--spec", json.dumps(SPEC), "--out", str(results / "table1.csv")]
        command += ["--tracking-uri", uri, "--experiment", "disk"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop(RESULTS_ENV, None)
        return subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    roomy = tmp_path / "roomy" / "results"
    _fake_results(roomy, SPEC)
    assert table1(roomy, uri).returncode == 0
    results = disk / "results"
    _fake_results(results, SPEC)
    inputs = {p for p in results.rglob("*") if p.is_file()}
    _fill(disk, leave=free)
    proc = table1(results, uri)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0] == proc.stderr.splitlines()[-1]
    assert errors[0].startswith(f"rpb pipeline table1: error: {results}/")
    assert "No space left on device" in errors[0]
    assert _leftovers(disk) == []
    written = sorted(p for p in results.rglob("*") if p.is_file() and p not in inputs)
    # A failed table job leaves none of its files, whether the disk filled before its first file
    # (not even a 0-byte table1.csv) or after some of them (rpb.pipeline.cli's
    # _whole_table_or_none clears them: issue 59, item 7).
    assert written == []
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    runs = client.search_runs(
        [client.get_experiment_by_name("disk").experiment_id],
        order_by=["attributes.start_time ASC"],
    )
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED"]
    assert "No space left on device" in runs[-1].data.tags["rpb.end_reason"]


def test_a_full_disk_while_writing_a_model_folder_leaves_none(disk: Path) -> None:
    model = disk / "runs" / "m" / "model"
    with pytest.raises(OSError) as raised, artifacts.atomic_folder(model) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"\0" * 2_000_000)  # the disk holds 1 MiB
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == str(model)  # the write names no file: the folder it went to
    assert list(model.parent.iterdir()) == []
    assert failure_line(raised.value).startswith(f"{model}: No space left on device (")


def test_a_cut_torch_write_inside_an_atomic_writer_names_the_target(tmp_path: Path) -> None:
    """Issue 47 (item 4): torch's full disk (no errno) inside `atomic_path` names the file being
    written, not its hidden temporary file, and leaves neither."""
    from rpb.artifacts import atomic_path

    target = tmp_path / "prior.safetensors"
    with pytest.raises(OSError) as raised, atomic_path(target, record=False) as tmp:
        tmp.write_bytes(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    line = failure_line(raised.value)
    assert line is not None and line.startswith(f"{target}: write failed (torch: unexpected pos")
    assert list(tmp_path.iterdir()) == []
