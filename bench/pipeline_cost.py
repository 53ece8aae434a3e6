"""What one tiny post-training run costs, stage by stage: the reference code path against this one.

A complete run is post-training + lm-eval evaluation + co-activation analysis of one (model,
corpus, method, seed). The reference is the project at `--reference` (default: the commit before
the speed work), extracted with `git archive` into a temporary folder and run as its pipeline runs
it: three processes (`rpb train`, `rpb eval`, `rpb analyze`: that commit's job names). The new
path is this checkout's `rpb pipeline run` (one process), or its three processes with
`--new-jobs three`; each tree's jobs are called as its CLI spells them (`_job_prefix`). Both read
the same inputs (corpora, a pretrained base, its prior: made once, untimed, or reused with
`--inputs`), and rounds alternate which goes first, so machine-load drift hits both alike.

Every job runs under a timer (this file's `--job` mode) that books each second of the process to
one stage, the innermost running one: `imports` (executing modules), `model load`
(from_pretrained of model and tokenizer), `training steps` (Trainer.train), `evaluation`
(lm-eval's simple_evaluate and task setup), `analysis` (routing passes and co-activation
statistics), `writes` (saving models, JSON, tensors), `tracking` (MLflow calls), `other` (the
rest: tokenisation, argument parsing, ...); `process start/exit` is the wall time outside the
Python code (interpreter start-up, shutdown). CPU seconds are the jobs' user + system time.

    python bench/pipeline_cost.py                  # default tiny run (tinyA, 200 steps), 2 rounds
    python bench/pipeline_cost.py --quick          # the smoke config's sizes, 1 round: to check
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "9c50351"
STAGES = (
    "process start/exit",
    "imports",
    "model load",
    "training steps",
    "evaluation",
    "analysis",
    "writes",
    "tracking",
    "other",
)

# --- job mode: run one `rpb` command with every second booked to a stage ----------------------

_stack: list[list[Any]] = []  # [stage, wall and CPU clock at the start of its current slice]
_booked: dict[str, float] = {}
_booked_cpu: dict[str, float] = {}


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _book(stage: str, since: tuple[float, float], now: tuple[float, float]) -> None:
    _booked[stage] = _booked.get(stage, 0.0) + now[0] - since[0]
    _booked_cpu[stage] = _booked_cpu.get(stage, 0.0) + now[1] - since[1]


def _push(stage: str) -> None:
    now = _clocks()
    if _stack:
        _book(_stack[-1][0], _stack[-1][1], now)
    _stack.append([stage, now])


def _pop() -> None:
    now = _clocks()
    stage, since = _stack.pop()
    _book(stage, since, now)
    if _stack:
        _stack[-1][1] = now


@contextlib.contextmanager
def _booking(stage: str) -> Iterator[None]:
    _push(stage)
    try:
        yield
    finally:
        _pop()


def _timed(stage: str, func: Callable) -> Callable:
    if getattr(func, "_pipeline_cost", False):
        return func

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _booking(stage):
            return func(*args, **kwargs)

    wrapper._pipeline_cost = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = func  # type: ignore[attr-defined]
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, attr, getattr(func, attr))
    return wrapper


def _patch_class_method(cls: type, name: str, stage: str) -> None:
    raw = cls.__dict__.get(name)
    if isinstance(raw, classmethod):
        setattr(cls, name, classmethod(_timed(stage, raw.__func__)))
    elif raw is not None:
        setattr(cls, name, _timed(stage, raw))


# module -> [(attribute path, stage)]: patched as soon as the module has been executed. Functions
# are patched where callers look them up (e.g. rpb.pipeline.analysis.save_file, not safetensors').
PATCHES: dict[str, list[tuple[str, str]]] = {
    "transformers.modeling_utils": [
        ("PreTrainedModel.from_pretrained", "model load"),
        ("PreTrainedModel.save_pretrained", "writes"),
    ],
    "transformers.tokenization_utils_base": [
        ("PreTrainedTokenizerBase.from_pretrained", "model load"),
        ("PreTrainedTokenizerBase.save_pretrained", "writes"),
    ],
    "transformers.trainer": [("Trainer.train", "training steps")],
    "lm_eval.evaluator": [("simple_evaluate", "evaluation")],
    "rpb.pipeline.evaluation": [
        ("write_tasks", "evaluation"),
        ("_task_manager", "evaluation"),
        ("_load_tasks", "evaluation"),
        ("save_results", "writes"),
    ],
    "rpb.pipeline.analysis": [
        ("routing_pass", "analysis"),
        ("summarize_layers", "analysis"),
        ("save_file", "writes"),
    ],
    "rpb.posttraining": [("save_eval_routing", "writes")],
    "rpb.pipeline.training": [
        ("write_json", "writes"),
        ("remove_checkpoints", "writes"),
    ],
    "rpb.pipeline.tracking": [("end_stale_runs", "tracking"), ("git_commit", "tracking")],
    "mlflow": [
        (name, "tracking")
        for name in (
            "set_tracking_uri",
            "set_experiment",
            "start_run",
            "end_run",
            "log_params",
            "log_metrics",
            "log_metric",
            "log_artifact",
            "log_artifacts",
            "set_tag",
            "get_experiment_by_name",
            "create_experiment",
            "active_run",
        )
    ],
}


def _apply_patches(module: Any) -> None:
    for path, stage in PATCHES.get(module.__name__, []):
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        if owner_name:
            _patch_class_method(owner, attr, stage)
        elif hasattr(owner, attr):
            setattr(owner, attr, _timed(stage, getattr(owner, attr)))


class _TimedLoader(importlib.abc.Loader):
    """Books a module's execution to `imports`, then patches it; everything else is the inner
    loader's."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with _booking("imports"):
            self._inner.exec_module(module)
        _apply_patches(module)


