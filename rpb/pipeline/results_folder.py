"""The results folder's own machinery: its integrity records, the check of it before any job
runs, and the one-invocation-per-results-folder and per-job locks (docs/reliability.md).

- **Integrity records.** A file written whole (rpb.artifacts' atomic writes) under the results
  folder (`RESULTS_ENV`, set by the workflow for every job) gets a record
  `<results>/.integrity/<relative path>.json`: size, sha256 and mtime. One small file per
  artifact: jobs running side by side never share one. `IntegrityRecords` writes them, as the
  recorder that `rpb.pipeline` installs in rpb.artifacts when it is imported.
- **The check** (`check_results`, Snakefile at parse time, before Snakemake builds its DAG and
  decides what to rerun): a recorded file must keep its size, and its sha256 when its mtime
  changed. A damaged record is named itself. Files without a valid record (written by code that
  does not use the atomic writes, or before it did) get rpb.artifacts' format check by suffix; a
  `model` folder has its config and every weights file.
- **The locks.** One invocation per results folder (`hold_results_lock`), a file per running
  job (`hold_job_lock`, `live_jobs`), and the recovery after a killed invocation
  (`recover_after_kill`).

torch-free and cheap to import: the Snakefile imports it at every parse.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpb.artifacts import (
    ArtifactRecorder,
    atomic_path,
    format_problem,
    model_dir_problem,
    one_line,
    sha256_of,
)

__all__ = [
    "RECORDS",
    "RESULTS_ENV",
    "IntegrityRecords",
    "Invocation",
    "Problem",
    "ResultsBusy",
    "check_results",
    "clear_finished_notes",
    "clear_stale_snakemake_locks",
    "drop_job_files",
    "hold_job_lock",
    "hold_results_lock",
    "incomplete_outputs",
    "integrity_message",
    "jobs_busy_message",
    "keep_finished_outputs",
    "live_jobs",
    "parse_invocation",
    "rebuild_target",
    "record_artifact",
    "record_finished_job",
    "record_folder",
    "recover_after_kill",
    "release_results_lock",
]

# The results folder of the running invocation (absolute); jobs inherit it from the workflow.
RESULTS_ENV = "RPB_RESULTS"
RECORDS = ".integrity"
LOCK_NAME = ".invocation.lock"
# One file per running job of the pipeline (`hold_job_lock`), locked for the job's life.
JOBS_DIR = ".jobs"
# One note per pipeline job that succeeded in the current or the last invocation
# (`record_finished_job`): what it wrote and its command. Snakemake records a job's outputs
# complete only when it sees the job end; the jobs of an invocation whose Snakemake alone was
# killed end unseen, and the next invocation keeps what they finished (`keep_finished_outputs`).
FINISHED_DIR = ".jobs_finished"
# Folders the check does not descend into: the records themselves, MLflow's copies of artifacts,
# logs and timings, resumable training state (the trainer checks its own completeness), and
# Snakemake's temporary lm-eval folders (`*.work`).
SKIP_DIRS = frozenset({RECORDS, "mlartifacts", "logs", "benchmarks", "checkpoints", ".snakemake"})


class ResultsBusy(RuntimeError):
    """Another invocation holds the results folder; the message is one line naming it."""


# --- integrity records ---------------------------------------------------------------------------


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


def record_folder(folder: str | os.PathLike[str]) -> list[Path]:
    """Record every file of a folder written by other code (a model `save_pretrained` wrote, a
    hub download), so its weights are checked like any artifact; returns the records written."""
    files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file()]
    found = [record_artifact(p) for p in files if not p.name.startswith(".")]
    return [r for r in found if r is not None]


def _drop_folder_records(folder: Path) -> None:
    """Remove the integrity records of every file under `folder` (it is being replaced)."""
    found = _results_root(folder)
    if found is not None:
        shutil.rmtree(Path(found[0]) / RECORDS / found[1], ignore_errors=True)


# What this process wrote whole under the results folder (absolute paths), for its job's note.
_WRITTEN: list[str] = []


class IntegrityRecords(ArtifactRecorder):
    """rpb.artifacts' writes under the results folder (`RESULTS_ENV`), recorded; any other write
    is left alone."""

    def file_written(self, path: Path) -> None:
        if record_artifact(path) is not None:
            _WRITTEN.append(os.path.abspath(path))

    def folder_written(self, path: Path) -> None:
        _drop_folder_records(path)  # the folder's previous files
        record_folder(path)
        if _results_root(path) is not None:
            _WRITTEN.append(os.path.abspath(path))

    def folder_discarded(self, path: Path) -> None:
        _drop_folder_records(path)

    def file_removed(self, path: Path) -> None:
        found = _results_root(path)
        if found is not None:
            record_path(*found).unlink(missing_ok=True)


# --- the check -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """A damaged artifact: its path (as the workflow names it) and what is wrong, one clause."""

    path: str
    what: str
    # For a damaged integrity record: the file it records. Deleting the record recovers (the file
    # then gets its format check), so no job is forced to rebuild the file.
    record_of: str | None = None


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
        return one_line(str(err)) or type(err).__name__
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


def _incomplete_marks(
    results: str | os.PathLike[str], workdir: str | os.PathLike[str]
) -> dict[str, Path]:
    """Snakemake's marks of the files under `results` that it calls incomplete (a job started,
    never ended: `.snakemake/incomplete/`, each path base64-encoded, split into `@`-prefixed
    folders when long) and that exist, by the path they mark."""
    import base64

    folder = os.path.abspath(results)
    marks = Path(workdir) / SNAKEMAKE_DIR / "incomplete"
    found = {}
    for mark in marks.rglob("*") if marks.is_dir() else ():
        if not mark.is_file() or mark.name == "migration_underway":
            continue
        encoded = "".join(part.removeprefix("@") for part in mark.relative_to(marks).parts)
        try:
            name = base64.urlsafe_b64decode(encoded).decode()
        except (ValueError, UnicodeDecodeError):
            continue
        if _under(name, folder) and os.path.lexists(name):  # as Snakemake: marked and there
            found[name] = mark
    return found


def incomplete_outputs(
    results: str | os.PathLike[str], workdir: str | os.PathLike[str] = "."
) -> list[str]:
    """The files under `results` that Snakemake marks incomplete and that exist, sorted."""
    return sorted(_incomplete_marks(results, workdir))


def record_finished_job(results: str | os.PathLike[str], argv: Sequence[str]) -> Path:
    """Note that this process's pipeline job on `results` succeeded: its command and the paths it
    wrote whole (`<results>/.jobs_finished/<host>.<pid>.json`). Read by the next invocation
    (`keep_finished_outputs`) and cleared by it."""
    folder = Path(results) / FINISHED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{socket.gethostname()}.{os.getpid()}.json"
    note = {"command": list(argv), "written": sorted(set(_WRITTEN))}
    with atomic_path(path, record=False) as tmp:
        tmp.write_text(json.dumps(note) + "\n")
    return path


def keep_finished_outputs(
    results: str | os.PathLike[str], workdir: str | os.PathLike[str] = "."
) -> list[str]:
    """Of the outputs Snakemake marks incomplete, keep those a job finished (`record_finished_job`):
    a path it wrote whole, or a path its command names (lm-eval's `--work` folder); Snakemake's
    mark is removed, so it takes them as done. Returns them; then clears every note. Call it
    while holding the results lock, once no job of an earlier invocation runs (`live_jobs`).

    A job with an output left marked still reruns whole (Snakemake deletes its outputs first): a
    path is kept on exact equality only, so a job's note never covers another job's output."""
    folder = Path(results) / FINISHED_DIR
    finished: set[str] = set()
    for note in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            content = json.loads(note.read_text())
            finished |= set(content["written"])
            finished |= {os.path.abspath(arg) for arg in content["command"] if os.sep in arg}
    kept = []
    for name, mark in _incomplete_marks(results, workdir).items():
        if os.path.abspath(name) in finished:
            mark.unlink(missing_ok=True)
            kept.append(name)
    clear_finished_notes(results)
    return sorted(kept)


def clear_finished_notes(results: str | os.PathLike[str]) -> None:
    """Delete the finished jobs' notes (`record_finished_job`): at the end of an invocation, which
    saw every job end, and once the next invocation has read them."""
    shutil.rmtree(Path(results) / FINISHED_DIR, ignore_errors=True)


def recover_after_kill(
    results: str | os.PathLike[str], invocation: Invocation, workdir: str | os.PathLike[str] = "."
) -> tuple[str | None, bool]:
    """After an invocation on `results` was SIGKILLed: clear its Snakemake lock and say, in one
    line, the command that recovers; returns (that line or None, whether to stop here). Call it
    while holding the results lock. Stops when the dead invocation left incomplete outputs and
    this one lacks `--rerun-incomplete`: Snakemake would stop on them in a dozen lines (and,
    before its lock was cleared here, `--rerun-incomplete` met `LockException` until `--unlock`)."""
    cleared = clear_stale_snakemake_locks(results, workdir)
    kept = keep_finished_outputs(results, workdir)  # the notes of this invocation start afresh
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
            f"removed, {_kept(kept)}and its jobs left {incomplete[0]}{more} incomplete; rerun "
            f"them with: {shlex.join(command)}"
        ), True
    return (
        f"rpb: removed the Snakemake lock of a killed invocation on {results} ({names})"
        f"{'; ' + _kept(kept).removesuffix(', ') if kept else ''}"
    ), False


def _kept(kept: Sequence[str]) -> str:
    """The clause naming what jobs of a killed invocation finished unseen and is kept."""
    if not kept:
        return ""
    more = f" (+{len(kept) - 1} more)" if kept[1:] else ""
    return f"{kept[0]}{more}, finished by its jobs after the kill, is kept, "


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
