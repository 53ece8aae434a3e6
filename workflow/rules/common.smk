# Shared helpers: config validation, paths, per-job parameters.

import json
import os
import shlex
import sys

from rpb.artifacts import (
    RESULTS_ENV,
    ResultsBusy,
    check_results,
    hold_results_lock,
    integrity_message,
    parse_invocation,
)
from rpb.pipeline.config_check import ConfigError, check_config
from rpb.specs import CORPORA, base_of_run, bases_of, results_path, run_ids

# Schema, defaults and cross-key checks; a bad config stops here with one line and no traceback
# (Snakemake prints sys.exit's message to stderr as is and exits 1).
try:
    check_config(config, workflow.source_path("../schemas/config.schema.yaml"))
except ConfigError as err:
    sys.exit(f"config error: {err}")

RESULTS = config.get("results_dir", "results")
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
# Jobs record the integrity of what they write under this folder (rpb.artifacts).
os.environ.update({RESULTS_ENV: os.path.abspath(RESULTS)})


def rebuild_target(path):
    """The workflow output whose job rewrites the damaged `path`: `path` itself, the folder
    output it lies in (a model folder), or, for a file no rule declares (table1.meta.json), the
    declared output beside it whose name shares the longest prefix with it (table1.md).
    """

    def declared(candidate):
        return any(rule.is_producer(candidate) for rule in workflow.rules)

    candidate = path
    while candidate.startswith(RESULTS) and candidate != RESULTS:
        if declared(candidate):
            return candidate
        candidate = os.path.dirname(candidate)
    folder, name = os.path.split(path)
    siblings = [os.path.join(folder, s) for s in sorted(os.listdir(folder))]
    siblings = [s for s in siblings if s != path and declared(s)]
    if not siblings:
        return path
    shared = [len(os.path.commonprefix([os.path.basename(s), name])) for s in siblings]
    return siblings[shared.index(max(shared))]


def check_integrity():
    """Stop the invocation in one line at a damaged artifact under RESULTS (rpb.artifacts), with
    the command that rebuilds it. Called by the Snakefile once every rule is defined, before
    Snakemake builds its DAG: Snakemake would otherwise take a damaged file with a fresh mtime
    for an updated input and delete the finished outputs of every job downstream of it.
    """
    if not CHECKS_RESULTS:
        return
    problems = check_results(RESULTS, update=not INVOCATION.read_only)
    if problems:
        command = ["snakemake", "--cores", INVOCATION.cores, *INVOCATION.options]
        sys.exit(integrity_message(problems, rebuild_target, command))


SEEDS = config["seeds"]
# Rules declare `threads: THREADS` and pass `{threads}` to their job, never a params value: a
# change of threads_per_job changes how fast a job runs, not what it computes, so it reruns nothing.
THREADS = config.get("threads_per_job", 1)
TRACKING_URI = (
    os.environ.get("MLFLOW_TRACKING_URI")
    or config.get("tracking", {}).get("uri")
    or f"sqlite:///{os.path.abspath(RESULTS)}/mlflow.db"
)
# Jobs find the store in their environment, not on their command line: params are Snakemake's
# rerun trigger, and the store's path changes with the checkout's (or MLFLOW_TRACKING_URI), not the
# results. Cluster jobs inherit the variable (sbatch exports the environment) or re-derive it here.
os.environ.update(MLFLOW_TRACKING_URI=TRACKING_URI)
EXPERIMENT = config.get("tracking", {}).get("experiment", "rpb")
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
    "../../envs/paper.yaml" if config["scale"] == "paper" else "../../envs/rpb.yaml"
)
# The training command; at paper scale e.g. "accelerate launch --config_file ... -m rpb.pipeline.cli".
TRAIN_LAUNCHER = config.get("train_launcher", "rpb")
PRETRAINED_MODELS = [
    m for m, e in config["models"].items() if e["source"] == "pretrain"
]
# The models the config names (replicate bases are reached through them: `runs`).
ORIGINAL_PRETRAINED = [
    m for m in PRETRAINED_MODELS if "replicate_of" not in config["models"][m]
]
HUB_MODELS = [m for m, e in config["models"].items() if e["source"] == "hub"]
# Every job command names its experiment; the store comes from MLFLOW_TRACKING_URI (above).
TRACK = f"--experiment {shlex.quote(EXPERIMENT)}"
# Train, evaluate and analyse a post-training run in one job (rule posttrain_run, train.smk).
ONE_PROCESS_PER_RUN = config.get("one_process_per_run", False)
# Jobs hand their command to a fork server that imported the libraries once (rpb.pipeline.jobserver); the
# value only names the server, one per results folder.
if config.get("job_server", False):
    os.environ.update(RPB_JOB_SERVER=os.path.abspath(RESULTS))
