"""Pipeline artifacts: atomic writes, integrity records, the check of a results folder before any
job runs, the one-invocation-per-results-folder lock, and one-line descriptions of the failures a
user can meet reading or writing them (docs/records/reliability.md, sections 8-11).

- **Atomic writes.** `atomic_path` hands the writer a temporary file in the target's own folder
  and moves it over the target (`os.replace`) only once it is complete and flushed, so a full
  disk, a crash or a kill never leaves a partial or 0-byte file; an `OSError` names the target.
- **Integrity records.** A file written this way under the results folder (`RESULTS_ENV`, set by
  the workflow for every job) gets a record `<results>/.integrity/<relative path>.json`: size,
  sha256 and mtime. One small file per artifact: jobs running side by side never share one.
- **The check** (`check_results`, Snakefile at parse time, before Snakemake builds its DAG and
  decides what to rerun): a recorded file must keep its size, and its sha256 when its mtime
  changed. A damaged record is named itself. Files without a valid record (written by code that
  does not use these helpers, or before it did) get a format check by suffix: JSON and JSON lines
  parse, a CSV/TSV has a header and as many fields in every row, a safetensors file is as long as
  its header says, a PNG ends with its IEND chunk, an HTML page is closed, Markdown is UTF-8 and
  not empty; a `model` folder has its config and every weights file.

torch-free and cheap to import: the Snakefile imports it at every parse.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import socket
import struct
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_ENV",
    "ArtifactError",
    "Invocation",
    "Problem",
    "ResultsBusy",
    "atomic_folder",
    "atomic_path",
    "check_results",
    "clear_stale_snakemake_locks",
    "drop_job_files",
    "failure_line",
    "hold_job_lock",
    "hold_results_lock",
    "incomplete_outputs",
    "integrity_message",
    "jobs_busy_message",
    "live_jobs",
    "parse_invocation",
    "partial_folder",
    "rebuild_target",
    "record_artifact",
    "record_folder",
    "recover_after_kill",
    "release_results_lock",
    "remove_artifact",
    "save_figure",
    "save_safetensors",
    "write_text",
]

# The results folder of the running invocation (absolute); jobs inherit it from the workflow.
RESULTS_ENV = "RPB_RESULTS"
RECORDS = ".integrity"
LOCK_NAME = ".invocation.lock"
# One file per running job of the pipeline (`hold_job_lock`), locked for the job's life.
JOBS_DIR = ".jobs"
# Folders the check does not descend into: the records themselves, MLflow's copies of artifacts,
# logs and timings, resumable training state (the trainer checks its own completeness), and
# Snakemake's temporary lm-eval folders (`*.work`).
SKIP_DIRS = frozenset({RECORDS, "mlartifacts", "logs", "benchmarks", "checkpoints", ".snakemake"})
# A model folder holds its config and one of these (sharded: an index naming every shard).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
REBUILD = "delete it and rerun the pipeline to rebuild it"
_CHUNK = 1 << 20


class ArtifactError(ValueError):
    """A damaged or unreadable artifact; the message is one line naming the file."""


class ResultsBusy(RuntimeError):
    """Another invocation holds the results folder; the message is one line naming it."""


# --- atomic writes -------------------------------------------------------------------------------


def _tmp_for(path: Path) -> Path:
    # Hidden and in the same folder (os.replace is atomic only within one filesystem); the pid
    # keeps two writers of one name apart. No glob of the pipeline (`<stem>*`, `*.json`) sees it.
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync_dir(folder: Path) -> None:
    # The rename itself is durable only once the folder is flushed; not every filesystem allows it.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, record: bool = True) -> Iterator[Path]:
    """Yield a temporary path for writing `path`; on success it replaces `path` in one step.

    On any failure the temporary file is removed and `path` is left as it was (absent or its
    previous content): no partial or 0-byte output. An `OSError` without a file name (a full
    disk seen by pandas, torch or matplotlib) is raised again naming `path`. With `record`, a file
    under the results folder gets its integrity record (`record_artifact`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_for(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:  # flushed before the rename, or a crash can leave it empty
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError) and err.errno is not None and err.filename in (None, str(tmp)):
            raise OSError(err.errno, err.strerror, str(path)) from err
        cut = _cut_write(err)  # torch's or safetensors' full disk, which carries no errno
        if cut is not None:
            raise OSError(errno.ENOSPC, cut, str(path)) from err
        raise
    _fsync_dir(path.parent)
    if record:
        record_artifact(path)


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """`Path.write_text`, atomic and recorded (`atomic_path`)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return path


def save_safetensors(
    tensors: dict[str, Any], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> Path:
    """`safetensors.torch.save_file`, atomic and recorded (`atomic_path`)."""
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


def save_figure(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """`Figure.savefig`, atomic and recorded; the format comes from `path`'s suffix (the
    temporary file's own suffix is `.tmp`)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip("."), **kwargs)
    return path


def partial_folder(path: str | os.PathLike[str]) -> Path:
    """The temporary folder `atomic_folder` writes the folder `path` into: hidden, beside it, and
    one name per folder (no pid), so every rank of a multi-process launch names the same one and
    a rerun replaces what a killed writer left."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            _fsync_dir(path)


def _drop_folder_records(folder: Path) -> None:
    """Remove the integrity records of every file under `folder` (it is being replaced)."""
    found = _results_root(folder)
    if found is not None:
        shutil.rmtree(Path(found[0]) / RECORDS / found[1], ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, record: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder (`partial_folder`) to write the folder `path` into (a model
    `save_pretrained` writes); once the block ends, flushed, it takes `path`'s place by rename.

    A reader never sees a folder without its weights or config: a kill, a full disk or an error
    leaves `path` as it was (absent, or its previous content) and removes the temporary folder.
    An `OSError` naming a file of the temporary folder is raised again naming that file under
    `path`. With `record`, every file of the new folder under the results folder gets its
    integrity record; records of the folder's previous files (and of files an atomic writer
    recorded inside the temporary folder) are dropped first.
    """
    path = Path(path)
    tmp, old = partial_folder(path), path.with_name(f".{path.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():  # a directory rename does not replace a non-empty folder
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old.exists() and not path.exists():
                os.replace(old, path)
            raise
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        _drop_folder_records(tmp)
        name = os.fspath(err.filename) if isinstance(err, OSError) and err.filename else None
        if isinstance(err, OSError) and err.errno is not None:
            if name is None:
                raise OSError(err.errno, err.strerror, str(path)) from err
            with contextlib.suppress(ValueError):
                inside = Path(name).relative_to(tmp)
                raise OSError(err.errno, err.strerror, str(path / inside)) from err
        raise
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    if record:
        _drop_folder_records(tmp)
        _drop_folder_records(path)
        record_folder(path)


# --- integrity records ---------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _results_root(path: Path) -> tuple[Path, str] | None:
    """(results folder, `path` relative to it) for a path under `RESULTS_ENV`'s folder."""
    root = os.environ.get(RESULTS_ENV)
    if not root:
        return None
    root_path = Path(root).resolve()
    try:
        return root_path, path.resolve().relative_to(root_path).as_posix()
    except ValueError:
        return None


def record_path(root: Path, relative: str) -> Path:
    return Path(root) / RECORDS / f"{relative}.json"


def record_artifact(path: str | os.PathLike[str], root: Path | None = None) -> Path | None:
    """Write the integrity record of the file `path` (size, sha256, mtime); returns the record's
    path, or None for a file outside the results folder (`root`, else `RESULTS_ENV`)."""
    path = Path(path)
    if root is not None:
        found = (Path(root).resolve(), path.resolve().relative_to(Path(root).resolve()).as_posix())
    else:
        found = _results_root(path)
    if found is None:
        return None
    stat = path.stat()
    entry = {"size": stat.st_size, "sha256": sha256_of(path), "mtime_ns": stat.st_mtime_ns}
    target = record_path(*found)
    with atomic_path(target, record=False) as tmp:
        tmp.write_text(json.dumps(entry, sort_keys=True) + "\n")
    return target


def remove_artifact(path: str | os.PathLike[str]) -> bool:
    """Delete the file `path` and its integrity record, if there; returns whether it was there."""
    path = Path(path)
    found = _results_root(path)
    if found is not None:
        record_path(*found).unlink(missing_ok=True)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def record_folder(folder: str | os.PathLike[str]) -> list[Path]:
    """Record every file of a folder written by other code (a model `save_pretrained` wrote, a
    hub download), so its weights are checked like any artifact; returns the records written."""
    files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file()]
    found = [record_artifact(p) for p in files if not p.name.startswith(".")]
    return [r for r in found if r is not None]


# --- checks --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """A damaged artifact: its path (as the workflow names it) and what is wrong, one clause."""

    path: str
    what: str
    # For a damaged integrity record: the file it records. Deleting the record recovers (the file
    # then gets its format check), so no job is forced to rebuild the file.
    record_of: str | None = None


def json_problem(path: Path) -> str | None:
    """Why `path` is not a complete JSON document, or None. An evaluation output (`tasks` with
    per-item scores) must hold finite scores: the tables refuse a NaN, after Snakemake has
    deleted their outputs."""
    try:
        document = json.loads(path.read_bytes())
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}"
        return f"not valid JSON ({err.msg} at {where}): truncated or damaged"
    except UnicodeDecodeError as err:
        return f"not valid JSON (not UTF-8 at byte {err.start}): damaged"
    tasks = document.get("tasks") if isinstance(document, dict) else None
    for task, entry in tasks.items() if isinstance(tasks, dict) else ():
        for key in ("items", "p_target"):
            values = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(values, list):
                bad = sum(1 for v in values if isinstance(v, float) and not math.isfinite(v))
                if bad:
                    return (
                        f"task {task}: {bad} of {len(values)} {key} scores are not finite (NaN "
                        "or inf): damaged, or its evaluation failed"
                    )
    return None


