"""The paper-scale code path on CPU: config/paper.yaml, tiny random models with the paper models'
routing (only sizes differ), prior extraction, training steps per method, routing checks, standard
lm-eval tasks through an LMEvalSuite, the launcher, the profiles and the paper DAG (dry run)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from smoke_pipeline import snakemake_in_repo
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from rpb.architectures import build_config, random_model
from rpb.eval_routing import load_model
from rpb.method_config import MethodConfig
from rpb.methods import METHODS
from rpb.pipeline.analysis import extract_prior_from_corpus
from rpb.pipeline.evaluation import (
    SUITE_FILE,
    LMEvalSuite,
    TaskSetting,
    evaluate_model,
    run_lm_eval,
)
from rpb.pipeline.training import TrainSpec, posttrain
from rpb.prior import RouterPrior
from rpb.routing import find_routers

ROOT = Path(__file__).resolve().parents[1]
PAPER = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
BIN = Path(sys.executable).parent

# Keys of models.*.architecture that only set sizes; everything else is routing and is kept as is.
SIZE_KEYS = {
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vocab_size",
    "max_position_embeddings",
}
# The routing facts (docs/design.md section 4) the tiny stand-ins share with the real models.
ROUTING = {
    "moonlight": {
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.446,
    },
    "qwen3": {"num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True},
}
TINY_SIZES: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "num_hidden_layers": 3,  # layer 0 dense + 2 MoE layers
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "max_position_embeddings": 128,
    },
    "qwen3_moe": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,  # twice hidden_size / heads, as Qwen3-30B-A3B's 128 vs 2048 / 32
        "max_position_embeddings": 128,
    },
}
# Rows in the datasets' own field names, rendered through the paper's templates.
ROWS = {
    "math": [
        {"query": f"What is {a} plus {b}?", "response": f"{a}+{b}={a + b}. The answer is: {a + b}"}
        for a, b in [(3, 4), (12, 30), (7, 8), (21, 5), (9, 9), (40, 2), (6, 13), (1, 99)]
    ],
}


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: any text encodes, 258 ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<eos>": 1} | {c: i + 2 for i, c in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", padding_side="left"
    )


def _paper_shaped(name: str) -> tuple[str, dict[str, Any]]:
    entry = PAPER["models"][name]
    routing = {k: v for k, v in entry["architecture"].items() if k not in SIZE_KEYS}
    return entry["model_type"], {**routing, **TINY_SIZES[entry["model_type"]]}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def paper_models(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per paper model: a saved tiny base with its routing, the math corpus, and its prior."""
    root = tmp_path_factory.mktemp("paper")
    tok = _byte_tokenizer()
    spec = PAPER["data"]["corpora"]["math"]
    corpus = _write_jsonl(
        root / "math.jsonl",
        [
            {"prompt": spec["prompt"].format(**r), "completion": spec["completion"].format(**r)}
            for r in ROWS["math"]
        ],
    )
    out = {}
    for name in PAPER["models"]:
        model_type, overrides = _paper_shaped(name)
        model = random_model(
            model_type,
            seed=0,
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=None,
            **overrides,
        )
        base = root / name / "base" / "model"
        model.save_pretrained(base)
        tok.save_pretrained(base)
        prior = root / name / "prior.safetensors"
        extract_prior_from_corpus(base, corpus, prior, model_id=name, batch_size=4)
        out[name] = {"base": base, "prior": prior, "corpus": corpus, "root": root / name}
    return out


def test_paper_config_pins_and_routing():
    hexsha = re.compile(r"[0-9a-f]{40}")
    for name, entry in PAPER["models"].items():
        assert entry["source"] == "hub" and hexsha.fullmatch(entry["revision"]), name
        # Every architecture key is classified: a new key must be a size or a routing fact.
        routing = {k: v for k, v in entry["architecture"].items() if k not in SIZE_KEYS}
        assert routing == ROUTING[name], name
    # Remote code for Moonlight's tokenizer only.
    assert {n: e["trust_remote_code"] for n, e in PAPER["models"].items()} == {
        "moonlight": True,
        "qwen3": False,
    }
    for name, spec in PAPER["data"]["corpora"].items():
        assert hexsha.fullmatch(spec["revision"]), name
    lm = PAPER["evaluation"]["lm_eval"]
    suite = LMEvalSuite.from_dict(lm)  # the suite the pipeline writes must be valid
    names = PAPER["evaluation"]["in_domain"] + PAPER["evaluation"]["ood"]
    assert sorted(suite.tasks) == sorted(names)
    assert PAPER["table1"]["corpus"] in PAPER["data"]["corpora"]