# Where each job's run time lands (Snakemake's `benchmark:`): s, max RSS, CPU time per job.
BENCHMARKS = f"{RESULTS}/benchmarks"


wildcard_constraints:
    model="[A-Za-z0-9_]+",
    corpus="math2?",
    method="[a-z][a-z0-9_]*",
    seed="[0-9]+",


def trust_remote_code_flag(wildcards):
    """`--trust-remote-code` for a job on a model whose config entry allows remote code."""
    allowed = config["models"][wildcards.model].get("trust_remote_code")
    return "--trust-remote-code" if allowed else ""


def experts_flag(wildcards):
    """`--experts-implementation X` for a model whose config entry names one (else transformers'
    default; docs/performance.md)."""
    chosen = config["models"][wildcards.model].get("experts_implementation")
    return f"--experts-implementation {chosen}" if chosen else ""


def as_json(value):
    """Quote a params value for a shell command line."""
    return shlex.quote(json.dumps(value, sort_keys=True))


def model_dir(model, method, corpus, seed):
    """The model directory for a (model, method, corpus, seed); `base` is the pretrained base."""
    if method == "base":
        return f"{RESULTS}/{results_path('base_model', model=model)}"
    return f"{RESULTS}/{results_path('model', model=model, corpus=corpus, method=method, seed=seed)}"


def evaluated_model(wildcards):
    if (
        wildcards.method == "base"
    ):  # each base of a model under its run id (base_run_ids)
        return model_dir(run_base(wildcards), "base", None, None)
    return model_dir(
        wildcards.model, wildcards.method, wildcards.corpus, wildcards.seed
    )


def parent_dir(path):
    """A params function: the folder of an output (a job's run folder)."""
    return lambda wildcards, output: os.path.dirname(output[path])


def method_entry(method):
    entry = dict(config["methods"][method])
    return {
        "name": entry.get("kind", method),
        "strength": entry.get("strength"),
        "options": entry.get("options", {}),
    }


def posttrain_spec(seed):
    """The TrainSpec of a post-training job; its threads come from `--threads {threads}`."""
    spec = dict(config["posttrain"])
    spec.update(seed=int(seed))
    return spec


def pretrain_spec(model):
    spec = dict(config["models"][model]["pretrain"])
    spec.pop("lbl_coef")
    spec.setdefault("seed", 0)
    return spec


def eval_tasks():
    ev = config["evaluation"]
    return list(ev["in_domain"]) + list(ev["ood"])


EVAL_DIR = f"{RESULTS}/data/eval"
# The analysis probe set: the first PROBE_LIMIT items of each of PROBE_TASKS.
PROBE_TASKS = config.get("analysis", {}).get("probe_tasks", eval_tasks())
PROBE_LIMIT = config.get("analysis", {}).get("probe_limit", 200)


def bases(model):
    """`model` and its replicate bases (models.<model>.replicates)."""
    return bases_of(config["models"], model)


def runs(model, seeds):
    """The run ids of `seeds` on each of `model`'s bases (rpb.specs.run_ids): a table's runs are
    the (base, seed) pairs, one integer each, so its paths and statistics need nothing else.
    """
    return run_ids(len(bases(model)), seeds)


def base_run_ids(model):
    """The ids under which each base of `model` is evaluated and analysed (label `base`): seed 0
    of each base."""
    return runs(model, [0])


def base_of_flags(wildcards):
    """`--family F --base-index K` of a pretrained model (`tinyA_p1`: tinyA, base 1): the
    tracking schema's `model` and `base` (rpb.pipeline.tracking.SCHEMA_PARAMS)."""
    family = config["models"][wildcards.model].get("replicate_of", wildcards.model)
    index = bases(family).index(wildcards.model) if family in config["models"] else 0
    return f"--family {family} --base-index {index}"