def _text_problem(path: Path, kind: str) -> tuple[str | None, str]:
    """(why `path` is not a complete text file of `kind`, or None; its text). Every writer of a
    results file writes UTF-8 and at least one byte."""
    data = path.read_bytes()
    if not data:
        return f"empty {kind} file (0 bytes): truncated or damaged", ""
    try:
        return None, data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not a UTF-8 {kind} file (invalid byte at offset {err.start}): damaged", ""


def csv_problem(path: Path, delimiter: str = ",") -> str | None:
    """Why `path` is not a complete table (CSV, or TSV with `delimiter` tab): a header, every row
    as many fields as the header, the last row ended by a newline (pandas and csv write one), or
    None."""
    kind = "TSV" if delimiter == "\t" else "CSV"
    what, text = _text_problem(path, kind)
    if what:
        return what
    if not text.endswith("\n"):
        return f"{kind} whose last line has no line end: truncated"
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True))
    except csv.Error as err:
        return f"not valid {kind} ({err}): truncated or damaged"
    rows = [row for row in rows if row]
    if not rows:
        return f"{kind} without a header row: truncated or damaged"
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(rows[0]):
            return (
                f"{kind} row {number} has {len(row)} fields, its header {len(rows[0])}: "
                "truncated or damaged"
            )
    return None


