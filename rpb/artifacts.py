"""Safe file writes and file checks: atomic writes, the format checks of the files rpb writes,
and one-line descriptions of the failures a user can meet reading or writing them
(docs/reliability.md).

- **Atomic writes.** `atomic_path` hands the writer a temporary file in the target's own folder
  and moves it over the target (`os.replace`) only once it is complete and flushed, so a full
  disk, a crash or a kill never leaves a partial or 0-byte file; an `OSError` names the target.
  `atomic_folder` does the same for a whole folder (a model `save_pretrained` writes).
- **Who is told.** Each completed write (and `remove_artifact`) is told to the installed
  `ArtifactRecorder`, which by default does nothing. The pipeline installs its results folder's
  integrity records there (rpb.pipeline.results_folder), so this module knows nothing of a
  results folder, its records or its locks.
- **Format checks** (`*_problem`, `format_problem`, `model_dir_problem`): why a file is not a
  complete file of the format its suffix names: JSON and JSON lines parse, a CSV/TSV has a header
  and as many fields in every row, a safetensors file is as long as its header says, a PNG ends
  with its IEND chunk, an HTML page is closed, Markdown is UTF-8 and not empty; a `model` folder
  has its config and every weights file.

torch-free and cheap to import: the Snakefile imports it at every parse.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import json
import math
import os
import re
import shutil
import struct
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "ArtifactError",
    "ArtifactRecorder",
    "atomic_folder",
    "atomic_path",
    "exception_chain",
    "failure_line",
    "format_problem",
    "install_recorder",
    "one_line",
    "partial_folder",
    "remove_artifact",
    "save_figure",
    "save_safetensors",
    "sha256_of",
    "write_text",
]

# A model folder holds its config and one of these (sharded: an index naming every shard).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
REBUILD = "delete it and rerun the pipeline to rebuild it"
_CHUNK = 1 << 20


class ArtifactError(ValueError):
    """A damaged or unreadable artifact; the message is one line naming the file."""


class ArtifactRecorder:
    """What this module tells about the files it writes and removes; this default does nothing.

    Why a hook, not the records themselves: the results folder's integrity records are the
    pipeline's (it alone reads them, before every invocation), but most files under a results
    folder are written here, by library code a job calls (a prior, a model folder, a table).
    The pipeline installs its recorder (`install_recorder`, done by importing `rpb.pipeline`,
    which every pipeline job does first), and the library stays ignorant of where records live
    and when a file needs one.
    """

    def file_written(self, path: Path) -> None:
        """`path` was written whole (`atomic_path`)."""

    def folder_written(self, path: Path) -> None:
        """The folder `path` was replaced whole (`atomic_folder`): every file in it is new."""

    def folder_discarded(self, path: Path) -> None:
        """The folder `path` is gone, or replaced: none of its files is there any more."""

    def file_removed(self, path: Path) -> None:
        """`path` was deleted (`remove_artifact`)."""


_recorder = ArtifactRecorder()


def install_recorder(recorder: ArtifactRecorder) -> ArtifactRecorder:
    """Make `recorder` the one told of every write from now on; returns the one it replaces."""
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def remove_artifact(path: str | os.PathLike[str]) -> bool:
    """Delete the file `path` (and, through the recorder, its record); returns whether it was
    there."""
    path = Path(path)
    _recorder.file_removed(path)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


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
    disk seen by pandas, torch or matplotlib) is raised again naming `path`. With `record`, the
    installed `ArtifactRecorder` is told (the pipeline's writes an integrity record).
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
        _recorder.file_written(path)


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


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, record: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder (`partial_folder`) to write the folder `path` into (a model
    `save_pretrained` writes); once the block ends, flushed, it takes `path`'s place by rename.

    A reader never sees a folder without its weights or config: a kill, a full disk or an error
    leaves `path` as it was (absent, or its previous content) and removes the temporary folder.
    An `OSError` naming a file of the temporary folder is raised again naming that file under
    `path`. With `record`, the installed `ArtifactRecorder` is told that the temporary folder is
    gone and `path` was written whole (the pipeline's drops the records of the folder's previous
    files and of files an atomic writer recorded inside the temporary folder, and records every
    new file).
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
        _recorder.folder_discarded(tmp)
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
        _recorder.folder_discarded(tmp)
        _recorder.folder_written(path)


# --- digests and checks --------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
        text = one_line(str(link))
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


def one_line(text: str) -> str:
    """`text` on one line, its runs of white space one space each."""
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
        return f"{name}: {one_line(str(err))}: truncated or damaged; {REBUILD}"
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
        text = f"{err.filename}: {err.strerror}" if err.filename else one_line(str(err))
        if "found in directory" in text or "no file named" in text.lower():
            return f"{text} The model folder is incomplete; {REBUILD}"
        return text
    return None
