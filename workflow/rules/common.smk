# Shared helpers: config validation, paths, per-job parameters.

import json
import os
import shlex
import sys

from rpb.config_check import ConfigError, check_config

# Schema, defaults and cross-key checks; a bad config stops here with one line and no traceback
# (Snakemake prints sys.exit's message to stderr as is and exits 1).
try:
    check_config(config, workflow.source_path("../schemas/config.schema.yaml"))
except ConfigError as err:
    sys.exit(f"config error: {err}")

RESULTS = config.get("results_dir", "results")
SEEDS = config["seeds"]
THREADS = config.get("threads_per_job", 1)
TRACKING_URI = (
    os.environ.get("MLFLOW_TRACKING_URI")
    or config.get("tracking", {}).get("uri")
    or f"sqlite:///{os.path.abspath(RESULTS)}/mlflow.db"
)
EXPERIMENT = config.get("tracking", {}).get("experiment", "rpb")
TRACKING_READY = f"{RESULTS}/.mlflow_ready"
# Paper scale adds tiktoken (Moonlight's tokenizer) and lm-eval's math extra: envs/paper.yaml.
CONDA_ENV = (
    "../../envs/paper.yaml" if config["scale"] == "paper" else "../../envs/rpb.yaml"
)
# The training command; at paper scale e.g. "accelerate launch --config_file ... -m rpb.cli".
TRAIN_LAUNCHER = config.get("train_launcher", "rpb")
PRETRAINED_MODELS = [
    m for m, e in config["models"].items() if e["source"] == "pretrain"
]
HUB_MODELS = [m for m, e in config["models"].items() if e["source"] == "hub"]
# Every job command gets the store and experiment explicitly, so a job never guesses.
TRACK = f"--tracking-uri '{TRACKING_URI}' --experiment '{EXPERIMENT}'"


wildcard_constraints:
    model="[A-Za-z0-9_]+",
    corpus="math2?",
    method="[a-z][a-z0-9_]*",
    seed="[0-9]+",


def trust_remote_code_flag(wildcards):
    """`--trust-remote-code` for a job on a model whose config entry allows remote code."""
    allowed = config["models"][wildcards.model].get("trust_remote_code")
    return "--trust-remote-code" if allowed else ""


def as_json(value):
    """Quote a params value for a shell command line."""
    return shlex.quote(json.dumps(value, sort_keys=True))


def model_dir(model, method, corpus, seed):
    """The model directory for a (model, method, corpus, seed); `base` is the pretrained base."""
    if method == "base":
        return f"{RESULTS}/models/{model}/base/model"
    return f"{RESULTS}/runs/{model}/{corpus}/{method}/seed{seed}/model"


def evaluated_model(wildcards):
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
    spec = dict(config["posttrain"])
    spec.update(seed=int(seed), threads=THREADS)
    return spec


def pretrain_spec(model):
    spec = dict(config["models"][model]["pretrain"])
    spec.pop("lbl_coef")
    spec.setdefault("seed", 0)
    spec["threads"] = THREADS
    return spec


def eval_tasks():
    ev = config["evaluation"]
    return list(ev["in_domain"]) + list(ev["ood"])


def table1_inputs(wildcards):
    t1 = config["table1"]
    model, corpus = t1["model"], t1["corpus"]
    paths = [
        f"{RESULTS}/eval/{model}/{corpus}/base/seed0.json",
        f"{RESULTS}/analysis/{model}/{corpus}/base/seed0.json",
    ]
    for method in t1["methods"]:
        for seed in SEEDS:
            paths.append(f"{RESULTS}/eval/{model}/{corpus}/{method}/seed{seed}.json")
            paths.append(
                f"{RESULTS}/analysis/{model}/{corpus}/{method}/seed{seed}.json"
            )
    return paths


def testbed_inputs(wildcards):
    corpus = config["table1"]["corpus"]
    paths = []
    for model in PRETRAINED_MODELS:
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


def _report_config_error(where, problem):
    sys.exit(f"config error: {where}: {problem}")


def _check_report_config():
    """Names in tables/claims/sweep must refer to models, methods and corpora of this config."""
    corpora = list(config["data"].get("corpora") or config["evaluation"]["in_domain"])

    def model(where, name):
        if name not in config["models"]:
            _report_config_error(where, f"'{name}' is not a key of models")

    def corpus(where, name):
        if name not in corpora:
            _report_config_error(
                where, f"'{name}' is not a known corpus ({', '.join(corpora)})"
            )

    def labels(where, names):
        for name in names:
            if name not in config["methods"]:
                _report_config_error(where, f"'{name}' is not a key of methods")

    for c, tasks in (config["evaluation"].get("corpus_tasks") or {}).items():
        corpus("evaluation.corpus_tasks", c)
        for task in tasks:
            if task not in config["evaluation"]["in_domain"]:
                _report_config_error(
                    f"evaluation.corpus_tasks.{c}",
                    f"'{task}' is not in evaluation.in_domain",
                )
    for key, entry in TABLES.items():
        if key == "seeds":
            continue
        for m in entry.get("models", [entry.get("model")]):
            model(f"tables.{key}.model", m)
        for c in entry.get("corpora", [entry.get("corpus")]):
            corpus(f"tables.{key}.corpus", c)
        for field in ("methods", "correlate"):
            labels(f"tables.{key}.{field}", entry.get(field, []))
        for field in ("lower", "upper"):
            if field in entry:
                labels(f"tables.{key}.{field}", [entry[field]])
    if "table3" in TABLES and CLAIMS is None:
        _report_config_error(
            "tables.table3", "compares claims.method and claims.reference: add claims"
        )
    if CLAIMS is not None:
        needed = ("table2", "table3", "table4", "table5")
        missing = [k for k in needed if k not in TABLES]
        if missing:
            _report_config_error("claims", f"needs tables.{missing[0]}")
        for role in ("method", "reference"):
            labels(f"claims.{role}", [CLAIMS[role]])
        for where, names in (
            ("table1.methods", config["table1"]["methods"]),
            ("tables.table2.methods", TABLES["table2"]["methods"]),
        ):
            for role in ("method", "reference"):
                if CLAIMS[role] not in names:
                    _report_config_error(where, f"lacks claims.{role} '{CLAIMS[role]}'")
        if CLAIMS["method"] not in TABLES["table4"]["methods"]:
            _report_config_error("tables.table4.methods", "lacks claims.method")
        if CLAIMS["method"] not in TABLES["table5"]["methods"]:
            _report_config_error("tables.table5.methods", "lacks claims.method")
    if SWEEP is not None:
        model("sweep.model", SWEEP["model"])
        corpus("sweep.corpus", SWEEP["corpus"])
        for i, curve in enumerate(SWEEP["curves"]):
            labels(f"sweep.curves[{i}].labels", curve["labels"])