def jsonl_problem(path: Path) -> str | None:
    """Why `path` is not a complete JSON-lines file (every line a JSON document, the last one
    ended by a newline), or None."""
    what, text = _text_problem(path, "JSON-lines")
    if what:
        return what
    if not text.endswith("\n"):
        return "JSON-lines file whose last line has no line end: truncated"
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                return f"line {number} is not valid JSON ({err.msg}): truncated or damaged"
    return None


def html_problem(path: Path) -> str | None:
    """Why `path` is not a complete HTML page (a page that opens `<html` must close it), or
    None."""
    what, text = _text_problem(path, "HTML")
    if what:
        return what
    if "<html" in text[:1024].lower() and "</html>" not in text[-1024:].lower():
        return "HTML page without its closing </html>: truncated"
    return None


def markdown_problem(path: Path) -> str | None:
    """Why `path` is not a readable Markdown file (empty or not UTF-8), or None."""
    return _text_problem(path, "Markdown")[0]


# A PNG opens with its signature and ends with its IEND chunk (length 0, type, CRC).
_PNG_START = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def png_problem(path: Path) -> str | None:
    """Why `path` is not a complete PNG image (its signature, then its IEND chunk at the end), or
    None. Reads 8 bytes at each end."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(len(_PNG_START))
        f.seek(max(size - len(_PNG_END), 0))
        end = f.read()
    if start != _PNG_START:
        return f"{size} bytes, not a PNG image (no PNG signature): damaged"
    if end != _PNG_END:
        return f"{size} bytes, a PNG image without its end (IEND chunk): truncated"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file (its size must be 8 bytes, the header, and
    the data its header describes), or None. Reads the header only."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, less than a safetensors header: truncated or damaged"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{size} bytes, shorter than its {n}-byte header: truncated or damaged"
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "its safetensors header is not valid JSON: damaged"
    ends = [
        int(entry["data_offsets"][1])
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        cut = "truncated" if size < expected else "longer than its data"
        return f"{size} bytes, its header describes {expected}: {cut}"
    return None


def model_dir_problem(folder: Path) -> str | None:
    """Why the model folder `folder` is incomplete (no config, or a weights file missing), or
    None."""
    if not (folder / "config.json").is_file():
        return "model folder without config.json: incomplete"
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            try:
                shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                return f"model folder whose {index} is damaged"
            missing = sorted(s for s in shards if not (folder / s).is_file())
            if missing:
                return f"model folder without {missing[0]} (listed in {index}): incomplete"
            return None
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        return f"model folder without {WEIGHT_FILES[0]} (no weights file): incomplete"
    return None


# The format check of a file without a valid record, by suffix: every format the pipeline writes
# under the results folder (`rpb.specs.PATHS`, the report's pages and figures).
FORMAT_CHECKS: dict[str, Callable[[Path], str | None]] = {
    ".json": json_problem,
    ".jsonl": jsonl_problem,
    ".safetensors": safetensors_problem,
    ".csv": csv_problem,
    ".tsv": lambda path: csv_problem(path, "\t"),
    ".md": markdown_problem,
    ".html": html_problem,
    ".png": png_problem,
}


def format_problem(path: Path) -> str | None:
    """Why `path` is not a complete file of the format its suffix names, or None (also for a
    suffix without a check)."""
    check = FORMAT_CHECKS.get(path.suffix)
    return check(path) if check else None


def _model_folder_of(base: Path, path: Path) -> Path | None:
    """The `model` folder under `base` that `path` lies in, or None."""
    for folder in path.parents:
        if folder == base or base not in folder.parents:
            return None
        if folder.name == "model":
            return folder
    return None


def _skipped(name: str) -> bool:
    # Hidden folders too: the records, a hub download's `.cache`.
    return name in SKIP_DIRS or name.endswith(".work") or name.startswith(".")


def _read_record(record: Path) -> tuple[dict[str, Any], int, str, int] | str:
    """(entry, size, sha256, mtime) of an integrity record, or why it is damaged."""
    try:
        entry = json.loads(record.read_bytes())
        size, sha, mtime = int(entry["size"]), str(entry["sha256"]), int(entry["mtime_ns"])
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
    except UnicodeDecodeError as err:
        return f"not UTF-8 at byte {err.start}"
    except KeyError as err:
        return f"no {err.args[0]!r}"
    except (OSError, ValueError, TypeError, AttributeError) as err:
        return _one_line(str(err)) or type(err).__name__
    return entry, size, sha, mtime


def _check_record(
    root: Path, relative: str, found: tuple[dict[str, Any], int, str, int], update: bool
) -> str | None:
    target = root / relative
    record = record_path(root, relative)
    entry, size, sha, mtime = found
    stat = target.stat()
    if stat.st_size != size:
        return f"{stat.st_size} bytes, {size} when it was written: truncated or changed since"
    if stat.st_mtime_ns != mtime:
        if sha256_of(target) != sha:
            return "same size, other content (sha256) than when it was written: changed since"
        if update:  # same bytes, new mtime (Snakemake touches finished outputs): skip next time
            entry["mtime_ns"] = stat.st_mtime_ns
            with atomic_path(record, record=False) as tmp:
                tmp.write_text(json.dumps(entry, sort_keys=True) + "\n")
    return None


def check_results(results: str | os.PathLike[str], *, update: bool = False) -> list[Problem]:
    """Every damaged artifact under the results folder `results` (paths as `results` names
    them), sorted by path. `update`: drop records of files that are gone and refresh the mtime
    of records whose file kept its bytes (an invocation that may write; a dry run passes False).
    """
    base = Path(results)
    if not base.is_dir():
        return []
    problems: list[Problem] = []
    recorded: set[str] = set()
    lost: set[Path] = set()  # model folders with a recorded file missing (named file by file)
    records = base / RECORDS
    for record in sorted(records.rglob("*.json")) if records.is_dir() else []:
        relative = record.relative_to(records).as_posix().removesuffix(".json")
        target = base / relative
        folder = _model_folder_of(base, target)
        if not target.exists() and folder is not None and folder.is_dir():
            # A file of a model folder that is still there: lost (Snakemake removes a model
            # folder whole before its job rewrites it, and the job replaces it whole).
            lost.add(folder)
            problems.append(Problem(str(target), "missing, recorded when its folder was written"))
            continue
        if not target.is_file():
            # Gone: Snakemake deleted the output of a job it reruns; the job writes a new record.
            if update and not target.exists():
                record.unlink(missing_ok=True)
            continue
        found = _read_record(record)
        if isinstance(found, str):
            # The file can no longer be verified: the record is named (never dropped unseen), and
            # the file gets the format check below like an unrecorded one.
            what = (
                f"damaged integrity record of {target} ({found}); delete the record to accept "
                "the file after its format check"
            )
            problems.append(Problem(str(record), what, record_of=str(target)))
            continue
        recorded.add(relative)
        what = _check_record(base, relative, found, update)
        if what:
            problems.append(Problem(str(target), what))
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        here = Path(folder)
        if here.name == "model" and here != base and here not in lost:
            what = model_dir_problem(here)
            if what:
                problems.append(Problem(str(here), what))
        for name in sorted(files):
            path = here / name
            if path.relative_to(base).as_posix() in recorded or name.startswith("."):
                continue
            try:
                what = format_problem(path)
            except OSError as err:  # unreadable: named like any damage
                what = f"unreadable ({err.strerror})"
            if what:
                problems.append(Problem(str(path), what))
    # Damaged outputs first: a damaged record is named after the damage it may hide.
    return sorted(problems, key=lambda problem: (problem.record_of is not None, problem.path))


def rebuild_target(path: str, results: str, declared: Callable[[str], bool]) -> str:
    """The workflow output whose job rewrites the damaged `path` under `results`: `path` itself,
    the folder output it lies in (a model folder), or, for a file no rule declares
    (table1.meta.json), the declared output beside it whose name shares the longest prefix with it
    (table1.md). `declared` says whether a rule produces a path."""
    candidate = path
    while candidate.startswith(results) and candidate != results:
        if declared(candidate):
            return candidate
        candidate = os.path.dirname(candidate)
    folder, name = os.path.split(path)
    siblings = [os.path.join(folder, s) for s in sorted(os.listdir(folder))]
    siblings = [s for s in siblings if s != path and declared(s)]
    if not siblings:
        return path
    # The names' common prefix, character by character: table1.meta.json is table1.md's job's.
    shared = [len(os.path.commonprefix([os.path.basename(s), name])) for s in siblings]  # noqa: RUF071
    return siblings[shared.index(max(shared))]


def integrity_message(
    problems: Sequence[Problem],
    rebuild_target: Callable[[str], str] = lambda path: path,
    command: Sequence[str] = ("snakemake", "--cores", "1"),
    invocation_targets: Sequence[str] = (),
) -> str:
    """One line: the first damaged artifact, what is wrong, and one command that rebuilds every
    damaged one (`rebuild_target` maps a file to the workflow output that rebuilds it: itself,
    the model folder it lies in, or the declared output its job writes beside it). Where no job
    is forced (damaged records alone) the command is the invocation's own, with its targets
    (`invocation_targets`), never the default target in their place."""
    first = problems[0]
    # The damaged files go (or the check stops the rebuild too); `--force` reruns the jobs of
    # the targets even though their declared outputs are there.
    removed = list(dict.fromkeys(p.path for p in problems))
    # A damaged record alone forces no job: once it is gone its file gets the format check.
    targets = list(dict.fromkeys(rebuild_target(p.path) for p in problems if not p.record_of))
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    if targets:
        rerun = [*command, "--force", "--", *targets]
    else:
        rerun = [*command, *(["--", *invocation_targets] if invocation_targets else [])]
    rebuild = f"rm -rf {shlex.join(removed)} && {shlex.join(rerun)}"
    return f"integrity error: {first.path}: {first.what}{more}; rebuild: {rebuild}"


# --- one invocation per results folder ------------------------------------------------------------

# Snakemake options that only read the results folder: such an invocation checks the lock but
# does not take it, and creates nothing (a dry run on a fresh folder leaves it absent).
READ_ONLY_OPTIONS = (
    "dryrun",
    "lint",
    "summary",
    "detailed_summary",
    "dag",
    "rulegraph",
    "filegraph",
    "d3dag",
    "list_rules",
    "list_target_rules",
    "list_changes",
    "list_input_changes",
    "list_params_changes",
    "list_untracked",
    "list_conda_envs",
    "print_compilation",
    "report",
)


@dataclass(frozen=True)
class Invocation:
    """What a `snakemake` command line asks for, as far as the results folder is concerned."""

    command: list[str]
    targets: list[str]
    read_only: bool
    lint: bool
    # The options a rebuild command repeats: Snakefile, working directory, config files, --config.
    options: list[str]
    cores: str
    rerun_incomplete: bool = False


def parse_invocation(argv: Sequence[str]) -> Invocation:
    """Read `argv` (sys.argv[1:] of the running Snakemake) with Snakemake's own parser."""
    command = ["snakemake", *argv]
    try:
        from snakemake.cli import get_argument_parser

        args, _ = get_argument_parser().parse_known_args(list(argv))
    except (ImportError, SystemExit, ValueError):  # unreadable: take it for a run that writes
        return Invocation(command, [], False, False, [], "1")
    options: list[str] = []
    if args.snakefile:
        options += ["--snakefile", str(args.snakefile)]
    if args.directory:
        options += ["--directory", str(args.directory)]
    if args.configfile:
        options += ["--configfile", *map(str, args.configfile)]
    if args.config:
        options += ["--config", *map(str, args.config)]
    read_only = any(bool(getattr(args, name, False)) for name in READ_ONLY_OPTIONS)
    return Invocation(
        command=command,
        targets=[str(t) for t in args.targets or []],
        read_only=read_only,
        lint=args.lint is not None and args.lint is not False,
        options=options,
        cores=str(args.cores or 1),
        rerun_incomplete=bool(getattr(args, "rerun_incomplete", False)),
    )


