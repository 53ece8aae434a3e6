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
CONDA_ENV = "../../envs/rpb.yaml"
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