def run_base(wildcards):
    """The base model (a key of `models`) a run of (model, seed) was trained from."""
    return base_of_run(config["models"], wildcards.model, int(wildcards.seed))


def run_base_dir(wildcards):
    return model_dir(run_base(wildcards), "base", None, None)


def run_base_prior(wildcards):
    return f"{RESULTS}/priors/{run_base(wildcards)}/{wildcards.corpus}.safetensors"


def table1_inputs(wildcards):
    t1 = config["table1"]
    return run_outputs(t1["model"], t1["corpus"], t1["methods"], SEEDS, base=True)


def testbed_inputs(wildcards):
    corpus = config["table1"]["corpus"]
    paths = []
    for model in ORIGINAL_PRETRAINED:
        paths += [
            f"{RESULTS}/eval/{model}/{corpus}/base/seed0.json",
            f"{RESULTS}/priors/{model}/{corpus}.safetensors",
        ]
        paths += [
            f"{RESULTS}/eval/{model}/{corpus}/none/seed{seed}.json" for seed in SEEDS
        ]
    return paths


# --- tables 2-5, the claims audit, the sweep and the drift curves (rules in tables.smk) --------

TABLES = config.get("tables") or {}
CLAIMS = config.get("claims")
SWEEP = config.get("sweep")
TABLE_SEEDS = TABLES.get("seeds") or SEEDS
# Tables whose runs are exploratory (labelled so in their outputs) may run fewer seeds than the
# confirmatory tables: their own `seeds` key (docs/claims.md, "Seeds per table").
EXPLORATORY_TABLES = ("readings", "drift")


def table_seeds(name):
    """The seeds per base of table `name`: its own `seeds` (exploratory tables only), else
    `tables.seeds`, else the top-level seeds."""
    own = TABLES.get(name, {}).get("seeds") if name in EXPLORATORY_TABLES else None
    return own or TABLE_SEEDS


def run_outputs(model, corpus, methods, seeds, base=False):
    """Evaluation and analysis outputs of `methods` x `seeds` on one corpus, on every base of
    `model` (run ids, `runs`), and with `base` each base's own."""
    paths = []
    labels = [("base", base_run_ids(model))] if base else []
    labels += [(m, runs(model, seeds)) for m in methods]
    for label, ids in labels:
        for run in ids:
            paths += [
                f"{RESULTS}/eval/{model}/{corpus}/{label}/seed{run}.json",
                f"{RESULTS}/analysis/{model}/{corpus}/{label}/seed{run}.json",
            ]
    return paths


def table_inputs(name):
    """Input function of a table rule: every run the table reads (a table of the plain shape,
    `model`, `corpus` and `methods`, reads those methods' runs)."""
    t = TABLES.get(name, {})
    seeds = table_seeds(name)

    def inputs(wildcards):
        if name == "table2":
            return run_outputs(t["model"], t["corpus"], t["methods"], seeds, True)
        if name == "table3":
            pair = [CLAIMS["method"], CLAIMS["reference"]]
            return sum(
                (run_outputs(m, t["corpus"], pair, seeds) for m in t["models"]),
                [],
            )
        if name == "table4":
            return sum(
                (
                    (
                        run_outputs(t["model"], c, t["methods"], seeds, True)
                        if c == t["corpora"][0]
                        else run_outputs(t["model"], c, t["methods"], seeds)
                    )
                    for c in t["corpora"]
                ),
                [],
            )
        if name == "table5":
            labels = list(dict.fromkeys(t["methods"] + t["correlate"]))
            return run_outputs(t["model"], t["corpus"], labels, seeds, True)
        if name == "readings":
            labels = [t["lower"], *t["methods"], t["upper"]]
            return run_outputs(t["model"], t["corpus"], labels, seeds)
        if name == "drift":
            return [
                f"{RESULTS}/runs/{t['model']}/{t['corpus']}/{m}/seed{r}/train_history.json"
                for m in t["methods"]
                for r in runs(t["model"], seeds)
            ]
        return run_outputs(t["model"], t["corpus"], t["methods"], seeds)

    return inputs