class _ImportTimer(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _TimedLoader(spec.loader)
                return spec
        return None


def run_job(out: Path, argv: list[str]) -> int:
    """`rpb <argv>` in this process, as the `rpb` command runs it (argv from sys.argv), with
    every second booked to a stage; writes `out`, also when the job ends with os._exit."""
    start = _clocks()
    written = []

    def write(code: int) -> None:
        if written:
            return
        written.append(code)
        while _stack:
            _pop()
        wall, cpu = (now - then for now, then in zip(_clocks(), start, strict=True))
        record = {"booked": _booked, "booked_cpu": _booked_cpu, "in_process": wall}
        out.write_text(json.dumps(record | {"in_process_cpu": cpu, "returncode": code}))

    real_exit = os._exit

    def timed_exit(code: int) -> None:
        write(code)
        real_exit(code)

    os._exit = timed_exit
    sys.meta_path.insert(0, _ImportTimer())
    sys.argv = ["rpb", *argv]
    _push("other")
    code = 1
    try:
        with _booking("imports"):
            from rpb.pipeline.cli import main
        code = main()
    finally:
        write(code)
    return code


RECORD_ENV = "PIPELINE_COST_RECORD"


def serve_timed(key: str) -> None:
    """rpb's job server under the stage timer: every forked job books its own seconds and
    writes them to the file its client names in PIPELINE_COST_RECORD."""
    sys.meta_path.insert(0, _ImportTimer())
    import rpb.pipeline.cli
    import rpb.pipeline.jobserver

    original = rpb.pipeline.jobserver._run_child
    real_exit = os._exit

    def timed_child(request: dict, fds: list[int], job: rpb.pipeline.jobserver.Job) -> None:
        _stack.clear()
        _booked.clear()
        _booked_cpu.clear()
        start = _clocks()  # a forked child's CPU clock starts at zero
        record = Path(request["env"][RECORD_ENV])

        def timed_exit(code: int) -> None:
            while _stack:
                _pop()
            wall, cpu = (now - then for now, then in zip(_clocks(), start, strict=True))
            booked = {"booked": _booked, "booked_cpu": _booked_cpu, "in_process": wall}
            record.write_text(json.dumps(booked | {"in_process_cpu": cpu, "returncode": code}))
            real_exit(code)

        os._exit = timed_exit
        _push("other")
        original(request, fds, job)

    rpb.pipeline.jobserver._run_child = timed_child
    rpb.pipeline.jobserver.serve(key, job=rpb.pipeline.cli.main)


# --- bench mode ---------------------------------------------------------------------------------


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def _merged_config(quick: bool) -> dict[str, Any]:
    config = _load_yaml(ROOT / "config" / "config.yaml")
    if quick:
        for key, value in _load_yaml(ROOT / "config" / "smoke.yaml").items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    return config


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(tree),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _timed_process(
    tree: Path, argv: list[str], log: Path, scratch: Path, server: str | None = None
) -> dict[str, Any]:
    """Run `rpb <argv>` from `tree` under the stage timer; its wall, CPU and stage seconds.

    With `server` (a job server's key) the process is only the client: the job runs in a fork
    of the (timed) server, which writes the job's record; the job's CPU is added to the
    client's, and the client's all counts as process start/exit."""
    booked = scratch / f"booked-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", str(booked), "--", *argv]
    env = _env(tree)
    served = booked.with_suffix(".served.json")  # the forked job's record (server mode)
    if server is not None:
        env.update({"RPB_JOB_SERVER": server, RECORD_ENV: str(served)})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log.open("a") as f:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"pipeline_cost: job failed ({' '.join(argv[:3])} ...): see {log}")
    record = json.loads((served if server is not None else booked).read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    client_cpu = cpu
    if server is not None:
        cpu += record["in_process_cpu"]
    stages = dict.fromkeys(STAGES, 0.0) | record["booked"]
    stages["process start/exit"] = wall - record["in_process"]
    stages_cpu = dict.fromkeys(STAGES, 0.0) | record["booked_cpu"]
    stages_cpu["process start/exit"] = cpu - record["in_process_cpu"]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "client_cpu_s": client_cpu,
        "stages_s": stages,
        "stages_cpu_s": stages_cpu,
    }


