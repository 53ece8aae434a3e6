# Loading and glue: the config checked and planned once (rpb.pipeline.plan), the results folder's
# lock and integrity check, and the wildcard adapters the rules call.

import json
import os
import shlex
import sys
from pathlib import Path

from rpb.artifacts import sha256_of
from rpb.numerics import KERNEL_ENV, LOCK_ENV, PIN_ENV, path_environment
from rpb.pipeline.bases import FIXED_BASES as FIXED_BASES_DIR
from rpb.pipeline.config_check import ConfigError, check_config
from rpb.pipeline.plan import CHECKPOINTS_ENV, Plan, plain
from rpb.pipeline.results_folder import (
    RESULTS_ENV,
    ResultsBusy,
    check_results,
    hold_results_lock,
    integrity_message,
    jobs_busy_message,
    live_jobs,
    parse_invocation,
    rebuild_target,
    recover_after_kill,
)
from rpb.report.registry import REPORTS, RUN_FIGURES, RUN_LABELS
from rpb.specs import CORPORA, EVAL_SETS, PATHS

# Schema, defaults, cross-key checks and the config's one parse; a bad config stops here with one
# line and no traceback (Snakemake prints sys.exit's message to stderr as is and exits 1).
try:
    PLAN = Plan(check_config(config, workflow.source_path("../schemas/config.schema.yaml")))
except ConfigError as err:
    sys.exit(f"config error: {err}")

RESULTS = PLAN.results
# One invocation per results folder, whatever its target: a second one would share the invocation
# record and the incomplete markers of the first (Snakemake's own lock covers only the outputs in
# both DAGs). Taken here, before Snakemake builds its DAG; the kernel releases it when this process
# ends, however it ends. Jobs (cluster or subprocess execution parse again) do not take it; nor
# `--lint`, which never reads the folder. Read-only invocations (dry runs, --summary, ...) only
# check that nobody holds it.
INVOCATION = parse_invocation(sys.argv[1:])
CHECKS_RESULTS = workflow.is_main_process and not INVOCATION.lint
if CHECKS_RESULTS:
    try:
        hold_results_lock(
            RESULTS,
            command=INVOCATION.command,
            targets=INVOCATION.targets,
            hold=not INVOCATION.read_only,
        )
    except ResultsBusy as err:
        sys.exit(f"busy: {err}")
    # Jobs of an invocation whose Snakemake alone was SIGKILLed run on, unseen by Snakemake:
    # rerunning them beside themselves would race on their outputs.
    LIVE_JOBS = [] if INVOCATION.read_only else live_jobs(RESULTS)
    if LIVE_JOBS:
        sys.exit(f"busy: {jobs_busy_message(RESULTS, LIVE_JOBS)}")
    # A SIGKILLed invocation's Snakemake lock: cleared, and one line on how to go on.
    if not INVOCATION.read_only:
        RECOVERY, STOP = recover_after_kill(RESULTS, INVOCATION)
        if STOP:
            sys.exit(RECOVERY)
        if RECOVERY:
            print(RECOVERY, file=sys.stderr)
# Jobs record the integrity of what they write under this folder (rpb.pipeline.results_folder).
os.environ.update({RESULTS_ENV: os.path.abspath(RESULTS)})


def declared_output(path):
    """Whether a rule of this workflow produces `path`."""
    return any(rule.is_producer(path) for rule in workflow.rules)


def check_integrity():
    """Stop the invocation in one line at a damaged artifact under RESULTS
    (rpb.pipeline.results_folder), with the command that rebuilds it. Called by the Snakefile once every rule is defined, before
    Snakemake builds its DAG: Snakemake would otherwise take a damaged file with a fresh mtime
    for an updated input and delete the finished outputs of every job downstream of it.
    """
    if not CHECKS_RESULTS:
        return
    problems = check_results(RESULTS, update=not INVOCATION.read_only)
    if problems:
        command = ["snakemake", "--cores", INVOCATION.cores, *INVOCATION.options]
        target = lambda path: rebuild_target(path, RESULTS, declared_output)
        sys.exit(integrity_message(problems, target, command, INVOCATION.targets))


# Rules declare `threads: THREADS` and pass `{threads}` to their job, never a params value: a
# change of threads_per_job changes how fast a job runs, not what it computes, so it reruns nothing.
EXECUTION = PLAN.config.execution
THREADS = EXECUTION.threads_per_job
# The CPU numeric path of every job (rpb.numerics): ATen and MKL read it from the environment
# when a process starts, so it is set here, before any job (or the job server) starts.
if EXECUTION.cpu_numerics != "free":
    for variable in KERNEL_ENV:  # a variable the path leaves unset must not leak in
        os.environ.pop(variable, None)
    os.environ.update(path_environment(EXECUTION.cpu_numerics))