# Locks this process holds: a second parse in the same process keeps its own lock.
_HELD: dict[str, int] = {}


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        targets = " ".join(info.get("targets") or []) or "the default target"
        return (
            f"pid {info['pid']} on {info['host']}, started {info['started']}, target {targets}: "
            f"{info['command']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "an invocation that is starting or a dry run"


def hold_results_lock(
    results: str | os.PathLike[str],
    *,
    command: Sequence[str],
    targets: Sequence[str] = (),
    hold: bool = True,
) -> Path | None:
    """Take the lock of the results folder for this process's life (`hold`), or only check that
    nobody holds it (a dry run: nothing is created). Raises `ResultsBusy` naming the holder.

    `fcntl.flock` on `<results>/.invocation.lock`: the kernel releases it when the holder exits,
    however it exits, so a crashed invocation never blocks the next one. The file stays (removing
    a locked file races with the next opener); its content names the holder.
    """
    path = Path(results) / LOCK_NAME
    if path.parent.exists() and str(path.resolve()) in _HELD:
        return path
    if not hold:
        if not path.is_file():
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ResultsBusy(_busy(results, path)) from None
        finally:
            os.close(fd)  # closing releases the probe
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by jobs (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ResultsBusy(_busy(results, path)) from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "targets": list(targets),
        "command": shlex.join(command),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _HELD[str(path.resolve())] = fd
    return path


_JOB_LOCKS: list[tuple[int, Path]] = []  # this process's job lock, held until it exits


def hold_job_lock(results: str | os.PathLike[str], argv: Sequence[str]) -> Path:
    """Mark this process as a running job on `results` for its life: `<results>/.jobs/<host>.
    <pid>`, locked (`fcntl.flock`, released by the kernel however the job ends) and naming the
    job; a job that exits removes it. A job of an invocation whose Snakemake was SIGKILLed (its
    pid alone) runs on unseen by Snakemake; the next invocation finds it here (`live_jobs`)."""
    folder = Path(results) / JOBS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{socket.gethostname()}.{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)  # not inherited (PEP 446)
    fcntl.flock(fd, fcntl.LOCK_EX)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(argv)}
    os.write(fd, (json.dumps(info) + "\n").encode())
    if not _JOB_LOCKS:
        atexit.register(drop_job_files)
    _JOB_LOCKS.append((fd, path))
    return path


def drop_job_files() -> None:
    """Remove this process's job files (`hold_job_lock`) as it ends (its locks go with it):
    at exit, and from `rpb.pipeline.jobserver.exit_now`, which skips the exit hooks."""
    for _, path in _JOB_LOCKS:
        path.unlink(missing_ok=True)


def live_jobs(results: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The running jobs on `results` (`hold_job_lock`: pid, host, command), oldest first; the
    files of jobs that ended without removing theirs (SIGKILL) are removed."""
    folder = Path(results) / JOBS_DIR
    live = []
    for path in sorted(folder.iterdir(), key=os.path.getmtime) if folder.is_dir() else ():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                live.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                live.append({"pid": path.name.rsplit(".", 1)[-1], "command": "?"})
        else:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return live


def jobs_busy_message(results: str | os.PathLike[str], jobs: Sequence[dict[str, Any]]) -> str:
    """One line: jobs of an earlier invocation on `results` still run (its Snakemake was killed
    alone), which this one would run again beside them."""
    pids = " ".join(str(job.get("pid")) for job in jobs)
    first = jobs[0]
    more = f" (+{len(jobs) - 1} more)" if len(jobs) > 1 else ""
    return (
        f"results folder {results} has {len(jobs)} job(s) still running from an invocation that "
        f"was killed (pid {first.get('pid')} on {first.get('host', '?')}: "
        f"{first.get('command')}{more}); wait for them to end (or stop them: kill {pids}), "
        "then rerun"
    )


# Snakemake's own state in its working directory (its default `file` persistence backend).
SNAKEMAKE_DIR = ".snakemake"


def _under(path: str, folder: str) -> bool:
    full = os.path.abspath(path)
    return full == folder or full.startswith(folder + os.sep)


def clear_stale_snakemake_locks(
    results: str | os.PathLike[str], workdir: str | os.PathLike[str] = "."
) -> list[Path]:
    """Delete the lock files of a dead Snakemake invocation on `results`; returns them. Call it
    only while holding the results lock: an invocation on `results` holds that lock while it
    runs (it writes its Snakemake lock after taking ours and deletes it before exiting), so its
    Snakemake lock still there means it was SIGKILLed. Left there, it stopped every next run with
    `LockException` until `snakemake --unlock`, which removes the locks of every invocation in
    the working directory, live ones too.

    Snakemake's file backend writes `.snakemake/locks/<n>.input.lock` and `<n>.output.lock` (one
    path a line, `n` the first free number, the same for both unless two invocations start at
    once). Stale: an output lock naming a file under `results` (an invocation writes only its own
    folder) and the input lock of the same number. Another folder's invocation keeps its locks,
    inputs read from here included."""
    folder = os.path.abspath(results)
    locks = Path(workdir) / SNAKEMAKE_DIR / "locks"
    named: dict[Path, list[str]] = {}
    for lock in sorted(locks.glob("*.lock")):
        with contextlib.suppress(OSError):
            named[lock] = [n.strip() for n in lock.read_text().splitlines() if n.strip()]
    stale = {
        p
        for p, names in named.items()
        if p.name.endswith(".output.lock") and any(_under(n, folder) for n in names)
    }
    for lock in named:
        pair = lock.with_name(lock.name.replace(".input.", ".output."))
        if lock.name.endswith(".input.lock") and pair in stale:
            stale.add(lock)
    for lock in stale:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
    return sorted(stale)


def incomplete_outputs(
    results: str | os.PathLike[str], workdir: str | os.PathLike[str] = "."
) -> list[str]:
    """The files under `results` that Snakemake marks incomplete (a job started, never ended:
    `.snakemake/incomplete/`, each path base64-encoded, split into `@`-prefixed folders when
    long) and that exist, sorted."""
    import base64

    folder = os.path.abspath(results)
    marks = Path(workdir) / SNAKEMAKE_DIR / "incomplete"
    found = []
    for mark in marks.rglob("*") if marks.is_dir() else ():
        if not mark.is_file() or mark.name == "migration_underway":
            continue
        encoded = "".join(part.removeprefix("@") for part in mark.relative_to(marks).parts)
        try:
            name = base64.urlsafe_b64decode(encoded).decode()
        except (ValueError, UnicodeDecodeError):
            continue
        if _under(name, folder) and os.path.lexists(name):  # as Snakemake: marked and there
            found.append(name)
    return sorted(found)


def recover_after_kill(
    results: str | os.PathLike[str], invocation: Invocation, workdir: str | os.PathLike[str] = "."
) -> tuple[str | None, bool]:
    """After an invocation on `results` was SIGKILLed: clear its Snakemake lock and say, in one
    line, the command that recovers; returns (that line or None, whether to stop here). Call it
    while holding the results lock. Stops when the dead invocation left incomplete outputs and
    this one lacks `--rerun-incomplete`: Snakemake would stop on them in a dozen lines (and,
    before its lock was cleared here, `--rerun-incomplete` met `LockException` until `--unlock`)."""
    cleared = clear_stale_snakemake_locks(results, workdir)
    if not cleared:
        return None, False
    names = ", ".join(str(p) for p in cleared)
    incomplete = incomplete_outputs(results, workdir)
    if incomplete and not invocation.rerun_incomplete:
        command = [
            "snakemake",
            "--cores",
            invocation.cores,
            *invocation.options,
            "--rerun-incomplete",
        ]
        if invocation.targets:
            command += ["--", *invocation.targets]
        more = f" (+{len(incomplete) - 1} more)" if incomplete[1:] else ""
        return (
            f"recover: an invocation on {results} was killed; its Snakemake lock ({names}) is "
            f"removed, and its jobs left {incomplete[0]}{more} incomplete; rerun them with: "
            f"{shlex.join(command)}"
        ), True
    return f"rpb: removed the Snakemake lock of a killed invocation on {results} ({names})", False


def _busy(results: str | os.PathLike[str], path: Path) -> str:
    return (
        f"results folder {results} is in use by another invocation ({_holder(path)}); wait for it "
        f"to end, or stop it, then rerun (its lock: {path})"
    )


def release_results_lock(results: str | os.PathLike[str]) -> None:
    """Release this process's lock of `results` (Snakefile's onsuccess/onerror; exit does too)."""
    path = Path(results) / LOCK_NAME
    fd = _HELD.pop(str(path.resolve()), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)


# --- one line per failure ------------------------------------------------------------------------


def _candidates(err: BaseException) -> Iterator[Path]:
    """Files the code that raised `err` was handling: path-like locals of its frames, innermost
    first (to name the file behind an error that does not name it)."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    seen: set[str] = set()
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            try:  # any object may sit in a frame; none of them may raise here
                name = getattr(value, "name", value) if hasattr(value, "read") else value
                text = os.fspath(name) if isinstance(name, (str, os.PathLike)) else None
            except Exception:
                continue
            if not isinstance(text, str) or text in seen or len(text) > 4096 or "\n" in text:
                continue
            seen.add(text)
            with contextlib.suppress(OSError, ValueError):
                if os.path.isfile(text):
                    yield Path(text)


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__  # type: ignore[assignment]