def test_every_assumption_is_documented():
    """Each `# ASSUMPTION` line's key appears in docs/paper_scale.md."""
    doc = (ROOT / "docs" / "paper_scale.md").read_text()
    lines = (ROOT / "config" / "paper.yaml").read_text().splitlines()
    keys = [
        line.split(":")[0].strip()
        for line in lines
        if "# ASSUMPTION" in line and ":" in line.split("#")[0]
    ]
    assert len(keys) >= 10
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert not missing, f"ASSUMPTION keys not in docs/paper_scale.md: {missing}"


def test_paper_shaped_models_route_like_the_paper_models(paper_models):
    expect = {
        "moonlight": ("deepseek_v3", 64, 6, [1, 2]),  # first layer dense
        "qwen3": ("softmax", 128, 8, [0, 1]),
    }
    for name, (kind, n_experts, top_k, layers) in expect.items():
        model = AutoModelForCausalLM.from_pretrained(paper_models[name]["base"])
        handles = find_routers(model)
        assert {(h.kind, h.num_experts, h.top_k) for h in handles} == {(kind, n_experts, top_k)}
        assert [h.decoder_layer for h in handles] == layers
        prior = RouterPrior.load(paper_models[name]["prior"])
        assert (prior.num_experts, prior.top_k, prior.num_layers) == (n_experts, top_k, 2)
        assert (prior.correction_bias is not None) == (kind == "deepseek_v3")
        # Every token selects top_k distinct experts: usage sums to k x tokens.
        assert int(prior.usage[0].sum()) == top_k * prior.n_tokens
    moon = AutoModelForCausalLM.from_pretrained(paper_models["moonlight"]["base"])
    assert moon.config.n_shared_experts == 2 and moon.config.routed_scaling_factor == 2.446
    qwen = AutoModelForCausalLM.from_pretrained(paper_models["qwen3"]["base"])
    assert qwen.model.layers[0].self_attn.head_dim == 32


def test_paper_architectures_build_full_size_configs():
    """Every key of models.*.architecture is accepted by build_config and lands in the config
    (e.g. Qwen3's head_dim 128, which its config class does not declare)."""
    for name, entry in PAPER["models"].items():
        config = build_config(entry["model_type"], **entry["architecture"])
        for key, value in entry["architecture"].items():
            assert getattr(config, key) == value, (name, key)


# The unit tier trains one method per paper model (a zero and a positive router term); every
# other method x model pair is a slow test (about a second each).
FAST_TRAINING = {("qwen3", "rpb"), ("moonlight", "anchor_kl")}


@pytest.mark.parametrize(
    ("name", "method"),
    [
        pytest.param(
            name,
            method,
            marks=[] if (name, method) in FAST_TRAINING else [pytest.mark.slow],
            id=f"{name}-{method}",
        )
        for name in ROUTING
        for method in METHODS
    ],
)
def test_two_training_steps_per_method(paper_models, name, method):
    paths = paper_models[name]
    raw = dict(PAPER["posttrain"], steps=2, batch_size=4, max_length=64, log_every=1, save_every=0)
    raw.pop("lr_by_base")  # the planner's (Plan.posttrain_spec), not a training setting
    spec = TrainSpec.from_dict(raw)
    assert spec.bf16 and spec.gradient_checkpointing  # the paper settings run here too
    base = AutoModelForCausalLM.from_pretrained(paths["base"])
    n_layers = len(find_routers(base))
    entry = PAPER["methods"].get(method, {})
    out = paths["root"] / "runs" / method
    summary = posttrain(
        base_dir=paths["base"],
        prior_path=paths["prior"],
        corpus=paths["corpus"],
        method=MethodConfig.from_entry(method, entry),
        spec=spec,
        out_dir=out,
    )
    last = summary["final"]
    assert math.isfinite(last["task_loss"]), method
    # Terms that are zero at the base are positive after one update; the others are zero.
    if method in ("lbl", "anchor_weight", "anchor_logit", "anchor_kl"):
        assert last["router_loss"] > 0, method
    else:
        assert last["router_loss"] == 0, method
    for layer in range(n_layers):
        assert 0.5 <= last[f"layer{layer}/topk_overlap_with_base"] <= 1.0, (method, layer)
        assert last[f"layer{layer}/kl_to_base"] >= 0, (method, layer)
    trained = load_model(out / "model", steer=False)  # a steered folder for rpb, hard
    moved = [
        not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters(), strict=True)
    ]
    assert any(moved), f"{method}: training changed no weight"


