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
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RUN_FILE = "mlflow_run.json"
DEFAULT_EXPERIMENT = "rpb"
# Keys whose values must never reach logs or MLflow params.
SECRET_MARKERS = ("token", "secret", "password", "api_key", "apikey")


def resolve_tracking_uri(configured: str | None = None, results_dir: Path = Path("results")) -> str:
    """Environment first, then the config, then a sqlite file under `results_dir`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or configured
    if uri:
        return uri
    return f"sqlite:///{(results_dir / 'mlflow.db').resolve()}"


def init_store(uri: str, experiment: str = DEFAULT_EXPERIMENT) -> str:
    """Create the store's schema and the experiment from this one process; returns its id."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else mlflow.create_experiment(experiment)
    log.info("MLflow store ready at %s (experiment %s = %s)", uri, experiment, experiment_id)
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


def scrub(params: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten nested params to dotted keys and drop anything that looks like a credential."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
            return
        if any(marker in prefix.lower() for marker in SECRET_MARKERS):
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
    """One MLflow run for one job; ends FAILED (and re-raises) if the job raises.

    `parents` maps a role (e.g. "base", "prior") to the run id of the job whose output this one
    consumed; they become `parent.<role>` tags, the run's lineage.
    """
    import mlflow

    mlflow.set_tracking_uri(tracking_uri or resolve_tracking_uri())
    mlflow.set_experiment(experiment)
    name = f"{stage}/{model}/{method}/seed{seed}"
    params = dict(params or {})
    tags = {
        "stage": stage,
        "model": model,
        "method": method,
        "seed": str(seed),
        "corpus": corpus,
        "git_commit": git_commit(),
        "config_hash": config_hash(params),
    }
    for role, run_id in (parents or {}).items():
        if run_id:
            tags[f"parent.{role}"] = run_id
    run = mlflow.start_run(run_name=name, tags=tags)
    try:
        flat = scrub(params)
        # MLflow caps a param value at 6000 chars; long lists are still useful truncated.
        mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})
        yield run
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
