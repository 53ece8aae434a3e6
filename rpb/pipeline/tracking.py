"""MLflow tracking: one run per pipeline job, named and tagged for lineage, nested under one
parent run per `snakemake` invocation (docs/tracking.md).

The store defaults to a sqlite file under `results/`; `MLFLOW_TRACKING_URI` or the config's
`tracking.uri` override it. A fresh sqlite store must be created by one process before jobs fan out
(concurrent first use races on schema migrations), which `init_store` does. Every job writes the id
of its run next to its outputs (`mlflow_run.json`) so downstream jobs can tag what they consumed.

Snakemake's onstart creates the invocation's parent run (`start_invocation`) and records it in a
file under the results folder, which every job of that invocation reads (`current_invocation`),
also on other nodes of a cluster; onsuccess/onerror end it (`end_invocation`).

A sqlite store another process has locked is waited for, up to `RPB_TRACKING_WAIT_S` seconds
(default 300; sqlite's busy timeout, `configure_store_wait`), then the job fails with one line
(`tracking_failure`) and its run ends FAILED once the store answers again.
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
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rpb.artifacts import exception_chain
from rpb.method_config import MethodConfig, method_params

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
# MLflow's own tags: the experiment kind the UI opens an experiment with ("custom_model_development"
# is its "Machine learning" kind: the runs table of the "Model training" view, not GenAI traces),
# descriptions (experiment and run), and nesting.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"
PARENT_RUN_TAG = "mlflow.parentRunId"
# Where a job finds its invocation's record (set by the workflow for every job it starts).
INVOCATION_ENV = "RPB_MLFLOW_INVOCATION"
INVOCATION_STAGE = "invocation"
PROJECT_NOTE = (
    'rpb reproduces the MoE post-training paper "Router Prior Bias" (arXiv:2609.08115): '
    "router methods (none, load balancing, anchors, RPB, ...) are post-trained on a base MoE and "
    "compared on in-domain and out-of-domain accuracy and on how much of the base's expert "
    "co-activation structure they keep.\n\n"
    "One parent run per `snakemake` invocation (`invocation/<UTC time>`); every job's run is "
    "nested under it, named `{stage}/{model}/{corpus}/{method}/base{base}/seed{seed}` (the parts "
    "it has). Table 1 here: Chart view, Group by, `method`: the first sections' bars, "
    "`accuracy` (in_domain, ood_mean), `coactivation` (community_nmi, coact_cosine, modularity) "
    "and `ood` (each OOD task), are table 1's columns per method (means over seeds)."
)


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


def half_migrated(path: Path) -> str | None:
    """The line for a sqlite store left half-migrated (an `_alembic_tmp_*` table: a schema creation
    or upgrade cut short, or raced by jobs after the store was deleted), which MLflow fails on at
    every start; None for a sound store or no file. Read-only: the store is not touched."""
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=store_wait_s())
        try:
            rows = db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE '_alembic_tmp_%'"
            ).fetchall()
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return None  # not ours to judge here; MLflow names what it finds
    if not rows:
        return None
    return (
        f"tracking store {path} is half-migrated (table {rows[0][0]} left by a schema creation "
        f"cut short, e.g. after the store was deleted while jobs ran): move it aside (mv {path} "
        f"{path}.broken) and rerun; a fresh store is created, the results' files are unaffected"
    )


def _announce_wait(uri: str) -> None:
    """Say at once, in one line, that the store is locked and how long we wait (the wait itself
    is silent)."""
    path = _sqlite_path(uri)
    if path is None or not path.is_file():
        return
    try:
        probe = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
        finally:
            probe.close()
    except sqlite3.OperationalError as err:
        if "locked" in str(err):
            print(
                f"rpb: tracking store {path} is locked by another process; waiting up to "
                f"{store_wait_s():g} s ({STORE_WAIT_ENV})",
                file=sys.stderr,
                flush=True,
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


def init_store(uri: str, experiment: str = DEFAULT_EXPERIMENT, note: str | None = None) -> str:
    """Create the store's schema and the experiment from this one process; returns its id.

    The experiment is a model-training one (`EXPERIMENT_KIND_TAG`), so the UI opens its runs
    table; `note` (default `PROJECT_NOTE`) becomes its description. An existing experiment gets the
    kind if it has none (a kind set in the UI stays) and `note` if one is given.
    """
    import mlflow

    configure_store_wait()
    client = mlflow.MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        experiment_id = client.create_experiment(
            experiment,
            artifact_location=artifact_location(uri),
            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND, NOTE_TAG: note or PROJECT_NOTE},
        )
    else:
        experiment_id = found.experiment_id
        if EXPERIMENT_KIND_TAG not in found.tags:
            client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        if note or NOTE_TAG not in found.tags:
            client.set_experiment_tag(experiment_id, NOTE_TAG, note or PROJECT_NOTE)
    log.info(
        "MLflow store ready at %s (experiment %s = %s)", redact_uri(uri), experiment, experiment_id
    )
    return experiment_id


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
    RUNNING by a killed process are marked KILLED first (`end_stale_runs`).
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
    invocation = current_invocation(mlflow.get_tracking_uri(), found.experiment_id)
    if invocation:
        tags[PARENT_RUN_TAG] = invocation["run_id"]
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


# --- the invocation's parent run ----------------------------------------------------------------


def _log_params_batched(client: Any, run_id: str, params: Mapping[str, Any]) -> None:
    """Log params through `log_batch`, 100 at a time (MLflow's per-request limit)."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in scrub(params).items()]
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start : start + 100])