@pytest.fixture(scope="module")
def std_tasks(tmp_path_factory) -> Path:
    """Local stand-ins for standard tasks: two multiple-choice tasks in a size-weighted group,
    and a generation task with two filters (like gsm8k's strict/flexible)."""
    d = tmp_path_factory.mktemp("std")
    qa = [
        {"q": f"{a} plus {b} is", "choices": [str(a + b), str(a + b + 1)], "gold": 0}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2), (8, 1)]
    ]
    _write_jsonl(d / "mc_a.jsonl", qa[:4])
    _write_jsonl(d / "mc_b.jsonl", qa[4:])
    _write_jsonl(d / "gen.jsonl", [{"q": r["q"], "a": r["choices"][0]} for r in qa])
    for task, data in (("std_mc_a", "mc_a"), ("std_mc_b", "mc_b")):
        cfg = {
            "task": task,
            "dataset_path": "json",
            "dataset_kwargs": {
                "data_files": {"test": str(d / f"{data}.jsonl"), "train": str(d / f"{data}.jsonl")}
            },
            "test_split": "test",
            "fewshot_split": "train",
            "output_type": "multiple_choice",
            "doc_to_text": "{{q}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{gold}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1},
        }
        (d / f"{task}.yaml").write_text(yaml.safe_dump(cfg))
    group = {
        "group": "std_group",
        "task": ["std_mc_a", "std_mc_b"],
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": True}],
        "metadata": {"version": 1},
    }
    (d / "std_group.yaml").write_text(yaml.safe_dump(group))
    gen = {
        "task": "std_gen",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(d / "gen.jsonl")}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{q}}",
        "doc_to_target": "{{a}}",
        "generation_kwargs": {"until": ["<eos>"], "do_sample": False, "max_gen_toks": 3},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "filter_list": [
            {
                "name": "strict",
                "filter": [
                    {"function": "regex", "regex_pattern": "^(\\d+)$"},
                    {"function": "take_first"},
                ],
            },
            {"name": "loose", "filter": [{"function": "take_first"}]},
        ],
        "metadata": {"version": 1},
    }
    (d / "std_gen.yaml").write_text(yaml.safe_dump(gen))
    return d


def test_standard_tasks_group_fewshot_and_filter(paper_models, std_tasks):
    suite = LMEvalSuite(
        tasks={
            "std_group": TaskSetting(num_fewshot=2, metric="acc,none"),
            "std_gen": TaskSetting(num_fewshot=1, metric="exact_match,loose"),
        },
        dtype="float32",
    )
    res = run_lm_eval(
        paper_models["qwen3"]["base"],
        std_tasks,
        ["std_group", "std_gen"],
        batch_size=4,
        suite=suite,
        include_defaults=False,
    )
    group, gen = res["tasks"]["std_group"], res["tasks"]["std_gen"]
    assert group["n"] == 6 and sorted(group["leaves"]) == ["std_mc_a", "std_mc_b"]
    assert set(group["items"]) <= {0.0, 1.0}
    # Micro average over all leaf items == lm-eval's own size-weighted group aggregate.
    assert group["score"] == pytest.approx(group["lm_eval_score"])
    assert gen["filter"] == "loose" and gen["score"] == pytest.approx(gen["lm_eval_score"])
    configs = res["lm_eval"]["configs"]
    assert configs["std_mc_a"]["num_fewshot"] == 2 and configs["std_mc_b"]["num_fewshot"] == 2
    assert configs["std_gen"]["num_fewshot"] == 1
    bad = LMEvalSuite(tasks={"std_gen": TaskSetting(0, "exact_match,flexible-extract")})
    with pytest.raises(ValueError, match=r"no filter 'flexible-extract' .*loose, strict"):
        run_lm_eval(
            paper_models["qwen3"]["base"],
            std_tasks,
            ["std_gen"],
            batch_size=4,
            suite=bad,
            dtype="float32",
            include_defaults=False,
        )