def _written_path(err: BaseException) -> Path | None:
    """The file the innermost failing frame was writing: its first path-like local (a str or
    PathLike with a '/', or an open file's name) that is not a folder. Unlike `_candidates` it
    need not exist: a writer cut short may have left nothing, or its folder was cleaned up."""
    for link in exception_chain(err):
        frames = [frame for frame, _ in traceback.walk_tb(link.__traceback__)]
        for frame in reversed(frames):
            for value in list(frame.f_locals.values()):
                try:
                    name = getattr(value, "name", value) if hasattr(value, "write") else value
                    text = os.fspath(name) if isinstance(name, (str, os.PathLike)) else None
                except Exception:
                    continue
                if not isinstance(text, str) or "/" not in text or "\n" in text:
                    continue
                if len(text) < 4096 and not os.path.isdir(text):
                    # An atomic writer's temporary file stands for its target (`_tmp_for`).
                    tmp = re.fullmatch(r"\.(.+)\.\d+\.tmp", os.path.basename(text))
                    return Path(text).with_name(tmp.group(1)) if tmp else Path(text)
    return None


# A write cut short (a full disk, a quota) that reaches us without an errno: torch's zip writer
# says 'basic_ios::clear' then 'unexpected pos' (or 'PytorchStreamWriter failed writing file');
# safetensors' Rust writer names the OS error in its text.
TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed writing file", "basic_ios::")
RUST_NO_SPACE = ("os error 28", "os error 122", "StorageFull")