def sweep_inputs(wildcards):
    labels = list(dict.fromkeys(l for c in SWEEP["curves"] for l in c["labels"]))
    return run_outputs(SWEEP["model"], SWEEP["corpus"], labels, SWEEP["seeds"])


def _common_spec():
    spec = {
        # Every model's bases (itself and its replicates): tables pool their (base, seed) runs.
        "bases": {
            m: bases(m) for m, e in config["models"].items() if "replicate_of" not in e
        },
        "ood": config["evaluation"]["ood"],
        "corpus_tasks": config["evaluation"].get("corpus_tasks") or {},
        "scale": config["scale"],
    }
    if CLAIMS is not None:
        spec |= {k: CLAIMS[k] for k in ("confidence", "n_resamples", "power")}
    return spec


def table_spec(name):
    """The JSON spec a table job gets: the table's config entry, seeds and statistics."""
    t = dict(TABLES[name])
    models = t.get("models") or [t["model"]]
    # Runs pooled over each model's bases; config_check gives every pretrained model as many.
    spec = _common_spec() | t | {"seeds": runs(models[0], table_seeds(name))}
    if name == "table2":
        spec["family"] = config["models"][t["model"]]["family"]
    if name == "table3":
        spec |= {"method": CLAIMS["method"], "reference": CLAIMS["reference"]}
        spec["families"] = {m: config["models"][m]["family"] for m in t["models"]}
    if name == "table5":
        spec["kinds"] = {m: method_entry(m)["name"] for m in t["methods"]}
    return spec


def sweep_spec():
    labels = {l for c in SWEEP["curves"] for l in c["labels"]}
    return _common_spec() | {
        "model": SWEEP["model"],
        "corpus": SWEEP["corpus"],
        # Pooled over bases, as sweep_inputs.
        "seeds": runs(SWEEP["model"], SWEEP["seeds"]),
        "curves": {c["name"]: c["labels"] for c in SWEEP["curves"]},
        "methods": {l: method_entry(l) for l in sorted(labels)},
    }


def table1_claims_option():
    """`rpb pipeline table1`'s --claims-spec: table 1's claims (C1, C2) judged from its runs open its
    caption; nothing without a claims section."""
    return "" if CLAIMS is None else f"--claims-spec {as_json(claims_spec())}"


def claims_spec():
    t1 = config["table1"]
    spec = _common_spec() | dict(CLAIMS)
    spec["table1"] = {k: t1[k] for k in ("model", "corpus", "methods")} | {
        "seeds": runs(t1["model"], SEEDS)
    }
    for name in ("table2", "table3", "table4", "table5"):
        spec[name] = table_spec(name)
    if "readings" in TABLES:  # manipulation check M2 applies the readings rule
        spec["readings"] = table_spec("readings")
    # M0: the families whose premise the screen found not met (docs/testbed.md). The screen
    # judged the tiny testbed; the smoke scale is a plumbing run and the paper's models are others.
    calibration = config.get("calibration") or {}
    tiny = config["scale"] == "tiny"
    unmet = calibration.get("premise_not_met") or {}
    spec["premise_not_met"] = (
        {m: why for m, why in unmet.items() if why} if tiny else {}
    )
    return spec


def report_targets():
    """Everything `all` builds beyond table 1: each configured table, the claims, the sweep."""
    # The testbed report describes the tiny bases the pipeline pretrains; none at paper scale.
    targets = [f"{RESULTS}/testbed.md"] if config["scale"] != "paper" else []
    # Each configured table: the CSV of the rule named like its key (tables.smk), in the
    # order the rules are defined.
    targets += [str(r.output.csv) for r in workflow.rules if r.name in TABLES]
    if CLAIMS is not None:
        targets.append(f"{RESULTS}/claims.csv")
    if SWEEP is not None:
        targets.append(f"{RESULTS}/sweep.csv")
    # What the report shows of them (HTML pages, every run's figures; tables.smk).
    targets += rendered_outputs()
    return targets + diagnostic_targets()