else:
    os.environ.pop(PIN_ENV, None)
# Which locked environment computed the numbers: recorded with every run (rpb.numerics).
LOCK_FILE = os.path.join(workflow.basedir, "requirements", "lock.txt")
if os.path.exists(LOCK_FILE):
    os.environ.update({LOCK_ENV: sha256_of(LOCK_FILE)})
TRACKING_URI = (
    os.environ.get("MLFLOW_TRACKING_URI")
    or EXECUTION.tracking_uri
    or f"sqlite:///{os.path.abspath(RESULTS)}/mlflow.db"
)
# Jobs find the store in their environment, not on their command line: params are Snakemake's
# rerun trigger, and the store's path changes with the checkout's (or MLFLOW_TRACKING_URI), not the
# results. Cluster jobs inherit the variable (sbatch exports the environment) or re-derive it here.
os.environ.update(MLFLOW_TRACKING_URI=TRACKING_URI)
EXPERIMENT = EXECUTION.experiment
# Checkpoint settings (posttrain.save_every) reach the training jobs here, not in their params:
# they change how a killed job resumes, not what it computes, so they rerun nothing (plan.py).
os.environ.update({CHECKPOINTS_ENV: json.dumps(PLAN.checkpoint_settings)})
# Touched once by tracking_init; `ancient()` wherever it is an input, so a re-created store never
# makes the finished jobs look out of date.
TRACKING_READY = f"{RESULTS}/.mlflow_ready"
# The record of this invocation's parent MLflow run (Snakefile's onstart writes it, its jobs nest
# their runs under it, onsuccess/onerror remove it). A file under the results folder reaches jobs
# on other nodes too; the variable tells them where it is (a job's Snakemake parses this again).
TRACKING_INVOCATION = os.path.abspath(f"{RESULTS}/.mlflow_invocation.json")
os.environ.update(RPB_MLFLOW_INVOCATION=TRACKING_INVOCATION)
# Paper scale adds tiktoken (Moonlight's tokenizer) and lm-eval's math extra: envs/paper.yaml.
CONDA_ENV = (
    "../../envs/paper.yaml" if PLAN.config.scale == "paper" else "../../envs/rpb.yaml"
)
# The training command; at paper scale workflow/scripts/accelerate_launch.sh (accelerate launch
# on every node of the job).
TRAIN_LAUNCHER = EXECUTION.train_launcher


def training_job(model):
    """A paper-scale training job's size, from the model's parameter count and the cluster's GPU
    nodes (RPB_SLURM_* variables, rpb.pipeline.cluster)."""
    from rpb.pipeline.cluster import Cluster, parameter_count, training_job as size

    entry = PLAN.config.models[model].entry
    return size(
        parameter_count(entry["model_type"], entry["architecture"]), Cluster.from_env()
    )


# Rule posttrain's resources: at paper scale nodes, GPUs, tasks, CPUs and memory per model
# (rpb.pipeline.cluster.TrainingJob.slurm_resources), which the slurm profile does not override.
TRAIN_RESOURCES = {"mem_mb": 4000}
if PLAN.config.scale == "paper":
    TRAIN_RESOURCES = {
        name: (lambda wc, name=name: training_job(wc.model).slurm_resources()[name])
        for name in training_job(PLAN.config.table1.model).slurm_resources()
    }
PRETRAINED_MODELS = PLAN.pretrained_models
HUB_MODELS = PLAN.hub_models
# Every job command names its experiment; the store comes from MLFLOW_TRACKING_URI (above).
TRACK = f"--experiment {shlex.quote(EXPERIMENT)}"
# Train, evaluate and analyse a post-training run in one job (rule posttrain_run, train.smk).
ONE_PROCESS_PER_RUN = EXECUTION.one_process_per_run
# Jobs hand their command to a fork server that imported the libraries once
# (rpb.pipeline.jobserver); the value only names the server, one per results folder.
if EXECUTION.job_server:
    os.environ.update(RPB_JOB_SERVER=os.path.abspath(RESULTS))
