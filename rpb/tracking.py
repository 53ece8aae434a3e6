"""MLflow tracking of one job: its run's name and schema tags, its params, its end (FAILED on an
error, KILLED on SIGTERM), and the store it writes to (docs/tracking.md). The library's
(`rpb finetune --mlflow`, `rpb prior --mlflow`) and the pipeline's jobs log through the same
`tracked_run`, so one schema covers every run; the pipeline's own part (the invocation's parent
run, datasets, eval and table summaries) is rpb.pipeline.tracking. MLflow is imported inside the
functions: importing this module costs nothing.

The store: `--tracking-uri` or the config's `tracking.uri`, with `MLFLOW_TRACKING_URI` first
(`resolve_tracking_uri`). A sqlite store another process has locked is waited for, up to
`RPB_TRACKING_WAIT_S` seconds (default 300; sqlite's busy timeout, `configure_store_wait`), then
the job fails with one line (`tracking_failure`) and its run ends FAILED once the store answers
again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rpb.artifacts import exception_chain

log = logging.getLogger(__name__)


RUN_FILE = "mlflow_run.json"
DEFAULT_EXPERIMENT = "rpb"
# Keys whose values must never reach logs or MLflow params.
SECRET_MARKERS = ("token", "secret", "password", "api_key", "apikey")
# ... as whole words of a key (`hf_token`, `hub.api_key`, `HF_TOKEN`), so `tokenizer`, `n_tokens`
# and `pad_token_id` stay.
SECRET_KEY = re.compile(
    r"(^|[._-])(token|secret|password|passwd|api_?key|credentials?)($|[._-])(?!id$)"
)
# Values that are credentials whatever their key: Hugging Face tokens, HTTP bearer headers.
SECRET_VALUE = re.compile(r"\bhf_[A-Za-z0-9]{20,}|\bbearer\s+\S+", re.IGNORECASE)
# Tags naming the process of a run, so a rerun can tell a dead job's run from a live one.
HOST_TAG, PID_TAG, JOB_DIR_TAG = "rpb.host", "rpb.pid", "rpb.job_dir"
# MLflow's own tag for the commit (shown as the run's source; hidden from the Group-by menu, which
# then reaches the schema's tags sooner).
GIT_COMMIT_TAG = "mlflow.source.git.commit"
GROUP_TAG = "rpb.group"  # "main", or the group of runs beyond the main tables (diagnostic)
END_REASON_TAG = "rpb.end_reason"
# MLflow's own tag for nesting a run under another.
PARENT_RUN_TAG = "mlflow.parentRunId"
# Where a job of a pipeline invocation finds its invocation's record (set by the workflow for
# every job it starts): such a job never creates its store (`_store_gone`).
INVOCATION_ENV = "RPB_MLFLOW_INVOCATION"


# The run a job's run is nested under (MLflow's parent run id) from the store's uri and the
# experiment's id, or None. The library knows no parent: the pipeline installs its invocation's
# reader here when imported (rpb.pipeline.tracking: every job of one `snakemake` invocation nests
# under its parent run), as rpb.artifacts' recorder is installed, so a job's runs keep their
# nesting while the library's commands never load the pipeline.
ParentRunProvider = Callable[[str, str], "str | None"]
_parent_run_provider: ParentRunProvider | None = None


def set_parent_run_provider(provider: ParentRunProvider | None) -> None:
    """Install `provider` as the source of every later `tracked_run`'s parent run (None: none)."""
    global _parent_run_provider
    _parent_run_provider = provider


def parent_run_id(uri: str, experiment_id: str) -> str | None:
    """The parent run id the installed provider names for a run in `uri`'s `experiment_id`."""
    return _parent_run_provider(uri, experiment_id) if _parent_run_provider else None


