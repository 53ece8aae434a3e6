"""MLflow tracking: one run per pipeline job, named and tagged for lineage (DESIGN section 7).

The store defaults to a sqlite file under `results/`; `MLFLOW_TRACKING_URI` or the config's
`tracking.uri` override it. A fresh sqlite store must be created by one process before jobs fan out
(concurrent first use races on schema migrations), which `init_store` does. Every job writes the id
of its run next to its outputs (`mlflow_run.json`) so downstream jobs can tag what they consumed.
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
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

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
END_REASON_TAG = "rpb.end_reason"


class JobTerminated(SystemExit):
    """SIGTERM (Snakemake's or the cluster's cancel) as an exception, so the run ends KILLED."""


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


def init_store(uri: str, experiment: str = DEFAULT_EXPERIMENT) -> str:
    """Create the store's schema and the experiment from this one process; returns its id."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(experiment)
    experiment_id = (
        found.experiment_id
        if found
        else mlflow.create_experiment(experiment, artifact_location=artifact_location(uri))
    )
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


@contextlib.contextmanager
def tracked_run(
    *,
    stage: str,
    model: str,
    method: str = "-",
    seed: int | str = "-",
    corpus: str = "-",
    params: Mapping[str, Any] | None = None,
    parents: Mapping[str, str | None] | None = None,
    run_dir: Path | None = None,
    tracking_uri: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
) -> Iterator[Any]:
    """One MLflow run for one job; ends FAILED (and re-raises) if the job raises, KILLED on SIGTERM.

    `parents` maps a role (e.g. "base", "prior") to the run id of the job whose output this one
    consumed; they become `parent.<role>` tags, the run's lineage. Runs of the same job left
    RUNNING by a killed process are marked KILLED first (`end_stale_runs`).
    """
    import mlflow

    mlflow.set_tracking_uri(tracking_uri or resolve_tracking_uri())
    found = mlflow.set_experiment(experiment)
    name = f"{stage}/{model}/{method}/seed{seed}"
    job_dir = str(Path(run_dir).resolve()) if run_dir is not None else "-"
    end_stale_runs(mlflow.MlflowClient(), found.experiment_id, name, job_dir)
    params = dict(params or {})
    tags = {
        "stage": stage,
        "model": model,
        "method": method,
        "seed": str(seed),
        "corpus": corpus,
        "git_commit": git_commit(),
        "config_hash": config_hash(params),
        HOST_TAG: socket.gethostname(),
        PID_TAG: str(os.getpid()),
        JOB_DIR_TAG: job_dir,
    }
    for role, run_id in (parents or {}).items():
        if run_id:
            tags[f"parent.{role}"] = run_id
    run = mlflow.start_run(run_name=name, tags=tags)
    try:
        with _sigterm_raises():
            flat = scrub(params)
            # MLflow caps a param value at 6000 chars; long lists are still useful truncated.
            mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})
            yield run
    except JobTerminated:
        mlflow.set_tag(END_REASON_TAG, "SIGTERM")
        mlflow.end_run(status="KILLED")
        raise
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / RUN_FILE).write_text(
                json.dumps({"run_id": run.info.run_id, "name": name}) + "\n"
            )
        mlflow.end_run(status="FINISHED")
