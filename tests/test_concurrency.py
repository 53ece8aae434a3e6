"""Parallel jobs on one sqlite tracking store (docs/design.md, section 7).

MLflow creates a store's schema on first use, and two processes doing that at once race on the
schema migrations; `rpb pipeline init-tracking` (the pipeline's `tracking_init` rule, which every
other job waits for) does it once. After that, jobs may write in parallel: MLflow opens every
sqlite session with `PRAGMA busy_timeout = 20000`, so writers wait for each other instead of
failing with "database is locked". Processes are started together behind a barrier (a file they
wait for), and the tracked jobs wait again once their runs are open, so their writes really
overlap on a loaded machine too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpb.pipeline.tracking import init_store

ROOT = Path(__file__).resolve().parents[1]
JOBS, STEPS = 5, 30
# One pipeline-like job: a tracked run with params, then many small metric writes.
JOB = """
import os, sys, time
from pathlib import Path
import mlflow
from rpb.pipeline.tracking import tracked_run
uri, job, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
Path(f"{go}.ready{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.01)
with tracked_run(stage="train", model="m", seed=job, params={"job": job}, tracking_uri=uri,
                 experiment="rpb", run_dir=go.parent / f"job{job}"):
    # A second barrier: every run is open before any writes its metrics, so they overlap
    # however the machine schedules the processes.
    Path(f"{go}.open{job}").touch()
    deadline = time.monotonic() + 120
    while len(list(go.parent.glob(f"{go.name}.open*"))) < %(jobs)d:
        if time.monotonic() > deadline:
            sys.exit("the second barrier: not every job opened its run within 120 s")
        time.sleep(0.01)
    for step in range(1, %(steps)d + 1):
        mlflow.log_metrics({"loss": 1.0 / step, "job": float(job)}, step=step)
"""
# A first use of a fresh store: MLflow creates the schema, then the experiment.
FIRST_USE = """
import os, sys, time
from pathlib import Path
import mlflow
uri, go = sys.argv[1], Path(sys.argv[2])
Path(f"{go}.ready{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.01)
mlflow.set_tracking_uri(uri)
mlflow.set_experiment("rpb")
"""
# What concurrent schema creation fails with (sqlite table/column races, alembic's version check,
# and alembic's batch table copy reading a table another process is altering: seen on a loaded
# 2-core machine as "Circular dependency detected. ('usage_tracking', 'experiment_id')").
MIGRATION_RACE = re.compile(
    r"already exists|duplicate column|Online migration expected|UNIQUE constraint failed"
    r"|database is locked|no such table|Circular dependency detected"
)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _together(script: str, args: list[list[str]], go: Path) -> list[subprocess.CompletedProcess]:
    """Start one process per argument list, release them at once, collect their results."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *a],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for a in args
    ]
    # Release them once all have imported mlflow and reached the barrier.
    deadline = time.monotonic() + 120
    while len(list(go.parent.glob(f"{go.name}.ready*"))) < len(procs):
        assert time.monotonic() < deadline, "the processes never reached the barrier"
        assert all(p.poll() is None for p in procs), "a process died before the barrier"
        time.sleep(0.05)
    go.touch()
    results = []
    for proc, a in zip(procs, args, strict=True):
        out, err = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(a, proc.returncode, out, err))
    return results


@pytest.mark.slow
def test_parallel_jobs_on_an_initialised_store(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = init_store(uri, "rpb")
    go = tmp_path / "go"
    script = JOB % {"steps": STEPS, "jobs": JOBS}
    results = _together(script, [[uri, str(job), str(go)] for job in range(JOBS)], go)
    failed = [(r.args[1], r.stderr[-2000:]) for r in results if r.returncode != 0]
    assert not failed, failed
    for r in results:
        assert "database is locked" not in r.stderr and "Traceback" not in r.stderr, r.stderr

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([experiment_id], max_results=100)
    assert sorted(r.info.run_name for r in runs) == sorted(
        f"train/m/seed{job}" for job in range(JOBS)
    )
    # The runs overlapped (the second barrier): all were open at one moment, so their writes
    # competed.
    assert max(r.info.start_time for r in runs) < min(r.info.end_time for r in runs)
    for run in runs:
        assert run.info.status == "FINISHED", run.info.run_name
        seed = run.data.tags["seed"]
        own = {k: v for k, v in run.data.params.items() if not k.startswith("numerics.")}
        assert own == {"job": seed} and run.data.tags["model"] == "m"
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), run.info.run_name