def _job_prefix(tree: Path) -> list[str]:
    """What comes before a job's name on `tree`'s command line: `rpb pipeline <job>` since the
    people's commands took the top level, `rpb <job>` before (the default reference commit)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rpb.pipeline.cli", "pipeline", "--help"],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
    )
    return ["pipeline"] if proc.returncode == 0 else []


def _job_args(
    config: dict[str, Any], inputs: Path, out: Path, method: str, seed: int, prefix: list[str]
) -> dict:
    """The argument lists of the three jobs of one run, as the pipeline's rules write them, each
    job's name after `prefix` (`_job_prefix`)."""
    model = config["table1"]["model"]
    corpus = config["table1"]["corpus"]
    spec = dict(config["posttrain"], seed=seed)
    entry = dict(config["methods"][method] or {})
    method_json = {
        "name": entry.get("kind", method),
        "strength": entry.get("strength"),
        "options": entry.get("options", {}),
    }
    ev = config["evaluation"]
    probe = config["analysis"]
    run_dir = out / "runs" / model / corpus / method / "base0" / f"seed{seed}"
    eval_out = out / "eval" / model / corpus / method / "base0" / f"seed{seed}.json"
    base = inputs / "models" / model / "base0" / "model"
    prior = inputs / "priors" / model / "base0" / f"{corpus}.safetensors"
    track = ["--tracking-uri", f"sqlite:///{out / 'mlflow.db'}", "--experiment", "rpb"]
    train = [
        *("--name", model, "--label", method, "--base", str(base), "--prior", str(prior)),
        *("--corpus", str(inputs / "data" / "post" / f"{corpus}.jsonl"), "--corpus-name", corpus),
        *("--method", json.dumps(method_json, sort_keys=True)),
        *("--spec", json.dumps(spec, sort_keys=True), "--out", str(run_dir)),
    ]
    evaluation = [
        *("--eval-dir", str(inputs / "data" / "eval")),
        *("--tasks", ",".join(ev["in_domain"] + ev["ood"]), "--limit", str(ev.get("limit") or 0)),
        *(
            "--batch-size",
            str(ev.get("batch_size", 64)),
            "--work",
            str(eval_out.with_suffix(".work")),
        ),
    ]
    common = ["--name", model, "--label", method, "--seed", str(seed), "--corpus-name", corpus]
    analysis_out = out / "analysis" / model / corpus / method / "base0" / f"seed{seed}.json"
    probe_args = [",".join(probe["probe_tasks"]), str(probe["probe_limit"])]
    return {
        "train": [*prefix, "train", *train, *track],
        "eval": [
            *prefix, "eval", *common, "--model", str(run_dir / "model"), *evaluation,
            "--out", str(eval_out), *track,
        ],
        "analyze": [
            *prefix, "analyze", *common, "--model", str(run_dir / "model"), "--base", str(base),
            "--prior", str(prior), "--eval-dir", str(inputs / "data" / "eval"),
            "--tasks", probe_args[0], "--limit", probe_args[1], "--out", str(analysis_out), *track,
        ],
        "run": [
            *prefix, "run", *train, *evaluation, "--eval-out", str(eval_out),
            "--probe-tasks", probe_args[0], "--probe-limit", probe_args[1],
            "--analysis-out", str(analysis_out), *track,
        ],
        "outputs": [eval_out, analysis_out, run_dir / "train_history.json"],
    }  # fmt: skip