# How long every store operation waits for a sqlite store another process holds (a `mlflow ui`
# writing, a sqlite3 shell, a backup), in seconds: sqlite's busy timeout. MLflow's own is 20 s and
# cannot be set; a job that gives up loses its work, so the default waits longer.
STORE_WAIT_ENV = "RPB_TRACKING_WAIT_S"
DEFAULT_STORE_WAIT_S = 300.0


class JobTerminated(SystemExit):
    """SIGTERM (Snakemake's or the cluster's cancel) as an exception, so the run ends KILLED."""


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be used (locked past the waiting policy, full); one line."""


def store_wait_s() -> float:
    """Seconds a store operation waits for a lock (`STORE_WAIT_ENV`, default 300)."""
    text = os.environ.get(STORE_WAIT_ENV, "")
    try:
        return max(0.0, float(text)) if text else DEFAULT_STORE_WAIT_S
    except ValueError:
        raise TrackingUnavailable(f"{STORE_WAIT_ENV}={text!r} is not a number of seconds") from None


def _busy_ms() -> int:
    return int(store_wait_s() * 1000)


def _on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Every new sqlite connection (MLflow's engine start-up and schema checks run outside its
    # sessions) waits for a lock instead of failing at once.
    if isinstance(dbapi_connection, sqlite3.Connection):
        dbapi_connection.execute(f"PRAGMA busy_timeout = {_busy_ms()}")


def _on_execute(
    _conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, _many: bool
) -> tuple[str, Any]:
    # MLflow sets `PRAGMA busy_timeout = 20000` at the start of every session; ours replaces it.
    if statement.lstrip()[:20].upper().startswith("PRAGMA BUSY_TIMEOUT"):
        return f"PRAGMA busy_timeout = {_busy_ms()};", parameters
    return statement, parameters


# sqlite's words for a store file deleted (or replaced) under an open connection, and for a new
# empty file where the store was.
STORE_GONE_ERRORS = ("attempt to write a readonly database", "no such table")
# sqlite's words for a full disk (or quota) under the store.
STORE_FULL_ERROR = "database or disk is full"


class _LockNoise(logging.Filter):
    """Drops MLflow's traceback per failed statement on a locked, deleted or full store: the
    job's (or the invocation's) one line (`tracking_failure`) says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        noise = ("database is locked", STORE_FULL_ERROR, *STORE_GONE_ERRORS)
        return not any(m in text for m in noise)


_LOCK_NOISE = _LockNoise()


def configure_store_wait() -> None:
    """Make this process's sqlite stores wait `store_wait_s()` for a lock (idempotent)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    if not event.contains(Engine, "connect", _on_connect):
        event.listen(Engine, "connect", _on_connect)
    if not event.contains(Engine, "before_cursor_execute", _on_execute):
        event.listen(Engine, "before_cursor_execute", _on_execute, retval=True)
    for name in ("mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store"):
        logger = logging.getLogger(name)
        if _LOCK_NOISE not in logger.filters:
            logger.addFilter(_LOCK_NOISE)


def _sqlite_path(uri: str) -> Path | None:
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None


def tracking_failure(err: BaseException, uri: str | None = None) -> str | None:
    """One line for an error of the tracking store (locked past the waiting policy, full, deleted
    while the job ran), naming the store and what to do; None for any other error."""
    if isinstance(err, TrackingUnavailable):
        return str(err)
    text = " ".join(str(e) for e in exception_chain(err))
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "the tracking store"
    path = _sqlite_path(uri)
    store = f"tracking store {path or redact_uri(uri)}"
    gone = next((m for m in STORE_GONE_ERRORS if m in text), None)
    if gone and path is not None and not (path.is_file() and not os.access(path, os.W_OK)):
        return (
            f"{store} was deleted or replaced while the job ran (sqlite: {gone}); rerun the "
            f"pipeline: its start creates a fresh store (finished outputs are kept)"
        )
    if "database is locked" in text:
        holder = f" (`fuser {path}` names it)" if path else ""
        return (
            f"{store} is locked by another process{holder}: waited {store_wait_s():g} s "
            f"({STORE_WAIT_ENV}); let that process finish or stop it, then rerun"
        )
    if STORE_FULL_ERROR in text:  # sqlite's words; a full disk elsewhere is not ours
        return f"{store}: disk full; free space, then rerun"
    return None


def _store_gone(uri: str) -> str | None:
    """For a job of a pipeline invocation (`INVOCATION_ENV`), whose store the invocation's start
    created: the line saying its sqlite store is gone (deleted, or an empty file left where it
    was). MLflow would create the schema again in every job at once, and they race (section 4
    of docs/records/reliability.md); a job started by hand may still create its store."""
    path = _sqlite_path(uri)
    if path is None or not os.environ.get(INVOCATION_ENV):
        return None
    with contextlib.suppress(OSError):
        if path.stat().st_size > 0:
            return None
    return (
        f"tracking store {path} is gone (deleted while the pipeline ran); rerun the pipeline: its "
        "start creates a fresh store (finished outputs are kept; their runs were in the old one)"
    )


def resolve_tracking_uri(configured: str | None = None, results_dir: Path = Path("results")) -> str:
    """Environment first, then the config, then a sqlite file under `results_dir`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or configured
    if uri:
        return uri
    return f"sqlite:///{(results_dir / 'mlflow.db').resolve()}"