def rendered_outputs():
    """The report items beyond the CSVs (HTML pages, every run's figures, the claims per table)
    of the rules `all` builds (tables.smk). `all` requests them: Snakemake reruns a finished job
    only for an output something requests, so a results folder built before they existed gets
    them too.
    """
    from snakemake.io import is_flagged

    names = {"table1", *TABLES}
    names |= {"claims"} if CLAIMS is not None else set()
    names |= {"sweep"} if SWEEP is not None else set()
    return [
        str(f)
        for r in workflow.rules
        if r.name in names
        for f in r.output
        if is_flagged(f, "report") and not str(f).endswith(".csv")
    ]


def diagnostic_targets():
    """The diagnostics (rules in diagnostics.smk) that `all` builds: at tiny and smoke scale,
    each configured one; at paper scale none (request them by name)."""
    diagnostics = config.get("diagnostics") or {}
    if config["scale"] == "paper":
        return []
    outputs = {"router_swap": "router_swap.csv", "regime": "diagnostic_table1.csv"}
    return [f"{RESULTS}/{outputs[name]}" for name in outputs if name in diagnostics]


# --- diagnostics beyond the paper (rules in diagnostics.smk) ------------------------------

DIAGNOSTICS = config.get("diagnostics") or {}
DIAG_ROOT = f"{RESULTS}/diagnostic"
# Diagnostic jobs name and tag their MLflow runs apart from the main tables' runs of the same
# method (`diagnostic/eval/tinyA/none/seed0`, tag rpb.group=diagnostic).
DIAGNOSTIC_TRACK = f"{TRACK} --run-group diagnostic"
# The router-swap tree below RESULTS (rpb.router_swap reads it from the table's spec).
SWAP_TREE = "diagnostic/router_swap"
SWAP_ROOT = f"{RESULTS}/{SWAP_TREE}"


def diagnostic_seeds(section):
    return DIAGNOSTICS[section].get("seeds") or SEEDS


def swap_sources(label):
    """(non-router weights, routers) method labels of a swapped model's label
    (`<m>_with_base_routers`, `base_with_<m>_routers`, as rpb.router_swap.swap_labels).
    """
    if label.endswith("_with_base_routers"):
        return label.removesuffix("_with_base_routers"), "base"
    return "base", label.removeprefix("base_with_").removesuffix("_routers")


def swap_inputs(wildcards):
    weights, routers = swap_sources(wildcards.label)
    return {
        "weights": model_dir(
            wildcards.model, weights, wildcards.corpus, wildcards.seed
        ),
        "routers": model_dir(
            wildcards.model, routers, wildcards.corpus, wildcards.seed
        ),
    }


def swapped_model(wildcards):
    return f"{SWAP_ROOT}/models/{wildcards.model}/{wildcards.corpus}/{wildcards.method}/seed{wildcards.seed}/model"


def router_swap_inputs(wildcards):
    swap = DIAGNOSTICS["router_swap"]
    method, corpus = swap["method"], swap["corpus"]
    labels = [f"{method}_with_base_routers", f"base_with_{method}_routers"]
    paths = []
    for model in swap["models"]:
        paths.append(f"{RESULTS}/eval/{model}/{corpus}/base/seed0.json")
        for seed in diagnostic_seeds("router_swap"):
            paths.append(f"{RESULTS}/eval/{model}/{corpus}/{method}/seed{seed}.json")
            paths += [
                f"{SWAP_ROOT}/eval/{model}/{corpus}/{label}/seed{seed}.json"
                for label in labels
            ]
    return paths


def router_swap_spec():
    swap = DIAGNOSTICS["router_swap"]
    return _common_spec() | {
        "models": swap["models"],
        "corpus": swap["corpus"],
        "method": swap["method"],
        "seeds": diagnostic_seeds("router_swap"),
        "in_domain": config["evaluation"]["in_domain"],
        "swap_tree": SWAP_TREE,
    }


def diagnostic_model_dir(wildcards):
    if wildcards.method == "base":
        return f"{RESULTS}/models/{wildcards.model}/base/model"
    return f"{DIAG_ROOT}/runs/{wildcards.model}/{wildcards.corpus}/{wildcards.method}/seed{wildcards.seed}/model"