def make_inputs(config: dict[str, Any], inputs: Path, pretrain_steps: int, log: Path) -> None:
    """Corpora, tokenizer, a pretrained base and its prior for the run (with this checkout's
    `rpb pipeline` jobs)."""
    model = config["table1"]["model"]
    corpus = config["table1"]["corpus"]
    entry = config["models"][model]
    pretrain = {k: v for k, v in entry["pretrain"].items() if k != "lbl_coef"}
    pretrain["steps"] = min(pretrain["steps"], pretrain_steps)
    track = ["--tracking-uri", f"sqlite:///{inputs / 'mlflow.db'}", "--experiment", "rpb"]
    preset = config["data"]["preset"]
    jobs = [
        ["init-tracking", *track],
        ["corpora", "--out", str(inputs / "data"), "--seed", str(config["data"]["seed"]),
         "--preset", preset, *track],
        ["pretrain", "--name", model, "--model-type", entry["model_type"],
         "--architecture", json.dumps(entry["architecture"]), "--spec", json.dumps(pretrain),
         "--lbl-coef", str(entry["pretrain"]["lbl_coef"]),
         "--tokenizer", str(inputs / "data" / "tokenizer"),
         "--corpus", str(inputs / "data" / "pretrain.jsonl"),
         "--out", str(inputs / "models" / model / "base0"), *track],
        ["prior", "--name", model, "--model", str(inputs / "models" / model / "base0" / "model"),
         "--corpus", str(inputs / "data" / "post" / f"{corpus}.jsonl"),
         "--out", str(inputs / "priors" / model / "base0" / f"{corpus}.safetensors"), *track],
    ]  # fmt: skip
    for argv in jobs:
        with log.open("a") as f:
            subprocess.run(
                [sys.executable, "-m", "rpb.pipeline.cli", "pipeline", *argv],
                cwd=ROOT,
                env=_env(ROOT),
                stdout=f,
                stderr=subprocess.STDOUT,
                check=True,
            )


def _reference_tree(commit: str, into: Path) -> Path:
    tree = into / f"reference-{commit}"
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _one_run(
    tree: Path,
    prefix: list[str],
    jobs: list[str],
    args: dict,
    out: Path,
    log: Path,
    scratch: Path,
    server: str | None = None,
) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # The store is created once per pipeline (rule tracking_init), not per run: untimed.
    store = [*prefix, "init-tracking", "--tracking-uri", f"sqlite:///{out / 'mlflow.db'}"]
    subprocess.run(
        [sys.executable, "-m", "rpb.pipeline.cli", *store],
        cwd=tree,
        env=_env(tree),
        check=True,
        capture_output=True,
    )
    per_job = [_timed_process(tree, args[job], log, scratch, server) for job in jobs]
    for path in args["outputs"]:
        if not Path(path).is_file():
            sys.exit(f"pipeline_cost: {path} was not written")
    return {
        "jobs": jobs,
        "wall_s": sum(j["wall_s"] for j in per_job),
        "cpu_s": sum(j["cpu_s"] for j in per_job),
        "stages_s": {s: sum(j["stages_s"][s] for j in per_job) for s in STAGES},
        "stages_cpu_s": {s: sum(j["stages_cpu_s"][s] for j in per_job) for s in STAGES},
        "per_job": dict(zip(jobs, per_job, strict=True)),
        "results": {str(Path(p).name): _result_digest(Path(p)) for p in args["outputs"][:2]},
    }


def _result_digest(path: Path) -> Any:
    """What the run computed, to compare the two paths: scores and mean co-activation metrics."""
    data = json.loads(path.read_text())
    if "tasks" in data:
        return {task: entry["score"] for task, entry in data["tasks"].items()}
    return data.get("mean")


def _summary(rounds: list[dict]) -> dict[str, Any]:
    return {
        "wall_s": statistics.median(r["wall_s"] for r in rounds),
        "cpu_s": statistics.median(r["cpu_s"] for r in rounds),
        "stages_s": {s: statistics.median(r["stages_s"][s] for r in rounds) for s in STAGES},
        "stages_cpu_s": {
            s: statistics.median(r["stages_cpu_s"][s] for r in rounds) for s in STAGES
        },
        "runs_per_cpu_minute": 60.0 / statistics.median(r["cpu_s"] for r in rounds),
    }