# Where each job's run time lands (Snakemake's `benchmark:`): s, max RSS, CPU time per job.
BENCHMARKS = f"{RESULTS}/benchmarks"
EVAL_DIR = f"{RESULTS}/data/eval"
# The analysis probe set: the first PROBE_LIMIT items of each of PROBE_TASKS.
PROBE_TASKS = list(PLAN.config.probe_tasks)
PROBE_LIMIT = PLAN.config.probe_limit
EVAL_TASKS = PLAN.config.evaluation.tasks
EVAL_ONLY_SETS = EVAL_SETS["eval_only"]
# The results layout (rpb.specs.PATHS) as the rules' output patterns: a run's folder, its
# evaluation and analysis outputs without their suffix, and its log and benchmark name.
RUN_DIR = f"{RESULTS}/{os.path.dirname(PATHS['model'])}"
EVAL_OUT = f"{RESULTS}/{PATHS['eval'].removesuffix('.json')}"
ANALYSIS_OUT = f"{RESULTS}/{PATHS['analysis'].removesuffix('.json')}"
RUN_LOG = "{model}_{corpus}_{method}_base{base}_seed{seed}"
BASE_MODEL = f"{RESULTS}/{PATHS['base_model']}"
PRIOR = f"{RESULTS}/{PATHS['prior']}"
PERMUTED_PRIOR = f"{RESULTS}/{PATHS['permuted_prior']}"


wildcard_constraints:
    model="[A-Za-z0-9_]+",
    corpus="math2?",
    method="[a-z][a-z0-9_]*",
    base="[0-9]+",
    seed="[0-9]+",


def as_json(value):
    """Quote a params value for a shell command line."""
    return shlex.quote(json.dumps(plain(value), sort_keys=True))


def parent_dir(path):
    """A params function: the folder of an output (a job's run folder)."""
    return lambda wildcards, output: os.path.dirname(output[path])


# --- wildcards to the plan (rpb.pipeline.plan) ---------------------------------------------------


def trust_remote_code_flag(wildcards):
    """`--trust-remote-code` for a job on a model whose config entry allows remote code."""
    return (
        "--trust-remote-code"
        if PLAN.config.models[wildcards.model].trust_remote_code
        else ""
    )


def experts_flag(wildcards):
    """`--experts-implementation X` for a model whose config entry names one (else transformers'
    default; docs/performance.md)."""
    chosen = PLAN.config.models[wildcards.model].experts_implementation
    return f"--experts-implementation {chosen}" if chosen else ""


def run_of(wc):
    """The run (rpb.specs.Run) of a job's `{base}` and `{seed}`."""
    return PLAN.run(wc.base, wc.seed)


def evaluated_model(wc):
    return PLAN.evaluated_model(wc.model, wc.corpus, wc.method, run_of(wc))


def base_of_flags(wildcards):
    """`--family F --base-index K` of a pretrained base: the tracking schema's `model` and
    `base` (rpb.pipeline.tracking.SCHEMA_TAGS)."""
    return f"--family {wildcards.model} --base-index {wildcards.base}"


def base_name(wildcards):
    """The config entry of a job's base (`tinyA` base 1: `tinyA_base1`)."""
    return PLAN.base_model(wildcards.model, wildcards.base)


# The committed bases (rpb.pipeline.bases); jobs find the folder in their environment, so a moved
# checkout reruns nothing.
FIXED_BASES = os.path.join(workflow.basedir, FIXED_BASES_DIR)
os.environ.update(RPB_FIXED_BASES=FIXED_BASES)


def fixed_base_of(wildcards):
    """The committed base a pretraining job installs or compares with (`tinyA/base0`), or None."""
    return PLAN.fixed_base(base_name(wildcards), FIXED_BASES, any_source=True)


def fixed_base_flag(wildcards):
    """`--fixed-base NAME` (bases: fixed), `--compare-base NAME` (bases: pretrain) or nothing."""
    name = fixed_base_of(wildcards)
    if name is None:
        return ""
    verb = "fixed-base" if PLAN.config.bases == "fixed" else "compare-base"
    return f"--{verb} {name}"


def fixed_base_files(wildcards):
    """The committed files a job installs: a change of them reruns it."""
    name = fixed_base_of(wildcards)
    if name is None or PLAN.config.bases != "fixed":
        return []
    return sorted(str(p) for p in Path(FIXED_BASES, name).rglob("*") if p.is_file())


def run_base_dir(wc):
    return PLAN.base_model_dir(wc.model, run_of(wc))


def run_base_prior(wc):
    return PLAN.base_prior(wc.model, wc.corpus, run_of(wc))