def _cut_write(err: BaseException) -> str | None:
    """What a torch or safetensors write cut short said (one clause), or None for other errors."""
    for link in exception_chain(err):
        text = _one_line(str(link))
        if isinstance(link, RuntimeError) and any(m in text for m in TORCH_WRITE_FAILED):
            said = re.sub(r"^\[enforce fail at [^]]*\]\s*\.?\s*", "", text)
            return f"write failed (torch: {said}), most likely no space left on device"
        if type(link).__name__ == "SafetensorError" and any(m in text for m in RUST_NO_SPACE):
            return "No space left on device"
    return None


def _json_file(err: json.JSONDecodeError) -> Path | None:
    for path in _candidates(err):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if path.read_text() == err.doc:
                return path
    return None


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _free_space(path: Path) -> str:
    for folder in [path, *path.parents]:
        if folder.exists():
            return f"{shutil.disk_usage(folder).free:,} bytes free there"
    return "no space left"


def failure_line(err: BaseException, out: str | os.PathLike[str] | None = None) -> str | None:
    """The one line a job prints for `err` (a damaged input, a full disk, an unreadable file,
    bad input), naming the file and what to do; None for an error that is a bug (traceback).
    `out` is the job's output, named when a full disk's error names no file."""
    if isinstance(err, json.JSONDecodeError):
        where = _json_file(err)
        name = str(where) if where else "a JSON input (run with -v to see which)"
        return (
            f"{name}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}): "
            f"truncated or damaged; {REBUILD}"
        )
    cut = _cut_write(err)
    if cut is not None:  # before the SafetensorError case: a write, not a damaged input
        where = _written_path(err) or out
        err = OSError(errno.ENOSPC, cut, None if where is None else str(where))
    if type(err).__name__ == "SafetensorError":
        damaged = [p for p in _candidates(err) if p.suffix == ".safetensors"]
        bad = next((p for p in damaged if safetensors_problem(p)), None)
        name = str(bad) if bad else "a safetensors input (run with -v to see which)"
        return f"{name}: {_one_line(str(err))}: truncated or damaged; {REBUILD}"
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        where = err.filename or _written_path(err) or out
        if where is None:
            return f"{err.strerror}: free disk space, then rerun (no partial output was kept)"
        return (
            f"{where}: {err.strerror} ({_free_space(Path(where))}): free disk space, then rerun "
            "(no partial output was kept)"
        )
    if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{err.filename}: {err.strerror}: check the permissions of that path"
    if isinstance(err, (ValueError, FileNotFoundError)):
        return str(err)
    if isinstance(err, OSError):
        text = f"{err.filename}: {err.strerror}" if err.filename else _one_line(str(err))
        if "found in directory" in text or "no file named" in text.lower():
            return f"{text} The model folder is incomplete; {REBUILD}"
        return text
    return None