def artifact_location(uri: str) -> str | None:
    """Artifacts of a sqlite store live beside it (`<dir>/mlartifacts`), not in the working
    directory, which is MLflow's default; other stores keep their server's default."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri[len(prefix) :]).parent / "mlartifacts").resolve().as_uri()


def git_commit() -> str:
    """The project's commit, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def config_hash(config: Mapping[str, Any]) -> str:
    """Short stable hash of a JSON-serialisable config."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def redact_uri(uri: str) -> str:
    """`uri` with the password of its `user:password@` part replaced by `***` (for logs)."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", uri)


def scrub(params: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten nested params to dotted keys and drop anything that looks like a credential: a key
    naming one, a value shaped like one, or a value containing a secret from the environment
    (e.g. HF_TOKEN's) under an innocent key."""
    env_secrets = [
        value
        for key, value in os.environ.items()
        if len(value) >= 8 and SECRET_KEY.search(key.lower())
    ]
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
            return
        if SECRET_KEY.search(prefix.lower()):
            return
        text = str(value)
        if SECRET_VALUE.search(text) or any(secret in text for secret in env_secrets):
            return
        flat[prefix] = value

    walk("", params)
    return flat


def scrub_tree(params: Mapping[str, Any]) -> dict[str, Any]:
    """`scrub`, nested again (for a config artifact): what `scrub` keeps, in the original shape."""
    tree: dict[str, Any] = {}
    for key, value in scrub(params).items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def read_run_id(output_dir: Path) -> str | None:
    """The MLflow run id a finished job recorded beside its outputs, if any."""
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("run_id")


def end_stale_runs(client: Any, experiment_id: str, name: str, job_dir: str) -> list[str]:
    """Mark KILLED the RUNNING runs of this job (same name and job dir) whose process is dead.

    SIGKILL (OOM killer, a cluster's hard limit) leaves no chance to end a run, so it would stay
    RUNNING forever; the job's next start is the first moment anyone knows it died. A run whose
    process is still alive on this host is left alone (the same job cannot run twice at once:
    Snakemake locks the output directory). Returns the ids marked.
    """
    quoted = name.replace("'", "\\'")
    found = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.run_name = '{quoted}' and attributes.status = 'RUNNING'",
        max_results=1000,
    )
    marked = []
    for run in found:
        tags = run.data.tags
        if tags.get(JOB_DIR_TAG, "-") != job_dir:
            continue
        if tags.get(HOST_TAG) == socket.gethostname() and _alive(tags.get(PID_TAG)):
            continue
        reason = (
            f"found RUNNING when the job restarted (pid {tags.get(PID_TAG)} on "
            f"{tags.get(HOST_TAG)} is gone): the process died without ending its run, e.g. SIGKILL"
        )
        client.set_tag(run.info.run_id, END_REASON_TAG, reason)
        client.set_terminated(run.info.run_id, status="KILLED")
        log.warning("marked stale run %s (%s) KILLED: %s", run.info.run_id, name, reason)
        marked.append(run.info.run_id)
    return marked


def _alive(pid: str | None) -> bool:
    """Whether process `pid` (a tag value) exists on this host."""
    try:
        number = int(pid or "")
    except ValueError:
        return False
    if number <= 0:
        return False
    try:
        os.kill(number, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises `JobTerminated` (only the main thread can set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise JobTerminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- one schema for every run -----------------------------------------------------------------

# What a run is about, the same tags on every run kind (docs/tracking.md, "One schema"): `method`
# (the config's label; no method on corpora, pretraining and prior runs), `base` (which of the
# model's bases, 0 the model itself), `seed` (the seed within the base), `model` (the family's
# table model: `tinyA` for its replicate base `tinyA_p1` too) and `corpus`. A run logs those it
# has; none is ever a placeholder, and no param is named like one. Tags, not params: MLflow's
# Group-by menu lists tags before params, each run's tags in the order it logged them (these
# first, in this order, then the bookkeeping tags), so they sit above every param; and grouped by
# `method` the UI colours each group by a hash of `tag.method.<label>`, distinct for table 1's
# methods (`group_color`).
SCHEMA_TAGS = ("method", "base", "seed", "model", "corpus")
# Nested params logged as one JSON param instead of one param per key: a pretraining run's
# architecture has some twenty keys, and as `architecture.*` they would crowd the Group-by list.
JSON_PARAMS = ("architecture",)
# MLflow's UI draws a run in the colour of this tag (hex): the colour it draws the run's method's
# group in (`run_color`), so a method has one colour, grouped or not, in every store.
RUN_COLOR_TAG = "mlflow.runColor"
# The colours of MLflow 3.17's UI (module 28797 of mlflow/server/js/build/static/js/main.*.js:
# its colour picker's palette), in its order: a group of runs gets one by a hash of its key
# (`group_color`).
UI_PALETTE = (
    "#a6630c", "#c83243", "#b45091", "#8a63bf", "#434a93", "#137dae", "#04867d", "#308613",
    "#facb66", "#1f272d", "#445461", "#5f7281", "#8396a5", "#93320b", "#be501e", "#de7921",
    "#f2be88", "#115026", "#277c43", "#3ba65e", "#8ddda8", "#9e102c", "#c82d4c", "#e65b77",
    "#f792a6", "#0e538b", "#2272b4", "#4299e0", "#8acaff",
)  # fmt: skip
# Placeholders callers used to pass for a part a run does not have; never logged, never named.
_MISSING = (None, "", "-")


def schema_tags(
    *,
    model: str | None = None,
    base: int | str | None = None,
    method: str | None = None,
    corpus: str | None = None,
    seed: int | str | None = None,
) -> dict[str, str]:
    """The schema tags a run has (`SCHEMA_TAGS`, in that order), as MLflow stores them; missing
    parts left out."""
    given = {"model": model, "base": base, "method": method, "corpus": corpus, "seed": seed}
    return {k: str(given[k]) for k in SCHEMA_TAGS if given[k] not in _MISSING}


def mlflow_run_name(stage: str, schema: Mapping[str, str], group: str | None = None) -> str:
    """`[group/]stage/model/corpus/method/base<b>/seed<s>`, the parts the run has:
    `corpora`, `pretrain/tinyA/base1`, `train/tinyA/math/rpb/base1/seed1`."""
    parts = [group, stage, schema.get("model"), schema.get("corpus"), schema.get("method")]
    if "base" in schema:
        parts.append(f"base{schema['base']}")
    if "seed" in schema:
        parts.append(f"seed{schema['seed']}")
    return "/".join(p for p in parts if p not in _MISSING)


def run_color(method: str | None) -> str | None:
    """The colour of a method's runs (`RUN_COLOR_TAG`): the one MLflow's UI draws the method's
    group in when grouped by `method` (`group_color` of `tag.method.<label>`), so a run looks
    like its group, and the same in every store; None for a run without a method."""
    if method in _MISSING:
        return None
    return group_color(f"tag.method.{method}")


def group_color(key: str) -> str:
    """The colour MLflow 3.17's UI draws a group of runs in, from the group's key
    `<tag|param>.<name>.<value>` (`tag.method.rpb` when grouped by the tag `method`): the
    function exported as `T6` by module 75795 of its bundle (`main.*.js`), a Fletcher-16-like sum
    over the key's UTF-16 code units into `UI_PALETTE`. The UI reads no run's colour tag for a
    group, and a colour picked for a group is kept in that browser only."""
    units = key.encode("utf-16-le")
    first = second = 0
    for i in range(0, len(units), 2):
        first = (first + (units[i] | units[i + 1] << 8)) % 255
        second = (second + first) % 255
    return UI_PALETTE[(first | second << 8) % len(UI_PALETTE)]


def _job_params(schema: Mapping[str, str], params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` flattened, credentials removed, a `JSON_PARAMS` mapping as one JSON param, and
    without the schema's names, which are the run's tags: one given in `params` too must agree
    with the schema (a table's spec names its `model` and `corpus`); one with another value, or
    one the run does not have, is a caller's bug (two meanings of one name)."""
    whole = {k: v for k, v in params.items() if k in JSON_PARAMS and isinstance(v, Mapping)}
    flat = scrub({k: v for k, v in params.items() if k not in whole})
    for key, value in whole.items():
        flat[key] = json.dumps(scrub_tree(value), sort_keys=True, default=str)
    for key in SCHEMA_TAGS:
        if key in flat and str(flat[key]) != schema.get(key):
            raise ValueError(
                f"param {key!r}: {flat[key]!r} in params, {schema.get(key)!r} in the schema "
                "(the schema's names are the run's tags)"
            )
    return {k: v for k, v in flat.items() if k not in SCHEMA_TAGS}


@contextlib.contextmanager
def tracked_run(
    *,
    stage: str,
    model: str | None = None,
    method: str | None = None,
    seed: int | str | None = None,
    corpus: str | None = None,
    base: int | str | None = None,
    params: Mapping[str, Any] | None = None,
    parents: Mapping[str, str | None] | None = None,
    run_dir: Path | None = None,
    tracking_uri: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    group: str | None = None,
) -> Iterator[Any]:
    """One MLflow run for one job; ends FAILED (and re-raises) if the job raises, KILLED on SIGTERM.

    `model`, `base`, `method`, `corpus` and `seed` are the schema's tags (`SCHEMA_TAGS`, logged
    first; a part given as None or "-" is left out) and name the run (`mlflow_run_name`); `params`
    are the job's own besides them (a schema name among them must agree, and is left to the tag).
    `group` (e.g. "diagnostic") names runs outside the main tables: it prefixes the run name and
    is the `rpb.group` tag, so a diagnostic run of `none` never passes for table 1's `none`.

    `parents` maps a role (e.g. "base", "prior") to the run id of the job whose output this one
    consumed; they become `parent.<role>` tags, the run's lineage. Runs of the same job left
    RUNNING by a killed process are marked KILLED first (`end_stale_runs`). The run is nested
    under the parent run the installed provider names (`set_parent_run_provider`: a pipeline
    job's invocation run), if any.
    """
    import mlflow

    configure_store_wait()
    uri = tracking_uri or resolve_tracking_uri()
    gone = _store_gone(uri)
    if gone:  # before MLflow's first connection, which would create the schema again
        raise TrackingUnavailable(gone)
    mlflow.set_tracking_uri(uri)
    found = mlflow.set_experiment(experiment)
    schema = schema_tags(model=model, base=base, method=method, corpus=corpus, seed=seed)
    name = mlflow_run_name(stage, schema, group)
    job_dir = str(Path(run_dir).resolve()) if run_dir is not None else "-"
    end_stale_runs(mlflow.MlflowClient(), found.experiment_id, name, job_dir)
    params = dict(params or {})
    flat = _job_params(schema, params)
    tags = {
        **schema,  # first: the order of MLflow's Group-by menu (`SCHEMA_TAGS`)
        "stage": stage,
        GIT_COMMIT_TAG: git_commit(),
        "config_hash": config_hash(params),
        HOST_TAG: socket.gethostname(),
        PID_TAG: str(os.getpid()),
        JOB_DIR_TAG: job_dir,
        GROUP_TAG: group or "main",
    }
    for role, run_id in (parents or {}).items():
        if run_id:
            tags[f"parent.{role}"] = run_id
    color = run_color(schema.get("method"))
    if color is not None:
        tags[RUN_COLOR_TAG] = color
    parent = parent_run_id(mlflow.get_tracking_uri(), found.experiment_id)
    if parent:
        tags[PARENT_RUN_TAG] = parent
    run = mlflow.start_run(run_name=name, tags=tags)
    try:
        with _sigterm_raises():
            # MLflow caps a param value at 6000 chars; long lists are still useful truncated.
            mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})
            mlflow.log_params(numeric_path_params())
            yield run
    except JobTerminated:
        _end_unfinished(run.info.run_id, "KILLED", "SIGTERM")
        raise
    except BaseException as err:
        _end_unfinished(run.info.run_id, "FAILED", _reason(err))
        raise
    else:
        if run_dir is not None:
            from rpb.artifacts import write_text

            write_text(
                Path(run_dir) / RUN_FILE,
                json.dumps({"run_id": run.info.run_id, "name": name}) + "\n",
            )
        mlflow.end_run(status="FINISHED")


def numeric_path_params() -> dict[str, str]:
    """The job's CPU numeric path (rpb.numerics) as `numerics.*` params: which CPU, kernels,
    MKL mode, threads, library versions and lock file computed the run's numbers."""
    from rpb.numerics import numeric_path

    return {f"numerics.{key}": str(value) for key, value in numeric_path().items()}


def _reason(err: BaseException) -> str:
    """The one line a failed run is tagged with (`rpb.end_reason`): what the job prints."""
    from rpb.artifacts import failure_line

    line = tracking_failure(err) or failure_line(err)
    return (line or f"{type(err).__name__}: {err}")[:5000]


def _end_unfinished(run_id: str, status: str, reason: str) -> None:
    """End the active run with `status` (FAILED, KILLED) and its reason. The job's own error
    stays the one reported: if the store fails here too (locked past the waiting policy again, a
    full disk), one warning says the run stays RUNNING, which the job's next start marks KILLED
    (`end_stale_runs`)."""
    import mlflow

    tagged = False
    with contextlib.suppress(Exception):  # the reason is a courtesy; the status is what counts
        mlflow.set_tag(END_REASON_TAG, reason)
        tagged = True
    try:
        mlflow.end_run(status=status)  # pops the run first: it is never left active
    except Exception as again:
        log.warning(
            "MLflow run %s stays RUNNING (%s); the next start of this job marks it KILLED",
            run_id,
            tracking_failure(again) or f"{type(again).__name__}: {again}".splitlines()[0],
        )
        return
    if not tagged:
        # The store answered the end after failing the tag (a lock released while the tag
        # waited): tag the ended run now, so a FAILED run always says why.
        with contextlib.suppress(Exception):
            mlflow.MlflowClient().set_tag(run_id, END_REASON_TAG, reason)