def _start_server(log: Path) -> tuple[str, subprocess.Popen]:
    """This checkout's job server, under the stage timer, answering on a fresh key."""
    sys.path.insert(0, str(ROOT))
    from rpb.pipeline.jobserver import _connect, address

    key = f"pipeline-cost-{os.getpid()}-{time.monotonic_ns()}"
    # It must outlive the reference's rounds (it is stopped at the end).
    env = _env(ROOT) | {"RPB_JOB_SERVER": key, "RPB_JOB_SERVER_IDLE": "36000"}
    with log.open("a") as f:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", key],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 300
    while (sock := _connect(address(key))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"pipeline_cost: the job server did not start: see {log}")
        time.sleep(0.1)
    sock.close()
    return key, proc


def _own_cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid` itself (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load_average() -> list[float] | None:
    with contextlib.suppress(OSError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", default=REFERENCE, help="git commit of the reference path")
    p.add_argument("--rounds", type=int, default=2, help="runs of each path (alternating)")
    p.add_argument("--method", default="rpb")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--new-jobs",
        choices=["server", "one", "three"],
        default="server",
        help="server: `rpb pipeline run` in a fork of the job server (the tiny config's path); "
        "one: `rpb pipeline run` in its own process; three: train, eval, analyze",
    )
    p.add_argument("--inputs", type=Path, help="reuse a folder of inputs (made here if missing)")
    p.add_argument("--pretrain-steps", type=int, default=300, help="cap for the untimed base")
    p.add_argument("--quick", action="store_true", help="the smoke config's sizes, one round")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pipeline_cost.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
    config = _merged_config(args.quick)
    work = Path(tempfile.mkdtemp(prefix="pipeline_cost-"))
    log = work / "jobs.log"
    inputs = args.inputs or work / "inputs"
    if not (inputs / "priors").is_dir():
        print(f"making inputs in {inputs} (untimed) ...", flush=True)
        make_inputs(config, inputs, args.pretrain_steps, log)
    reference = _reference_tree(args.reference, work)
    paths = {
        "reference": (reference, ["train", "eval", "analyze"]),
        "new": (ROOT, ["train", "eval", "analyze"] if args.new_jobs == "three" else ["run"]),
    }
    prefixes = {name: _job_prefix(tree) for name, (tree, _) in paths.items()}
    server = _start_server(work / "server.log") if args.new_jobs == "server" else None
    load_before = _load_average()
    rounds: dict[str, list[dict]] = {name: [] for name in paths}
    for rnd in range(args.rounds):
        order = list(paths) if rnd % 2 == 0 else list(reversed(paths))
        for name in order:
            tree, jobs = paths[name]
            out = work / name
            job_args = _job_args(config, inputs, out, args.method, args.seed, prefixes[name])
            key = server[0] if server and name == "new" else None
            result = _one_run(tree, prefixes[name], jobs, job_args, out, log, work, key)
            rounds[name].append(result)
            print(f"round {rnd} {name}: wall {result['wall_s']:.1f} s, cpu {result['cpu_s']:.1f} s")
    server_cpu = None
    if server is not None:
        # The server's own CPU (its imports, forks): paid once per pipeline invocation.
        server_cpu = _own_cpu(server[1].pid)
        server[1].terminate()
        server[1].wait()
    summary = {name: _summary(r) for name, r in rounds.items()}
    ratio = summary["new"]["runs_per_cpu_minute"] / summary["reference"]["runs_per_cpu_minute"]
    same = [r["results"] for r in rounds["reference"]] == [r["results"] for r in rounds["new"]]
    report = {
        "runs_per_cpu_minute_ratio": ratio,
        "wall_ratio": summary["reference"]["wall_s"] / summary["new"]["wall_s"],
        "same_scores": same,
        "server_cpu_s": server_cpu,
        "summary": summary,
        "rounds": rounds,
        "run": {
            "model": config["table1"]["model"],
            "corpus": config["table1"]["corpus"],
            "method": args.method,
            "seed": args.seed,
            "posttrain": config["posttrain"],
            "evaluation": config["evaluation"],
            "analysis": config["analysis"],
            "quick": args.quick,
            "base_pretrain_steps": args.pretrain_steps if not args.inputs else "reused",
            "reference": args.reference,
            "new_jobs": args.new_jobs,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": _load_average(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "omp_threads": 1,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, s in summary.items():
        stages = ", ".join(f"{k} {v:.1f}" for k, v in s["stages_cpu_s"].items())
        print(f"{name}: cpu {s['cpu_s']:.1f} s, wall {s['wall_s']:.1f} s | cpu s: {stages}")
    print(f"runs per CPU-minute, new / reference: {ratio:.2f}x (same scores: {same})")
    return report


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--job":
        sys.exit(run_job(Path(sys.argv[2]), sys.argv[4:]))
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve_timed(sys.argv[2])
        sys.exit(0)
    main()