def diagnostic_table1_inputs(wildcards):
    """The diagnostic tree's evaluation and analysis outputs, laid out as table 1's."""
    regime = DIAGNOSTICS["regime"]
    paths = run_outputs(
        regime["model"],
        regime["corpus"],
        regime["methods"],
        diagnostic_seeds("regime"),
        base=True,
    )
    return [DIAG_ROOT + path.removeprefix(RESULTS) for path in paths]


def diagnostic_spec(seed):
    return posttrain_spec(seed) | {"trainable": DIAGNOSTICS["regime"]["trainable"]}


def diagnostic_table1_spec():
    regime = DIAGNOSTICS["regime"]
    model = regime["model"]
    return {
        "title": (
            f"Diagnostic table 1 (posttrain.trainable: {regime['trainable']}; the paper's "
            "numbers are for full post-training, not this regime)"
        ),
        "model": model,
        "family": config["models"][model]["family"],
        "corpus": regime["corpus"],
        "methods": regime["methods"],
        "seeds": diagnostic_seeds("regime"),
        "in_domain": config["evaluation"]["in_domain"],
        "ood": config["evaluation"]["ood"],
        "corpus_tasks": config["evaluation"].get("corpus_tasks") or {},
        "scale": config["scale"],
    }


# --- router swap ---------------------------------------------------------------------------------


# --- controls of the claims audit (rules in controls.smk) ------------------------------------

PERMUTED_PRIOR_LABELS = [
    m for m, e in config["methods"].items() if (e or {}).get("prior") == "permuted"
]


def permuted_prior_path(model, corpus):
    return f"{RESULTS}/priors/{model}/permuted/{corpus}.safetensors"


def method_prior(wildcards):
    """The router prior a run trains with: its base's, or for a method whose entry says
    `prior: permuted` its base's with the experts permuted per layer (control P2)."""
    if wildcards.method in PERMUTED_PRIOR_LABELS:
        return permuted_prior_path(run_base(wildcards), wildcards.corpus)
    return run_base_prior(wildcards)


def controls_inputs(wildcards):
    """Runs the audit's controls compare (table 1's model and corpus, the tables' seeds)."""
    if CLAIMS is None:
        return []
    labels = [CLAIMS[k] for k in ("placebo", "permuted") if CLAIMS.get(k)]
    t1 = config["table1"]
    return run_outputs(t1["model"], t1["corpus"], labels, TABLE_SEEDS)


def claims_extra_inputs(wildcards):
    """What the audit's manipulation checks read beyond the tables: the readings rule's runs
    (M2), the testbed report's split-half stability (M6, tiny scale), and the controls.
    """
    paths = controls_inputs(wildcards)
    readings = TABLES.get("readings")
    if readings is not None and CLAIMS is not None:
        labels = [readings["lower"], CLAIMS["method"], readings["upper"]]
        paths += run_outputs(
            readings["model"], readings["corpus"], labels, table_seeds("readings")
        )
    if config["scale"] != "paper":
        paths.append(f"{RESULTS}/testbed.json")
    return paths


def model_holdout(model):
    """A model's post-training hold-out: models.<m>.holdout, else data.holdout (None: none)."""
    entry = config["models"].get(model) or {}
    return entry["holdout"] if "holdout" in entry else config["data"].get("holdout")


def post_corpus(wildcards):
    """The post-training corpus a (model, corpus) job trains on or reads its prior from."""
    holdout = model_holdout(wildcards.model)
    if HUB_CORPORA or holdout == config["data"].get("holdout"):
        return f"{RESULTS}/data/post/{wildcards.corpus}.jsonl"
    return f"{RESULTS}/data/holdout/{holdout or 'none'}/post/{wildcards.corpus}.jsonl"


def corpus_inputs(wildcards):
    """CORPUS_INPUTS (download.smk), and a model's own hold-out corpora where it has them."""
    own = post_corpus(wildcards)
    extra = [] if own.startswith(f"{RESULTS}/data/post/") else [own]
    return CORPUS_INPUTS + extra


def holdout_arg(holdout):
    """`rpb pipeline corpora`'s hold-out option (empty without one, so its command is unchanged)."""
    return "" if holdout is None else f" --holdout {holdout}"