def method_prior(wc):
    return PLAN.method_prior(wc.model, wc.corpus, wc.method, run_of(wc))


def post_corpus(wc):
    return PLAN.post_corpus(wc.model, wc.corpus)


def corpus_inputs(wildcards):
    """CORPUS_INPUTS (download.smk), and a model's own hold-out corpora where it has them."""
    own = post_corpus(wildcards)
    extra = [] if own.startswith(f"{RESULTS}/data/post/") else [own]
    return CORPUS_INPUTS + extra


def holdout_arg(holdout):
    """`rpb pipeline corpora`'s hold-out option (empty without one, so its command is unchanged)."""
    return "" if holdout is None else f" --holdout {holdout}"


def table_inputs(name):
    """The input function of table `name`'s rule."""
    return lambda wildcards: PLAN.table_inputs(name)


def table_spec_param(name):
    """The `spec` params function of table `name`'s rule."""
    return lambda wildcards: as_json(PLAN.table_spec(name))


# Report jobs whose rule tables.smk makes from their registry entry.
PLANNED_REPORTS = [job for job in REPORTS.values() if job.planned]


def report_outputs(job):
    """A report job's outputs as its rule declares them, each entry's path under RESULTS
    flagged for the Snakemake report where it has a caption (rpb.report.registry.Output).
    """
    outputs = {}
    for out in job.outputs:
        path = f"{RESULTS}/{out.path}"
        if out.patterns:
            path = directory(path)
        if out.caption is not None:
            shown = {
                "caption": f"../report/{out.caption}",
                "category": out.category or job.category,
            }
            if out.subcategory is not None:
                shown["subcategory"] = out.subcategory
            if out.patterns:  # one report item per matching file of the folder
                shown["patterns"] = list(out.patterns)
            if out.labels:
                shown["labels"] = dict(out.labels)
            path = report(path, **shown)
        outputs[out.name] = path
    return outputs


def table1_claims_option():
    """`rpb pipeline table1`'s --claims-spec: table 1's claims (C1, C2) judged from its runs open
    its caption; nothing without a claims section."""
    if PLAN.config.claims is None:
        return ""
    return f"--claims-spec {as_json(PLAN.claims_spec())}"


def report_targets():
    """Everything `all` builds beyond table 1: each configured table, the claims, the sweep."""
    # The testbed report describes the tiny bases the pipeline pretrains; none at paper scale.
    targets = [f"{RESULTS}/testbed.md"] if PLAN.config.scale != "paper" else []
    # Each configured table: the CSV of the rule named like its key (tables.smk), in the
    # order the rules are defined.
    targets += [
        str(r.output.csv) for r in workflow.rules if r.name in PLAN.config.tables
    ]
    if PLAN.config.claims is not None:
        targets.append(f"{RESULTS}/claims.csv")
    if PLAN.config.sweep is not None:
        targets.append(f"{RESULTS}/sweep.csv")
    # What the report shows of them (HTML pages, every run's figures; tables.smk).
    targets += rendered_outputs()
    return targets + PLAN.diagnostic_targets()


def rendered_outputs():
    """The report items beyond the CSVs (HTML pages, every run's figures, the claims per table)
    of the rules `all` builds (tables.smk). `all` requests them: Snakemake reruns a finished job
    only for an output something requests, so a results folder built before they existed gets
    them too.
    """
    from snakemake.io import is_flagged

    names = {"table1", *PLAN.config.tables}
    names |= {"claims"} if PLAN.config.claims is not None else set()
    names |= {"sweep"} if PLAN.config.sweep is not None else set()
    return [
        str(f)
        for r in workflow.rules
        if r.name in names
        for f in r.output
        if is_flagged(f, "report") and not str(f).endswith(".csv")
    ]


# --- diagnostics beyond the paper (rules in diagnostics.smk) ------------------------------

DIAGNOSTICS = PLAN.config.diagnostics
DIAG_ROOT = PLAN.diagnostic_root
SWAP_ROOT = PLAN.swap_root
# Diagnostic jobs name and tag their MLflow runs apart from the main tables' runs of the same
# method (`diagnostic/eval/tinyA/none/seed0`, tag rpb.group=diagnostic).
DIAGNOSTIC_TRACK = f"{TRACK} --run-group diagnostic"


def swapped_model(wc):
    return PLAN.swapped_model(wc.model, wc.corpus, wc.method, run_of(wc))


def diagnostic_model_dir(wc):
    return PLAN.diagnostic_model_dir(wc.model, wc.corpus, wc.method, run_of(wc))