_check_report_config()


def run_outputs(model, corpus, methods, seeds, base=False):
    """Evaluation and analysis outputs of `methods` x `seeds` (and the base) on one corpus."""
    paths = []
    if base:
        paths += [
            f"{RESULTS}/eval/{model}/{corpus}/base/seed0.json",
            f"{RESULTS}/analysis/{model}/{corpus}/base/seed0.json",
        ]
    for method in methods:
        for seed in seeds:
            paths += [
                f"{RESULTS}/eval/{model}/{corpus}/{method}/seed{seed}.json",
                f"{RESULTS}/analysis/{model}/{corpus}/{method}/seed{seed}.json",
            ]
    return paths


def table_inputs(name):
    """Input function of a table rule: every run the table reads."""
    t = TABLES.get(name, {})

    def inputs(wildcards):
        if name == "table2":
            return run_outputs(t["model"], t["corpus"], t["methods"], TABLE_SEEDS, True)
        if name == "table3":
            pair = [CLAIMS["method"], CLAIMS["reference"]]
            return sum(
                (run_outputs(m, t["corpus"], pair, TABLE_SEEDS) for m in t["models"]),
                [],
            )
        if name == "table4":
            return sum(
                (
                    (
                        run_outputs(t["model"], c, t["methods"], TABLE_SEEDS, True)
                        if c == t["corpora"][0]
                        else run_outputs(t["model"], c, t["methods"], TABLE_SEEDS)
                    )
                    for c in t["corpora"]
                ),
                [],
            )
        if name == "table5":
            labels = list(dict.fromkeys(t["methods"] + t["correlate"]))
            return run_outputs(t["model"], t["corpus"], labels, TABLE_SEEDS, True)
        if name == "readings":
            labels = [t["lower"], *t["methods"], t["upper"]]
            return run_outputs(t["model"], t["corpus"], labels, TABLE_SEEDS)
        if name == "drift":
            return [
                f"{RESULTS}/runs/{t['model']}/{t['corpus']}/{m}/seed{s}/train_history.json"
                for m in t["methods"]
                for s in TABLE_SEEDS
            ]
        raise ValueError(f"no table named {name}")

    return inputs


def sweep_inputs(wildcards):
    labels = list(dict.fromkeys(l for c in SWEEP["curves"] for l in c["labels"]))
    return run_outputs(SWEEP["model"], SWEEP["corpus"], labels, SWEEP["seeds"])


def _common_spec():
    spec = {
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
    spec = _common_spec() | t | {"seeds": TABLE_SEEDS}
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
        "seeds": SWEEP["seeds"],
        "curves": {c["name"]: c["labels"] for c in SWEEP["curves"]},
        "methods": {l: method_entry(l) for l in sorted(labels)},
    }


def claims_spec():
    t1 = config["table1"]
    spec = _common_spec() | dict(CLAIMS)
    spec["table1"] = {k: t1[k] for k in ("model", "corpus", "methods")} | {
        "seeds": SEEDS
    }
    for name in ("table2", "table3", "table4", "table5"):
        spec[name] = table_spec(name)
    if "readings" in TABLES:  # manipulation check M2 applies the readings rule
        spec["readings"] = table_spec("readings")
    return spec


def report_targets():
    """Everything `all` builds beyond table 1: each configured table, the claims, the sweep."""
    # The testbed report describes the tiny bases the pipeline pretrains; none at paper scale.
    targets = [f"{RESULTS}/testbed.md"] if config["scale"] != "paper" else []
    targets += [
        f"{RESULTS}/{name}.csv"
        for name in ("table2", "table3", "table4", "table5")
        if name in TABLES
    ]
    if "drift" in TABLES:
        targets.append(f"{RESULTS}/drift.csv")
    if "readings" in TABLES:
        targets.append(f"{RESULTS}/rpb_readings.csv")
    if CLAIMS is not None:
        targets.append(f"{RESULTS}/claims.csv")
    if SWEEP is not None:
        targets.append(f"{RESULTS}/sweep.csv")
    return targets