@pytest.mark.slow
def test_concurrent_first_use_of_a_fresh_store_races(tmp_path: Path) -> None:
    """Why `tracking_init` exists: without it, jobs starting together on a fresh store fail.

    This documents MLflow 3.x behaviour. The race is timing-dependent, so up to three fresh stores
    are tried; if none fails, MLflow has fixed it and `tracking_init` could go.
    """
    errors = []
    for attempt in range(3):
        uri = f"sqlite:///{tmp_path / f'fresh{attempt}.db'}"
        go = tmp_path / f"go{attempt}"
        results = _together(FIRST_USE, [[uri, str(go)] for _ in range(4)], go)
        errors = [r.stderr for r in results if r.returncode != 0]
        if errors:
            break
    assert errors, "4 concurrent first uses of a fresh store all succeeded, 3 times"
    for err in errors:
        assert MIGRATION_RACE.search(err), err[-2000:]


def _dag_edges(configfile: str, results: Path) -> tuple[dict[str, str], set[tuple[str, str]]]:
    """Snakemake's job graph for a config: node id -> rule name, and (from, to) edges."""
    env = dict(_env(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "snakemake", "--dag", "--configfile", configfile),
            *("--config", f"results_dir={results}"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    nodes = dict(re.findall(r'^\s*(\d+)\[label = "([^\\"]+)', proc.stdout, re.MULTILINE))
    edges = set(re.findall(r"^\s*(\d+) -> (\d+)", proc.stdout, re.MULTILINE))
    return nodes, edges


@pytest.mark.workflow
@pytest.mark.parametrize(
    "configfile",
    # A Snakemake process each (seconds): the unit tier plans the smoke config's DAG.
    ["config/smoke.yaml", pytest.param("config/config.yaml", marks=pytest.mark.slow)],
)
def test_every_tracked_job_waits_for_tracking_init(tmp_path: Path, configfile: str) -> None:
    import networkx as nx

    nodes, edges = _dag_edges(configfile, tmp_path / "results")
    graph = nx.DiGraph(list(edges))
    graph.add_nodes_from(nodes)
    (init,) = [n for n, rule in nodes.items() if rule == "tracking_init"]
    # Rules that open no MLflow run (the target rule) need not wait.
    untracked = {"all", "tracking_init"}
    late = [
        rule
        for n, rule in nodes.items()
        if rule not in untracked and not nx.has_path(graph, init, n)
    ]
    assert not late, f"jobs that may touch the store before tracking_init: {sorted(set(late))}"
    assert len(nodes) > 10


# --- one invocation per results folder (docs/records/reliability.md, section 11) -----------------

# An invocation holding a results folder: the lock the workflow takes at parse time, then it waits.
HOLDER = """
import sys, time
from rpb.pipeline.results_folder import hold_results_lock
target = sys.argv[2]
hold_results_lock(sys.argv[1], command=["snakemake", "--cores", "2", target], targets=[target])
print("held", flush=True)
time.sleep(600)
"""


def _holder(results: Path, target: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(results), target], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_the_results_lock_names_its_holder_and_dies_with_it(tmp_path: Path) -> None:
    from rpb.pipeline.results_folder import ResultsBusy, hold_results_lock, release_results_lock

    results = tmp_path / "results"
    holder = _holder(results, f"{results}/table1.csv")
    try:
        for hold in (True, False):  # a run, and a dry run that only checks
            with pytest.raises(ResultsBusy) as busy:
                hold_results_lock(results, command=["snakemake", "-n"], hold=hold)
            message = str(busy.value)
            assert message.startswith(
                f"results folder {results} is in use by another invocation (pid {holder.pid} on "
            )
            assert f", target {results}/table1.csv: snakemake --cores 2 " in message
            assert re.search(r", started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", message)
            assert "\n" not in message
    finally:
        holder.kill()  # SIGKILL: the holder crashed without releasing anything
        holder.wait()
    assert hold_results_lock(results, command=["snakemake"]) == results / ".invocation.lock"
    release_results_lock(results)
    assert (results / ".invocation.lock").read_text() == ""  # released: names nobody


def test_a_dry_run_on_a_fresh_folder_creates_no_lock(tmp_path: Path) -> None:
    from rpb.pipeline.results_folder import hold_results_lock

    assert hold_results_lock(tmp_path / "results", command=["snakemake", "-n"], hold=False) is None
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_a_second_invocation_on_any_target_is_refused_in_one_line(tmp_path: Path) -> None:
    """Before: on the same target Snakemake's IncompleteFilesException and advice to use
    --rerun-incomplete (wrong here); on another target it ran beside the first, sharing its
    invocation record. Now both are refused, before any DAG is built, naming the first."""
    results = tmp_path / "results"
    holder = _holder(results, f"{results}/table1.csv")
    env = dict(_env(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def snakemake(*args: str, target: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "snakemake", *args, "--configfile", "config/smoke.yaml"]
        command += ["--config", f"results_dir={results}", "--", target]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)

    try:
        refused = [
            snakemake("-n", target=f"{results}/testbed.md"),
            snakemake("--cores", "1", target=f"{results}/.mlflow_ready"),
        ]
    finally:
        holder.kill()
        holder.wait()
    for proc in refused:
        assert proc.returncode == 1, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith(
            f"busy: results folder {results} is in use by another invocation (pid {holder.pid} "
        )
        assert f"target {results}/table1.csv" in lines[-1]
        assert "Exception" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (results / ".mlflow_ready").exists() and not (results / "mlflow.db").exists()
    # The holder is gone (killed, as a crash): the folder is free again.
    after = snakemake("-n", target=f"{results}/testbed.md")
    assert after.returncode == 0, after.stderr[-2000:]


def _snakemake_state(workdir: Path, locks: dict[str, list[str]], incomplete: list[str]) -> None:
    """`.snakemake/` as Snakemake's file backend leaves it when SIGKILLed: its lock files (one
    path a line) and incomplete marks, named by Snakemake's own encoding (`_record_path`)."""
    from types import SimpleNamespace

    from snakemake.persistence.file import FilePersistence

    (workdir / ".snakemake" / "locks").mkdir(parents=True)
    for name, paths in locks.items():
        (workdir / ".snakemake" / "locks" / name).write_text("".join(f"{p}\n" for p in paths))
    marks = workdir / ".snakemake" / "incomplete"
    encoder = SimpleNamespace(_fetch_max_len=lambda subject: 255)
    for path in incomplete:
        mark = Path(FilePersistence._record_path(encoder, str(marks), path))
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text('{"external_jobid": null}')


def test_a_killed_invocations_snakemake_lock_is_cleared_with_one_line(tmp_path: Path) -> None:
    """Issue 47 (item 5). After SIGKILL of Snakemake, the advised `--rerun-incomplete` met
    `LockException` until `--unlock` (which clears every invocation's locks in the working
    directory). Now the next invocation, holding the results lock (so no live invocation uses the
    folder), deletes the dead one's lock files, those naming files of its results folder only,
    and says in one line the command that recovers; with `--rerun-incomplete` it goes on."""
    from rpb.pipeline.results_folder import (
        hold_results_lock,
        parse_invocation,
        recover_after_kill,
        release_results_lock,
    )

    workdir = tmp_path / "work"
    results = workdir / "results" / "smoke"
    other = workdir / "results" / "other"  # a live invocation's, on another folder
    deep = f"{results}/eval/" + "/".join(["d" * 60] * 4) + ".json"  # a mark in '@' folders
    _snakemake_state(
        workdir,
        {
            "0.input.lock": [f"{results}/data/math.jsonl", "config/config.yaml"],
            "0.output.lock": [f"{results}/table1.csv", f"{results}/.mlflow_ready"],
            "1.input.lock": [f"{results}/data/math.jsonl"],  # the live one reads ours
            "1.output.lock": [f"{other}/table1.csv"],
        },
        [f"{results}/runs/m/rpb/model", deep, f"{other}/runs/x"],
    )
    for path in (deep, f"{results}/runs/m/rpb/model", f"{other}/runs/x"):  # as left, partly
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("")
    argv = ["--cores", "2", "--configfile", "config/smoke.yaml", "--", f"{results}/table1.csv"]
    hold_results_lock(results, command=["snakemake", *argv])
    line, stop = recover_after_kill(results, parse_invocation(argv), workdir)
    locks = workdir / ".snakemake" / "locks"
    assert stop and line == (
        f"recover: an invocation on {results} was killed; its Snakemake lock ({locks}/0.input.lock,"
        f" {locks}/0.output.lock) is removed, and its jobs left {deep} (+1 more) incomplete; "
        f"rerun them with: snakemake --cores 2 --configfile config/smoke.yaml --rerun-incomplete"
        f" -- {results}/table1.csv"
    )
    assert sorted(p.name for p in locks.iterdir()) == ["1.input.lock", "1.output.lock"]
    # The command it gives: the lock is gone, so nothing is left to say and Snakemake goes on.
    rerun = parse_invocation([*argv[:-2], "--rerun-incomplete", *argv[-2:]])
    assert recover_after_kill(results, rerun, workdir) == (None, False)
    # Run as Snakemake advises at once: the lock is cleared, one line, and it goes on.
    (locks / "0.output.lock").write_text(f"{results}/table1.csv\n")
    assert recover_after_kill(results, rerun, workdir) == (
        f"rpb: removed the Snakemake lock of a killed invocation on {results} "
        f"({locks}/0.output.lock)",
        False,
    )
    release_results_lock(results)


def test_what_jobs_of_a_killed_snakemake_finish_after_the_kill_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 59, item 2 (the second half): jobs of an invocation whose Snakemake alone was
    SIGKILLed run on and finish unseen, so Snakemake never unmarks their outputs and the next
    invocation reran them. A pipeline job that succeeds now leaves a note (what it wrote whole,
    its command); the next invocation unmarks exactly those outputs and keeps them, says so, and
    still asks `--rerun-incomplete` for a job that did not finish. The notes go once read."""
    from rpb import artifacts
    from rpb.pipeline import cli
    from rpb.pipeline.results_folder import (
        FINISHED_DIR,
        RESULTS_ENV,
        hold_results_lock,
        incomplete_outputs,
        parse_invocation,
        record_finished_job,
        recover_after_kill,
        release_results_lock,
    )

    workdir = tmp_path / "work"
    results = workdir / "results"
    done_json, work = results / "eval" / "a.json", results / "eval" / "a.work"
    cut = results / "eval" / "b.json"  # its job was killed: written by other code, no note
    _snakemake_state(
        workdir,
        {"0.input.lock": [], "0.output.lock": [f"{results}/table1.csv"]},
        [str(done_json), str(work), str(cut)],
    )
    monkeypatch.setenv(RESULTS_ENV, str(results))
    monkeypatch.setattr(sys, "argv", ["rpb"])
    # A finished job writes through rpb.artifacts (recorded), and the `rpb` command notes it as
    # it ends (a real job: init-tracking on a store of its own); lm-eval fills another job's
    # --work folder, which its command names.
    artifacts.write_text(done_json, "{}")
    job = ["pipeline", "init-tracking", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]
    assert cli.main([*job, "--experiment", "e"]) == 0
    (note,) = (results / FINISHED_DIR).iterdir()
    assert json.loads(note.read_text())["command"] == ["rpb", *job, "--experiment", "e"]
    assert str(done_json) in json.loads(note.read_text())["written"]
    work.mkdir()
    record_finished_job(results, ["rpb", "pipeline", "eval", "--work", str(work)])
    cut.write_text("{")
    argv = ["--cores", "2", "--", f"{results}/table1.csv"]
    hold_results_lock(results, command=["snakemake", *argv])
    try:
        line, stop = recover_after_kill(results, parse_invocation(argv), workdir)
    finally:
        release_results_lock(results)
    assert (
        stop and f"removed, {done_json} (+1 more), finished by its jobs after the kill, is " in line
    )
    assert line.endswith(
        f"and its jobs left {cut} incomplete; rerun them with: snakemake --cores 2 "
        f"--rerun-incomplete -- {results}/table1.csv"
    )
    assert incomplete_outputs(results, workdir) == [str(cut)]  # the others are Snakemake's done
    assert not (results / FINISHED_DIR).exists()