def test_evaluate_model_needs_a_suite_entry_for_benchmarks(paper_models, tmp_path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    args = (paper_models["qwen3"]["base"], eval_dir, ["gsm8k"], tmp_path / "o.json", tmp_path / "w")
    with pytest.raises(FileNotFoundError, match=r"no eval set .*gsm8k.*lm_eval_suite\.json"):
        evaluate_model(*args)
    LMEvalSuite(tasks={"mmlu": TaskSetting(5, "acc,none")}).save(eval_dir / SUITE_FILE)
    with pytest.raises(ValueError, match=r"\['gsm8k'\] are neither eval sets"):
        evaluate_model(*args)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"tasks": {}}, "tasks: must be a non-empty"),
        ({"tasks": {"gsm8k": {"num_fewshot": 5}}}, "gsm8k: needs exactly"),
        ({"tasks": {"gsm8k": {"num_fewshot": -1, "metric": "acc,none"}}}, "num_fewshot"),
        ({"tasks": {"gsm8k": {"num_fewshot": 5, "metric": "acc"}}}, "<metric>,<filter>"),
        ({"tasks": {"x": {"num_fewshot": 0, "metric": "a,b"}}, "backend": "tgi"}, "backend"),
        ({"tasks": {"x": {"num_fewshot": 0, "metric": "a,b"}}, "shots": 1}, "unknown key"),
    ],
)
def test_suite_rejects_bad_settings(raw, match):
    with pytest.raises(ValueError, match=match):
        LMEvalSuite.from_dict(raw)


def _hub_script():
    path = ROOT / "workflow" / "scripts" / "hub_download.py"
    spec = importlib.util.spec_from_file_location("hub_download", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_download_corpus_renders_disjoint_train_and_probe(tmp_path):
    hub = _hub_script()
    src = tmp_path / "src"
    src.mkdir()
    rows = [{"query": f"q{i}?", "response": f"a{i}", "type": "x"} for i in range(30)]
    _write_jsonl(src / "train.jsonl", rows)
    spec = dict(PAPER["data"]["corpora"]["math"], hf_id=str(src), train_examples=20)
    spec["probe_examples"] = 6
    out = {k: tmp_path / f"{k}.jsonl" for k in ("train", "probe", "manifest")}
    hub.fetch_corpus(
        "math", spec, 1234, out["train"], out["probe"], out["manifest"], str(tmp_path / "log")
    )
    train = [json.loads(x) for x in out["train"].read_text().splitlines()]
    probe = [json.loads(x) for x in out["probe"].read_text().splitlines()]
    assert (len(train), len(probe)) == (20, 6)
    assert set(train[0]) == {"prompt", "completion"} and set(probe[0]) == {"prompt", "target"}
    assert train[0]["prompt"].startswith("Question: q") and train[0]["prompt"].endswith("Answer:")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in probe}
    # Seeded shuffle: not the source order, and the same on a rerun.
    assert [r["prompt"] for r in probe] != [f"Question: q{i}?\nAnswer:" for i in range(6)]
    bad = dict(spec, prompt="Question: {question}\nAnswer:")
    with pytest.raises(ValueError, match=r"field 'question' is not a column .*query"):
        hub.fetch_corpus("math", bad, 0, *out.values(), str(tmp_path / "log"))