def start_invocation(
    record: Path,
    uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    *,
    config: Mapping[str, Any] | None = None,
    configfiles: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> str | None:
    """Open the parent run of one pipeline invocation and write `record` (JSON: run id, store,
    experiment, and the config's evaluation split that eval jobs summarise with); returns the id.

    Called once, from Snakemake's onstart (one process, before any job: it also creates a fresh
    store). A record left by an invocation that never reached onsuccess/onerror (Snakemake
    SIGKILLed) names a run still RUNNING: it is marked KILLED first. Without mlflow in
    Snakemake's own environment (jobs in conda environments) it says so and returns None: the
    jobs' runs are then not nested.
    """
    try:
        import mlflow  # noqa: F401  (Snakemake's own environment may lack it)
    except ImportError:
        print(
            "rpb: mlflow is not importable where Snakemake runs: no invocation run", file=sys.stderr
        )
        return None

    configure_store_wait()
    path = _sqlite_path(uri)
    broken = half_migrated(path) if path is not None else None
    if broken:
        raise TrackingUnavailable(broken)
    _announce_wait(uri)
    try:
        return _open_invocation(record, uri, experiment, dict(config or {}), configfiles, command)
    except Exception as err:  # one line for a locked or full store; a bug keeps its traceback
        line = tracking_failure(err, uri)
        if line is None:
            raise
        raise TrackingUnavailable(line) from None


def _open_invocation(
    record: Path,
    uri: str,
    experiment: str,
    config: dict[str, Any],
    configfiles: Sequence[str],
    command: Sequence[str] | None,
) -> str:
    import mlflow

    command = list(sys.argv if command is None else command)
    record = Path(record)
    client = mlflow.MlflowClient(tracking_uri=uri)
    stale = read_invocation(record)
    if stale and stale.get("tracking_uri") == uri:
        with contextlib.suppress(Exception):  # a record of a store since deleted
            if client.get_run(stale["run_id"]).info.status == "RUNNING":
                client.set_tag(
                    stale["run_id"],
                    END_REASON_TAG,
                    "found RUNNING by the next invocation: Snakemake ended without its handlers",
                )
                client.set_terminated(stale["run_id"], status="KILLED")
    files = ", ".join(["config/config.yaml", *map(str, configfiles)])
    chash = config_hash(config)
    note = (
        f"{PROJECT_NOTE}\n\nLatest invocation: config {files} (scale {config.get('scale', '-')}, "
        f"config_hash {chash}), results in {config.get('results_dir', 'results')}."
    )
    experiment_id = init_store(uri, experiment, note=note)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tags = {
        "stage": INVOCATION_STAGE,
        GIT_COMMIT_TAG: git_commit(),
        "config_hash": chash,
        "configfiles": files,
        HOST_TAG: socket.gethostname(),
        PID_TAG: str(os.getpid()),
        NOTE_TAG: (
            f"`{' '.join(command)}`\n\nConfig: {files} (config_hash {chash}). Each job of this "
            "invocation is a child run; jobs whose outputs were up to date did not run and "
            "are found under the invocation that made them."
        ),
    }
    run = client.create_run(experiment_id, run_name=f"{INVOCATION_STAGE}/{stamp}", tags=tags)
    run_id = run.info.run_id
    # A few params (every config key would crowd the job runs' params in the UI's menus); the
    # whole config is the run's artifact config.json.
    picked = {k: config[k] for k in ("scale", "results_dir", "seeds") if k in config}
    _log_params_batched(client, run_id, {**picked, "configfiles": files})
    client.log_dict(run_id, scrub_tree(config), "config.json")
    evaluation = config.get("evaluation") or {}
    payload = {
        "run_id": run_id,
        "tracking_uri": uri,
        "experiment": experiment,
        "experiment_id": experiment_id,
        "summary": {
            "ood": list(evaluation.get("ood") or []),
            "corpus_tasks": dict(evaluation.get("corpus_tasks") or {}),
        },
    }
    record.parent.mkdir(parents=True, exist_ok=True)
    from rpb.artifacts import atomic_path

    with atomic_path(record, record=False) as tmp:  # jobs never read half a record
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
    log.info("invocation run %s (%s)", run_id, redact_uri(uri))
    return run_id


def read_invocation(record: Path) -> dict[str, Any] | None:
    """The invocation record at `record`, or None if there is none."""
    try:
        return json.loads(Path(record).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def current_invocation(uri: str | None = None, experiment_id: str | None = None) -> dict | None:
    """The record of the invocation this job belongs to (`INVOCATION_ENV` names its file), if it
    is for the same store and experiment; None for a job started by hand."""
    path = os.environ.get(INVOCATION_ENV)
    record = read_invocation(Path(path)) if path else None
    if not record:
        return None
    if uri is not None and record.get("tracking_uri") != uri:
        return None
    if experiment_id is not None and record.get("experiment_id") != experiment_id:
        return None
    return record


def end_invocation(record: Path, status: str = "FINISHED") -> str | None:
    """End the parent run `record` names with `status` (Snakemake's onsuccess: FINISHED, onerror:
    FAILED), tag it with its jobs' statuses, and remove the record; returns the run id."""
    found = read_invocation(Path(record))
    if not found:
        return None
    import mlflow

    configure_store_wait()
    client = mlflow.MlflowClient(tracking_uri=found["tracking_uri"])
    run_id = found["run_id"]
    try:
        children = client.search_runs(
            [found["experiment_id"]],
            filter_string=f"tags.`{PARENT_RUN_TAG}` = '{run_id}'",
            max_results=50000,
        )
        counts: dict[str, int] = {}
        for child in children:
            counts[child.info.status] = counts.get(child.info.status, 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
        client.set_tag(run_id, "rpb.jobs", summary)
        if status != "FINISHED":  # a failed invocation says why, as a failed job's run does
            failed = [c.info.run_name for c in children if c.info.status == "FAILED"]
            shown = ", ".join(failed[:5]) + (f" (+{len(failed) - 5} more)" if failed[5:] else "")
            reason = (
                f"failed jobs: {shown}" if failed else "Snakemake failed before or between jobs"
            )
            client.set_tag(run_id, END_REASON_TAG, f"{reason} (see the Snakemake log)")
        client.set_terminated(run_id, status=status)
    except Exception as err:
        # The jobs are done either way; the record stays, so the next invocation ends the run.
        line = tracking_failure(err, found["tracking_uri"])
        if line is None:
            raise
        print(f"rpb: invocation run {run_id} not ended: {line}", file=sys.stderr)
        return None
    Path(record).unlink(missing_ok=True)
    log.info("invocation run %s ended %s (%s)", run_id, status, summary)
    return run_id


# --- what eval and analysis runs carry, for comparing methods in the UI -------------------------


def model_job_params(*, method: str, model_dir: Path, **extra: Any) -> dict[str, Any]:
    """Params of a job reading one trained model (eval, analysis) besides the schema's: the
    method's `kind`, `strength` and `options` (`method_params`), then `extra` and `model_dir`, so
    the UI groups and compares runs by them.

    Kind, strength and options come from the training job's record beside the model
    (`train_history.json`: what it actually trained with, also as written before MethodConfig);
    the base is kind `base`.
    """
    trained = None
    history = Path(model_dir).parent / "train_history.json"
    if method != "base" and history.is_file():
        recorded = json.loads(history.read_text()).get("method")
        if recorded:
            trained = MethodConfig.from_dict(recorded, where=f"{history}: method")
    return {**method_params(method, trained), **extra, "model_dir": str(model_dir)}


# Metric units, one per family (docs/tracking.md, "Metric units"): accuracy-like scores are
# percent everywhere, as the tables show them: exact match (`in_domain`, `ood_<task>`, `ood_mean`,
# `<task>.<metric>_pct`) and p(target) (the tables' `_p` columns, on table runs); the structure
# metrics keep table 1's unitless values (`coact_cosine` in [0, 1]); anything else keeps its own
# unit and has no `_pct` (`math_ll.ll_per_token`, nats). lm-eval's means of 0/1 item scores:
ACCURACY_METRICS = frozenset({"exact_match", "acc", "acc_norm", "em", "f1", "mc1", "mc2"})
PCT_SUFFIX = "_pct"
_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_./ :-]")


def task_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """Each evaluated task's score under a plain name: `<task>.<metric>_pct` in percent for an
    accuracy-like metric (`math.exact_match_pct`), `<task>.<metric>` in its own unit otherwise
    (`math_ll.ll_per_token`); our eval sets' `rpb_` task prefix is dropped (it is no method)."""
    metrics: dict[str, float] = {}
    for task, entry in result["tasks"].items():
        name = _METRIC_CHARS.sub("_", f"{task.removeprefix('rpb_')}.{entry['metric']}")
        score = float(entry["score"])
        if str(entry["metric"]) in ACCURACY_METRICS:
            metrics[name + PCT_SUFFIX] = 100.0 * score
        else:
            metrics[name] = score
    return metrics


# Table 1's columns on eval and analysis runs, in MLflow chart sections that sort before the
# training runs' (`layer0/...`, `mean/...`): the UI orders named sections alphabetically and puts
# names without a `/` ("Model metrics") after all of them, so table 1's charts open the chart view
# grouped by method with no typing or scrolling (docs/tracking.md, "Table 1 in the UI").
# A chart's title is its metric's full name, cut with an ellipsis where it is wider than its
# card: at a 1400 px window MLflow 3.17 lays a section's charts three to a row, with room for 18
# characters of title (measured by bench/browser_check.py; `coactivation/community_nmi` read
# "coactivation/com..."). Table 1's names keep to that, but for the p(target) pair
# (`accuracy/in_domain_p`, 20), which table 1's view (`table1_view_state`) draws two to a row.
CHART_TITLE_CHARS = 18
STRUCTURE_METRICS = {
    "community_nmi": "coact/nmi",
    "coact_cosine": "coact/cosine",
    "modularity": "coact/modularity",
}
STRUCTURE_COLUMNS = tuple(STRUCTURE_METRICS)
# Table 1's p(target) columns, the measure its verdicts are judged on at tiny scale (docs/claims.md,
# "The primary metric at tiny scale"), beside their exact-match twins in the `accuracy` section:
# `accuracy/in_domain_p`, `accuracy/ood_mean_p`.
P_TARGET_COLUMNS = ("in_domain_p", "ood_mean_p")


def table1_metric(column: str) -> str:
    """The run metric holding table 1's `column` for one run: `accuracy/in_domain`,
    `accuracy/ood_mean`, `ood/<task>` for `ood_<task>`, `coact/<short name>` for the structure
    columns (`STRUCTURE_METRICS`: `coact/cosine` for `coact_cosine`); any other name is its
    own."""
    if column in ("in_domain", "ood_mean", *P_TARGET_COLUMNS):
        return f"accuracy/{column}"
    if column.startswith("ood_"):
        return f"ood/{column.removeprefix('ood_')}"
    if column in STRUCTURE_METRICS:
        return STRUCTURE_METRICS[column]
    return column


def eval_summary(result: Mapping[str, Any], corpus: str, spec: Mapping[str, Any]) -> dict:
    """Table 1's accuracy columns for one evaluation output (percent), named by `table1_metric`:
    `in_domain` (the corpus's in-domain items pooled), `ood_<task>` for each OOD task and
    `ood_mean`, computed by the same functions as table 1 (rpb.report.run_records), so that table
    1's cell is the mean of these over seeds.
    A task the output lacks leaves its metric (and `ood_mean`) out, with a warning."""
    import numpy as np

    from rpb.report.run_records import exact_match_items, in_domain_items

    where = Path(f"<eval {corpus}>")
    metrics: dict[str, float] = {}
    try:
        metrics[table1_metric("in_domain")] = 100.0 * float(
            in_domain_items(dict(result), dict(spec), corpus, where).mean()
        )
    except ValueError as err:
        log.warning("no in_domain metric: %s", err)
    ood = []
    for task in spec.get("ood", []):
        try:
            score = 100.0 * float(exact_match_items(dict(result), task, where).mean())
        except ValueError as err:
            log.warning("no ood_%s metric: %s", task, err)
            continue
        metrics[table1_metric(f"ood_{task}")] = score
        ood.append(score)
    if ood and len(ood) == len(spec.get("ood", [])):
        metrics[table1_metric("ood_mean")] = float(np.mean(ood))
    return metrics | p_target_summary(result, corpus, spec)


def p_target_summary(result: Mapping[str, Any], corpus: str, spec: Mapping[str, Any]) -> dict:
    """Table 1's p(target) columns for one evaluation output (percent), as table 1 computes them
    (rpb.report.tables.accuracy_record): `accuracy/in_domain_p`, the mean over the corpus's
    in-domain tasks, and `accuracy/ood_mean_p`, over the OOD tasks. An output without the eval
    sets' loglikelihood tasks (paper scale's standard benchmarks) has none."""
    from rpb.report.run_records import in_domain_tasks
    from rpb.report.tables import P_TARGET, measure_score

    where = Path(f"<eval {corpus}>")
    tasks = {"in_domain_p": in_domain_tasks(dict(spec), corpus), "ood_mean_p": spec.get("ood")}
    metrics: dict[str, float] = {}
    for column, of in tasks.items():
        if not of:
            continue
        try:
            score = measure_score(dict(result), list(of), where, P_TARGET)[0]
        except ValueError as err:
            log.info("no %s metric: %s", table1_metric(column), err)
            continue
        metrics[table1_metric(column)] = score
    return metrics


def log_eval_summary(result: Mapping[str, Any], corpus: str) -> dict[str, float]:
    """Log `eval_summary` to the active run, with the invocation's evaluation split (the config's
    `evaluation.ood` and `corpus_tasks`); a job started by hand has none and logs only its
    per-task scores."""
    import mlflow

    invocation = current_invocation()
    if mlflow.active_run() is None or not invocation:
        log.info("no invocation record: table 1's summary metrics are not logged")
        return {}
    metrics = eval_summary(result, corpus, invocation["summary"])
    mlflow.log_metrics(metrics)
    return metrics


def log_analysis_summary(summary: Mapping[str, Any]) -> dict[str, float]:
    """Log an analysis output's layer means (`topk_overlap_with_base`, `kl_to_base`, ...), table
    1's structure columns named by `table1_metric` (`coact/cosine`); non-finite
    values are left out, as table 1 shows them empty."""
    import math

    import mlflow

    metrics = {
        table1_metric(k): float(v) for k, v in summary["mean"].items() if math.isfinite(float(v))
    }
    if mlflow.active_run() is not None:
        mlflow.log_metrics(metrics)
    return metrics


# --- what table runs carry ------------------------------------------------------------------------


def table_metrics(stage: str, frame: Any) -> dict[str, float]:
    """A table's headline numbers as metrics of its run: `<stage>/<row>/<column>`
    (`table1/rpb/in_domain`, `table1/rpb/in_domain_ci_low`; `table3/in_domain/rpb/lbl/diff`; a
    row per run, `table4/rpb/base1/seed0/in_domain`), in the table's own units (its accuracy
    columns, exact match and `_p`, in percent); empty cells are left out. The stage first: one
    chart section per table, apart from the eval runs'."""
    import math

    from rpb.report.registry import REPORTS

    keys, columns = REPORTS[stage].headline if stage in REPORTS else ((), ())
    if not keys or not set(keys) <= set(frame.columns):
        return {}
    metrics: dict[str, float] = {}
    for _, row in frame.iterrows():
        label = "/".join(
            f"{k}{row[k]}" if k in ("base", "seed") else _METRIC_CHARS.sub("_", str(row[k]))
            for k in keys
        )
        for column in columns:
            if column not in frame.columns:
                continue
            try:
                value = float(row[column])
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                metrics[f"{stage}/{label}/{column}"] = value
    return metrics


# Table 1 in MLflow's UI as one link (docs/tracking.md, "Table 1 in the UI"): a view that MLflow
# 3.17 keeps in an experiment tag `mlflow.sharedViewState.<key>` and opens from
# `...runs?viewStateShareKey=<key>` (its *Share* button writes the same). The view: table 1's
# eval runs (its methods' only: `hard`, which check M2 trains, is left out), grouped by method,
# the chart view without the runs list beside it, on the p(target) charts, two to a row. So the
# view reads whole in a 1400 px window with the Assistant panel MLflow opens on a fresh profile
# (three charts to a row beside it cut the titles to "accuracy/in_do..." and the legends to two
# methods; bench/browser_check.py looks at it).
TABLE1_VIEW = "table1"
TABLE1_VIEW_TAG = "mlflow.sharedViewState." + TABLE1_VIEW
TABLE1_VIEW_CHARTS = "_p"  # the chart search: accuracy/in_domain_p, accuracy/ood_mean_p


def table1_view_state(others: Iterable[str]) -> dict[str, Any]:
    """MLflow's view state of table 1's view: eval runs less those of the methods `others` (the
    store's methods that are no row of table 1), grouped by the tag `method`."""
    search = " and ".join(["tags.stage = 'eval'", *(f"tags.method != '{m}'" for m in others)])
    return {
        "searchFilter": search,
        "groupBy": {
            "aggregateFunction": "average",
            "groupByKeys": [{"mode": "tag", "groupByData": "method"}],
        },
        "runListHidden": True,
        "chartsSearchFilter": TABLE1_VIEW_CHARTS,
        "compareRunSections": [
            {
                "uuid": "rpb-table1-accuracy",
                "name": "accuracy",
                "display": True,
                "isReordered": False,
                "deleted": False,
                "isGenerated": True,
                "columns": 2,
            }
        ],
        "compareRunCharts": [
            {
                "uuid": f"rpb-table1-{column}",
                "type": "BAR",
                "metricSectionId": "rpb-table1-accuracy",
                "isGenerated": True,
                "deleted": False,
                "metricKey": table1_metric(column),
            }
            for column in P_TARGET_COLUMNS
        ],
    }


def table1_view_link(experiment_id: str, base: str = "") -> str:
    """The link (after the server's address `base`) that opens table 1's view."""
    return (
        f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        f"&compareRunsMode=CHART&viewStateShareKey={TABLE1_VIEW}"
    )


def log_table1_view(methods: Iterable[str]) -> dict[str, Any] | None:
    """Write table 1's view (`table1_view_state`) into the active run's experiment: table 1's
    rows `methods` against the methods of the experiment's eval runs."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        return None
    client = mlflow.MlflowClient()
    experiment = run.info.experiment_id
    evals = client.search_runs([experiment], "tags.stage = 'eval'", max_results=50000)
    stored = {r.data.tags["method"] for r in evals if "method" in r.data.tags}
    state = table1_view_state(sorted(stored - set(methods)))
    client.set_experiment_tag(experiment, TABLE1_VIEW_TAG, json.dumps(state))
    return state


def log_table_run(stage: str, csv: Path) -> dict[str, float]:
    """Log a table's CSV to the active run as an MLflow table (`<stem>.json`, which the UI's
    artifact view shows as a table) and its headline numbers as metrics (`table_metrics`);
    table 1's run also writes table 1's view (`log_table1_view`)."""
    import mlflow
    import pandas as pd

    frame = pd.read_csv(csv)
    metrics = table_metrics(stage, frame)
    if mlflow.active_run() is None:
        return metrics
    if stage == "table1" and "method" in frame.columns:
        log_table1_view(frame["method"].astype(str))
    # log_table's JSON has no NaN: an empty cell is null.
    mlflow.log_table(frame.astype(object).where(frame.notna(), None), f"{Path(csv).stem}.json")
    if metrics:
        mlflow.log_metrics(metrics)
    return metrics


# --- datasets ------------------------------------------------------------------------------------


def _manifest_entry(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """The data folder's `manifest.json` entry for `path` (its root and the entry), if listed."""
    for root in Path(path).resolve().parents[:3]:
        manifest = root / "manifest.json"
        if manifest.is_file():
            files = json.loads(manifest.read_text()).get("files", {})
            key = Path(path).resolve().relative_to(root).as_posix()
            if key in files:
                return root, files[key]
    return None


def jsonl_dataset(path: Path) -> Any:
    """An MLflow dataset of one JSONL file: its rows (schema and row count in the UI), named by
    its place in the data folder (`post/math`, `eval/addition`), its digest the file's sha256 as
    the corpora manifest records it (first 36 hex digits: MLflow's limit)."""
    import mlflow.data
    import pandas as pd
    from mlflow.data.sources import LocalArtifactDatasetSource

    path = Path(path)
    with path.open("rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    found = _manifest_entry(path)
    name = path.stem
    if found is not None:
        root, entry = found
        name = path.resolve().relative_to(root).with_suffix("").as_posix()
        if entry.get("sha256") not in (None, sha):
            log.warning("%s: sha256 %s, but the manifest records %s", path, sha, entry["sha256"])
    frame = pd.read_json(path, lines=True, dtype=False)
    source = LocalArtifactDatasetSource(str(path.resolve()))
    return mlflow.data.from_pandas(frame, source=source, name=name, digest=sha[:36])


_DATASET_ATTEMPTS = 3  # log_datasets: a lost insert race needs one retry; 3 allows two


def log_datasets(paths: Iterable[Path | str | None], context: str) -> list[str]:
    """Log each existing JSONL file in `paths` as an input dataset of the active run (`context`:
    training, prior, evaluation, probe); returns the names logged. Others (lm-eval's own tasks at
    paper scale) are skipped; no active run (a non-main rank): nothing. Jobs call it after their
    work, so a malformed file is reported by the loader that names its line."""
    import mlflow

    if mlflow.active_run() is None:
        return []
    files = [Path(p) for p in paths if p is not None and Path(p).suffix == ".jsonl"]
    datasets = [jsonl_dataset(p) for p in files if p.is_file()]
    if datasets:
        n = len(datasets)
        for attempt in range(_DATASET_ATTEMPTS):
            try:
                mlflow.log_inputs(datasets=datasets, contexts=[context] * n, tags_list=[None] * n)
                break
            except mlflow.exceptions.MlflowException as error:
                # Two jobs logging the same new dataset at once: the slower insert hits the
                # store's unique (experiment, name, digest) key. The dataset now exists, and a
                # retry links it instead of inserting it, so the job keeps its finished work.
                lost_race = "UNIQUE constraint failed: datasets" in str(error)
                if not lost_race or attempt == _DATASET_ATTEMPTS - 1:
                    raise
                log.info("datasets inserted by a concurrent job; linking them (%d)", attempt + 1)
    return [d.name for d in datasets]


def eval_sets(eval_dir: Path, tasks: Iterable[str]) -> list[Path]:
    """The JSONL eval sets of `tasks` in `eval_dir` (`<task>.jsonl`)."""
    return [Path(eval_dir) / f"{task}.jsonl" for task in tasks]