def test_downloaded_model_is_checked_and_made_offline_safe(paper_models, tmp_path):
    hub = _hub_script()
    stage = tmp_path / "stage"
    shutil.copytree(paper_models["qwen3"]["base"], stage)
    cfg = json.loads((stage / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (stage / "config.json").write_text(json.dumps(cfg))
    tc = json.loads((stage / "tokenizer_config.json").read_text())
    tc.pop("pad_token", None)
    (stage / "tokenizer_config.json").write_text(json.dumps(tc))
    entry = {
        "hf_id": "Qwen/x",
        "revision": "0" * 40,
        "model_type": "qwen3_moe",
        "architecture": {"num_experts": 128, "num_experts_per_tok": 8},
    }
    manifest = hub.finalize_model_dir("qwen3", entry, stage)
    assert "auto_map" not in json.loads((stage / "config.json").read_text())
    assert manifest["removed_auto_map"] and manifest["pad_token_set_to"] == "<eos>"
    assert json.loads((stage / "tokenizer_config.json").read_text())["pad_token"] == "<eos>"
    wrong = dict(entry, architecture={"num_experts": 64, "num_experts_per_tok": 8})
    with pytest.raises(ValueError, match="num_experts: expected 64, checkpoint has 128"):
        hub.finalize_model_dir("qwen3", wrong, stage)


def test_gpu_smoke_bench_runs_tiny(tmp_path):
    """bench/gpu_smoke.py --tiny: the GPU benchmark's code path, on CPU in seconds."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "bench" / "gpu_smoke.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "smoke.json"
    assert bench.main(["--tiny", "--methods", "rpb", "anchor_weight", "--out", str(out)]) == 0
    results = {r["model"]: r for r in json.loads(out.read_text())["results"]}
    assert {n: (r["experts"], r["top_k"], r["moe_layers"]) for n, r in results.items()} == {
        "moonlight": (64, 6, 2),
        "qwen3": (128, 8, 2),
    }
    for r in results.values():
        assert list(r["methods"]) == ["none", "rpb", "anchor_weight"]
        assert r["methods"]["none"]["ratio_to_none"] == 1.0
        assert all(m["step_s"] > 0 for m in r["methods"].values())


@pytest.mark.slow  # accelerate launches a fresh interpreter running rpb's CLI
def test_train_launcher_starts_rpb_cli():
    """The paper's accelerate command line (FSDP config) reaches rpb's CLI (here on 1 CPU)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = f"{PAPER['train_launcher']} pipeline train --help"
    proc = subprocess.run(
        ["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--corpus-name" in proc.stdout


@pytest.mark.workflow
def test_profiles_name_existing_rules():
    """Every rule a profile sets resources for is a rule of the workflow (`snakemake
    --list-rules`: the rules it defines, wherever and however they are written)."""
    rules = set(snakemake_in_repo("--list-rules").stdout.split())
    assert {"posttrain", "posttrain_run", "pretrain_base", "table1"} <= rules, rules
    for profile in ("slurm", "local"):
        cfg = yaml.safe_load((ROOT / "profiles" / profile / "config.yaml").read_text())
        assert set(cfg["set-resources"]) <= rules, profile
    local = yaml.safe_load((ROOT / "profiles" / "local" / "config.yaml").read_text())
    assert local["set-resources"]["posttrain"]["gpu"] >= 1
    slurm = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    assert slurm["executor"] == "slurm"
    # Training sizes itself per model (the rule's resources); the profile sets its time limit
    # alone, so no GPU count or slurm_extra of its own replaces the rule's (test_two_node_*).
    assert slurm["set-resources"]["posttrain"] == {"runtime": 1440}
    # Conda is an option (`--sdm conda`), not a requirement: a pip install runs the profile.
    assert "software-deployment-method" not in slurm and "sdm" not in slurm


def _gpu_hours():
    """bench/gpu_hours.py: the paper plan's dry run through profiles/slurm, and its GPU budget."""
    spec = importlib.util.spec_from_file_location("gpu_hours", ROOT / "bench" / "gpu_hours.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.workflow
def test_paper_scale_doc_counts_and_gpu_hours():
    """docs/paper_scale.md's job counts and GPU budget are the dry run's through profiles/slurm
    (bench/gpu_hours.py: gpu x runtime of every planned job), for table 1 and `all`."""
    gpu_hours = _gpu_hours()
    budgets = {t: gpu_hours.target_budget(t) for t in gpu_hours.TARGETS}
    doc = " ".join((ROOT / "docs" / "paper_scale.md").read_text().split())
    table1, whole = budgets["table1.csv"], budgets["all"]
    assert f"`results/table1.csv` plans {table1['jobs']} jobs" in doc
    assert f"{table1['rules']['posttrain']} trainings" in doc
    assert f"`all` plans {whole['jobs']} jobs, {whole['rules']['posttrain']} of them" in doc
    assert gpu_hours.markdown(budgets) in (ROOT / "docs" / "paper_scale.md").read_text()
    # The sum is gpu x runtime: table 1's trainings are 8 GPUs x 24 h each in the profile.
    assert table1["gpu_hours"]["posttrain"] == table1["rules"]["posttrain"] * 8 * 24


def _job_counts(stdout: str) -> dict[str, int]:
    """The `Job stats` table of a dry run (rule -> number of jobs)."""
    table = stdout.split("Job stats:", 1)[1].split("total", 1)[0]
    rows = (line.split() for line in table.splitlines())
    return {r[0]: int(r[1]) for r in rows if len(r) == 2 and r[1].isdigit()}


@pytest.mark.workflow
def test_paper_dag_dry_run():
    """The full paper DAG through the SLURM profile: downloads, then one prior, 3 methods x 3
    seeds of training and hard at 3 (check M2's runs), evaluation and analysis of each and of the
    base, table 1; no tiny rule."""
    # As docs/paper_scale.md gives it: through profiles/slurm, no conda needed (none here).
    stdout = _gpu_hours().dry_run(["table1.csv", "eval/qwen3/math2/rpb/base0/seed0.json"])
    counts = _job_counts(stdout)
    # Table 1's methods at every seed, and hard (the readings rule's upper end) at the readings'
    # seeds, which its check M2 reads.
    runs = len(PAPER["table1"]["methods"]) * len(PAPER["seeds"])
    runs += len(PAPER["tables"]["seeds"] or PAPER["seeds"])
    assert counts == {
        "download_model": 2,
        "download_corpus": 2,
        "lm_eval_suite": 1,
        "prefetch_lm_eval": 1,
        "tracking_init": 1,
        "extract_prior": 2,
        "posttrain": runs + 1,
        "evaluate": runs + 2,
        "analyze": runs + 1,
        "table1": 1,
    }


@pytest.mark.workflow
def test_two_node_training_in_the_paper_plan(monkeypatch):
    """On 40 GB GPUs Moonlight's 16 bytes per parameter (255 GB) need 11 GPUs: every training job
    of table 1 asks for 2 whole nodes, 16 GPUs, a task per GPU, the plugin's `mpi` mode and Slurm's
    USR1 warning, and its command is the per-node launcher (tests/test_cluster.py runs it and
    builds the plugin's sbatch line from these resources)."""
    monkeypatch.setenv("RPB_SLURM_GPU_MEMORY_GB", "40")
    gpu_hours = _gpu_hours()
    stdout = gpu_hours.dry_run("table1.csv")
    trainings = [res for rule, res in gpu_hours.planned_jobs(stdout) if rule == "posttrain"]
    assert len(trainings) == 12
    for resources in trainings:
        assert {k: resources.get(k) for k in ("nodes", "gpu", "tasks", "mpi", "runtime")} == {
            "nodes": "2",
            "gpu": "16",
            "tasks": "16",
            "mpi": "srun",
            "runtime": "1440",
        }
        assert resources["tasks_per_gpu"] == "0" and resources["cpus_per_task"] == "8"
        assert resources["slurm_extra"] == "--signal=USR1@600"
    # The printed shell commands (printshellcmds in the profile).
    launch = "Shell command: bash workflow/scripts/accelerate_launch.sh pipeline train "
    commands = [line for line in stdout.splitlines() if " pipeline train " in line]
    assert len(commands) == 12 and all(c.startswith(launch) for c in commands), commands[:1]
    # The other GPU jobs keep one GPU each.
    others = {
        r: res["gpu"] for r, res in gpu_hours.planned_jobs(stdout) if r in ("evaluate", "analyze")
    }
    assert set(others.values()) == {"1"}
