"""Evaluation through lm-evaluation-harness: task YAMLs for the tiny eval sets, one in-process run.

Every eval set `{eval_dir}/{name}.jsonl` (lines `{"prompt": str, "target": str}`) becomes two
lm-eval tasks, both reading the JSONL through `dataset_path: json` by absolute path:

- `rpb_{name}`: `generate_until`, greedy, stops at the eos string, `max_gen_toks` = longest target
  (in characters, an upper bound on its tokens) + 2; metric `exact_match` with no normalisation
  (no case folding, punctuation or whitespace stripping).
- `rpb_{name}_ll`: `loglikelihood` of the target and the end token given the prompt (the
  continuation is exactly `target + eos`: `target_delimiter: ""`, no inserted space); lm-eval
  metrics `perplexity` (per-document total log-likelihood, aggregated as exp(-mean)) and `acc`
  (the target and the end token are the greedy continuation under teacher forcing). This
  likelihood-based measure does not floor out at zero accuracy.

`run_lm_eval` runs all tasks in ONE `simple_evaluate` call (the model is loaded and each request
type batched once) and returns a compact dict, per task:

- generate_until: `metric="exact_match"`, `items` = per-doc 0/1 in doc order, `score` = mean;
- loglikelihood: `metric="ll_per_token"`, `items` = per-doc MEAN per-token log-likelihood of the
  target (nats), `score` = mean of `items` (so `score` is always the mean of `items`, which keeps
  paired bootstraps over items consistent with the score); `ll_sum` (per-doc total, what lm-eval
  reports), `n_tokens` (target tokens as lm-eval split them) and `greedy` (lm-eval's is_greedy)
  are given beside it, and `p_target` (per doc exp(`ll_sum`): the probability of answering
  exactly the target and stopping) with its mean `p_target_mean`, the tiny testbed's primary
  metric (bounded in [0, 1], unlike NLL, and without exact match's 0/1 floor and ceiling);
- multiple_choice (standard paper-scale tasks): `metric="acc"`, per-doc 0/1.

plus lm-eval's raw aggregate metrics, task configs and package versions for provenance.

Standard lm-eval tasks (paper scale: gsm8k, minerva_math500, mmlu, ...) are run the same way, with
the settings of an `LMEvalSuite` (written by the pipeline as `{eval_dir}/lm_eval_suite.json`):
per task its few-shot count and the one `metric,filter` that is its score, plus backend (`hf`,
`vllm`, or `auto` = vLLM where installed), dtype and extra model arguments. A group or tag (e.g.
`mmlu`) is scored over the items of all its leaf tasks (a micro average, which equals lm-eval's own
aggregate for size-weighted groups such as mmlu). `prefetch_tasks` downloads their datasets into
the Hugging Face cache once, with network, so that evaluation jobs run offline.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

EOS = "<eos>"
LL_SUFFIX = "_ll"
TASK_PREFIX = "rpb_"
# One token for the eos plus one spare, so a model that runs on past the target is still cut short.
GEN_MARGIN = 2
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*$")
# The standard-task settings file the pipeline writes beside the local eval sets.
SUITE_FILE = "lm_eval_suite.json"
BACKENDS = ("hf", "vllm", "auto")


@dataclass(frozen=True)
class TaskSetting:
    """How one standard lm-eval task (or group) is run and scored."""

    num_fewshot: int
    metric: str  # lm-eval's "<metric>,<filter>" key, e.g. "exact_match,flexible-extract"

    @property
    def metric_name(self) -> str:
        return self.metric.split(",", 1)[0]

    @property
    def filter_name(self) -> str:
        return self.metric.split(",", 1)[1]


@dataclass(frozen=True)
class LMEvalSuite:
    """Settings for standard lm-eval tasks: per-task few-shot and score, and how to run the model.

    `model_args` are passed to the lm-eval model as is (e.g. `parallelize: true` for the hf
    backend, `tensor_parallel_size: 8` for vLLM).
    """

    tasks: dict[str, TaskSetting]
    backend: str = "hf"
    dtype: str = "bfloat16"
    model_args: dict[str, Any] = field(default_factory=dict)
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    gen_kwargs: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "lm_eval suite") -> LMEvalSuite:
        """Validate a suite mapping; errors are one line naming the offending key."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: must be a mapping, got {type(raw).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown} (known: {sorted(known)})")
        tasks_raw = raw.get("tasks")
        if not isinstance(tasks_raw, Mapping) or not tasks_raw:
            raise ValueError(f"{where}.tasks: must be a non-empty mapping of task -> settings")
        tasks = {}
        for name, entry in tasks_raw.items():
            key = f"{where}.tasks.{name}"
            if not isinstance(entry, Mapping) or set(entry) != {"num_fewshot", "metric"}:
                raise ValueError(f"{key}: needs exactly num_fewshot and metric")
            shots, metric = entry["num_fewshot"], entry["metric"]
            if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
                raise ValueError(f"{key}.num_fewshot: {shots!r} is not an integer >= 0")
            if not isinstance(metric, str) or metric.count(",") != 1 or "" in metric.split(","):
                raise ValueError(f"{key}.metric: {metric!r} is not '<metric>,<filter>'")
            tasks[str(name)] = TaskSetting(shots, metric)
        backend = raw.get("backend", cls.backend)
        if backend not in BACKENDS:
            raise ValueError(f"{where}.backend: {backend!r} is not one of {list(BACKENDS)}")
        for key in ("apply_chat_template", "fewshot_as_multiturn"):
            if not isinstance(raw.get(key, False), bool):
                raise ValueError(f"{where}.{key}: must be true or false")
        for key in ("model_args", "gen_kwargs"):
            if raw.get(key) is not None and not isinstance(raw[key], Mapping):
                raise ValueError(f"{where}.{key}: must be a mapping")
        return cls(
            tasks=tasks,
            backend=backend,
            dtype=str(raw.get("dtype", cls.dtype)),
            model_args=dict(raw.get("model_args") or {}),
            apply_chat_template=raw.get("apply_chat_template", False),
            fewshot_as_multiturn=raw.get("fewshot_as_multiturn", False),
            gen_kwargs=dict(raw["gen_kwargs"]) if raw.get("gen_kwargs") else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> None:
        save_results(self.to_dict(), path)

    @classmethod
    def load(cls, path: Path) -> LMEvalSuite:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"lm-eval suite not found: {path}")
        return cls.from_dict(json.loads(path.read_text()), where=str(path))


def task_names(name: str) -> tuple[str, str]:
    """The (generate_until, loglikelihood) lm-eval task names for eval set `name`."""
    return f"{TASK_PREFIX}{name}", f"{TASK_PREFIX}{name}{LL_SUFFIX}"


def _read_eval_set(path: Path, limit: int | None) -> list[dict[str, str]]:
    """Validated `{"prompt", "target"}` items of one JSONL (first `limit` if given)."""
    if not path.is_file():
        raise FileNotFoundError(f"eval set not found: {path}")
    items: list[dict[str, str]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            for key in ("prompt", "target"):
                if not isinstance(row, dict) or not isinstance(row.get(key), str):
                    raise ValueError(f"{path}:{lineno}: missing or non-string {key!r}")
            # lm-eval cannot score a continuation without a context, nor an empty target.
            if not row["prompt"] or not row["target"]:
                raise ValueError(f"{path}:{lineno}: empty prompt or target")
            items.append({"prompt": row["prompt"], "target": row["target"]})
    if not items:
        raise ValueError(f"{path}: no items")
    return items


def _task_yaml(task: str, data_file: Path, cache_dir: Path, n_items: int) -> dict[str, Any]:
    """Fields common to both task kinds."""
    return {
        "task": task,
        "dataset_path": "json",
        # cache_dir keeps the Arrow cache out of ~/.cache/huggingface.
        "dataset_kwargs": {
            "data_files": {"test": str(data_file)},
            "cache_dir": str(cache_dir),
        },
        "test_split": "test",
        "doc_to_text": "prompt",
        "doc_to_target": "target",
        "target_delimiter": "",
        "num_fewshot": 0,
        "metadata": {"version": 1.0, "source": str(data_file), "n_items": n_items},
    }


def write_tasks(
    eval_dir: Path,
    task_dir: Path,
    names: Sequence[str],
    *,
    limit: int | None = None,
    eos: str = EOS,
    cache_dir: Path | None = None,
) -> list[str]:
    """Write `rpb_{name}` and `rpb_{name}_ll` YAMLs for each eval set; return the task names.

    With `limit`, the first `limit` items are copied to `task_dir/data/{name}.jsonl` and the tasks
    read that copy, so a task's size is fixed by its definition. The datasets cache defaults to
    `task_dir/hf_datasets_cache`.
    """
    eval_dir, task_dir = Path(eval_dir).resolve(), Path(task_dir).resolve()
    if not names:
        raise ValueError("write_tasks: no eval set names given")
    if limit is not None and limit < 1:
        raise ValueError(f"write_tasks: limit must be >= 1, got {limit}")
    cache_dir = Path(cache_dir).resolve() if cache_dir else task_dir / "hf_datasets_cache"
    task_dir.mkdir(parents=True, exist_ok=True)
    tasks: list[str] = []
    for name in names:
        if not _NAME_RE.match(name):
            raise ValueError(f"write_tasks: eval set name {name!r} must match {_NAME_RE.pattern}")
        src = eval_dir / f"{name}.jsonl"
        items = _read_eval_set(src, limit)
        data_file = src
        if limit is not None:
            data_file = task_dir / "data" / f"{name}.jsonl"
            data_file.parent.mkdir(exist_ok=True)
            data_file.write_text(
                "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), "utf-8"
            )
        gen_task, ll_task = task_names(name)
        gen = _task_yaml(gen_task, data_file, cache_dir, len(items))
        gen["output_type"] = "generate_until"
        gen["generation_kwargs"] = {
            "until": [eos],
            "do_sample": False,
            "max_gen_toks": max(len(it["target"]) for it in items) + GEN_MARGIN,
        }
        gen["metric_list"] = [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": False,
                "ignore_punctuation": False,
            }
        ]
        ll = _task_yaml(ll_task, data_file, cache_dir, len(items))
        ll["output_type"] = "loglikelihood"
        # The target then the end token: p(target) is the probability of answering exactly the
        # target and stopping, what greedy exact match asks for, without its 0/1 floor.
        ll["doc_to_target"] = "{{target}}" + eos
        ll["metric_list"] = [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ]
        for cfg in (gen, ll):
            text = yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)
            (task_dir / f"{cfg['task']}.yaml").write_text(text, "utf-8")
            tasks.append(cfg["task"])
    logger.info("wrote %d lm-eval tasks for %d eval sets to %s", len(tasks), len(names), task_dir)
    return tasks


def _set_offline() -> None:
    """Force offline hub/datasets access for this process (read by the libraries at import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"


def _task_manager(task_dir: Path | None, tasks: Sequence[str], include_defaults: bool | None):
    """A TaskManager over `task_dir`; lm-eval's ~10k built-in YAMLs are indexed only if needed."""
    from lm_eval.tasks import TaskManager

    include = str(task_dir) if task_dir is not None else None
    if include_defaults is None:
        # Indexing the built-in tasks costs seconds; skip it when task_dir defines every task.
        if include is not None:
            tm = TaskManager(include_path=include, include_defaults=False)
            if all(t in tm.all_tasks for t in tasks):
                return tm
        include_defaults = True
    tm = TaskManager(include_path=include, include_defaults=include_defaults)
    missing = [t for t in tasks if t not in tm.all_tasks]
    if missing:
        raise ValueError(f"run_lm_eval: unknown lm-eval task(s) {missing} (task_dir={task_dir})")
    return tm


def _n_cont_tokens(lm: Any, context: str, continuation: str) -> int:
    """Number of continuation tokens lm-eval scores, split exactly as its loglikelihood does."""
    if context == "":
        enc = lm.tok_encode(continuation, add_special_tokens=False)
        return len(enc) if lm.prefix_token_id != enc[0] else len(enc) - 1
    return len(lm._encode_pair(context, continuation)[1])


def _compact_task(lm: Any, task: str, config: dict[str, Any], samples: list[dict]) -> dict:
    """Per-task score and per-doc items (doc order) from lm-eval's logged samples."""
    # Tasks with several filters (e.g. gsm8k) log each doc once per filter; keep the first filter.
    first_filter = samples[0]["filter"]
    rows = sorted((s for s in samples if s["filter"] == first_filter), key=lambda s: s["doc_id"])
    out_type = config["output_type"]
    extra: dict[str, list] = {}
    if out_type == "loglikelihood":
        # filtered_resps[0] is lm-eval's (total log-likelihood, is_greedy) for the one request.
        ll_sum = [float(s["filtered_resps"][0][0]) for s in rows]
        n_tok = [_n_cont_tokens(lm, *s["arguments"][0]) for s in rows]
        if 0 in n_tok:
            doc = rows[n_tok.index(0)]["doc_id"]
            raise ValueError(f"run_lm_eval: task {task!r} doc {doc}: target has no tokens")
        items = [ll / n for ll, n in zip(ll_sum, n_tok, strict=True)]
        greedy = [int(s["filtered_resps"][0][1]) for s in rows]
        p_target = [math.exp(ll) for ll in ll_sum]
        extra = {
            "ll_sum": ll_sum,
            "n_tokens": n_tok,
            "greedy": greedy,
            "p_target": p_target,
            "p_target_mean": sum(p_target) / len(p_target),
        }
        metric = "ll_per_token"
    elif out_type in ("generate_until", "multiple_choice"):
        metric = "exact_match" if out_type == "generate_until" else "acc"
        if metric not in rows[0]:
            metric = config["metric_list"][0]["metric"]
        items = [float(s[metric]) for s in rows]
        if out_type == "generate_until":
            # The model's answers after lm-eval's stop handling, for reading failures.
            extra = {"outputs": [s["filtered_resps"][0] for s in rows]}
    else:
        raise ValueError(f"run_lm_eval: task {task!r} has unsupported output_type {out_type!r}")
    return {
        "metric": metric,
        "score": sum(items) / len(items),
        "n": len(items),
        "output_type": out_type,
        "filter": first_filter,
        "items": items,
        **extra,
    }


def _jsonable(obj: Any) -> Any:
    """Round-trip through JSON so numpy scalars, dtypes and paths become plain values."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(obj, default=handle_non_serializable))


def _load_tasks(
    tm: Any, tasks: Sequence[str], settings: Mapping[str, TaskSetting]
) -> tuple[list[Any], dict[str, list[str]]]:
    """Task/Group objects for `tasks` with each setting's few-shot applied, and each name's leaves.

    lm-eval's `simple_evaluate` takes one num_fewshot for all tasks; building the objects here
    lets every task (and every leaf of a group) get its own.
    """
    objects: list[Any] = []
    leaves: dict[str, list[str]] = {}
    for name in tasks:
        loaded = tm.load([name])
        leaves[name] = sorted(loaded["tasks"])
        if name in settings:
            for task in loaded["tasks"].values():
                task.set_config(key="num_fewshot", value=settings[name].num_fewshot)
        if name in loaded["groups"]:
            objects.append(loaded["groups"][name])
        else:  # a task, or a tag (a plain list of tasks)
            objects.extend(loaded["tasks"].values())
    return objects, leaves


def _compact_standard(
    name: str, leaves: Sequence[str], setting: TaskSetting, raw: dict[str, Any]
) -> dict[str, Any]:
    """Score of a standard task or group: its configured metric/filter over all leaf items."""
    items: list[float] = []
    per_leaf: dict[str, dict[str, float]] = {}
    outputs: list[Any] = []
    out_types = set()
    for leaf in leaves:
        samples = raw["samples"].get(leaf) or []
        if not samples:
            raise ValueError(f"run_lm_eval: task {name!r}: lm-eval logged no samples for {leaf!r}")
        filters = sorted({s["filter"] for s in samples})
        if setting.filter_name not in filters:
            raise ValueError(
                f"run_lm_eval: task {name!r} ({leaf}) has no filter {setting.filter_name!r} "
                f"(has: {', '.join(filters)})"
            )
        rows = sorted(
            (s for s in samples if s["filter"] == setting.filter_name), key=lambda s: s["doc_id"]
        )
        if setting.metric_name not in rows[0]:
            has = [k for k in rows[0].get("metrics", []) if isinstance(k, str)]
            raise ValueError(
                f"run_lm_eval: task {name!r} ({leaf}) has no metric {setting.metric_name!r} "
                f"(has: {', '.join(has) or 'none'})"
            )
        values = [float(s[setting.metric_name]) for s in rows]
        per_leaf[leaf] = {"n": len(values), "score": sum(values) / len(values)}
        items += values
        out_type = raw["configs"][leaf]["output_type"]
        out_types.add(out_type)
        if out_type == "generate_until":
            outputs += [s["filtered_resps"][0] for s in rows]
    entry: dict[str, Any] = {
        "metric": setting.metric_name,
        "score": sum(items) / len(items),
        "n": len(items),
        "output_type": ",".join(sorted(out_types)),
        "filter": setting.filter_name,
        "num_fewshot": setting.num_fewshot,
        "items": items,
        "leaves": per_leaf,
        # lm-eval's own number for the same key (groups: its aggregate), for cross-checking.
        "lm_eval_score": raw["results"].get(name, {}).get(setting.metric),
    }
    if outputs:
        entry["outputs"] = outputs
    return entry


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return backend


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_lm_eval(
    model_dir: Path,
    task_dir: Path | None,
    tasks: Sequence[str],
    *,
    batch_size: int | str = 64,
    device: str | None = None,
    limit: int | None = None,
    include_defaults: bool | None = None,
    bootstrap_iters: int = 0,
    suite: LMEvalSuite | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    experts_implementation: str | None = None,
) -> dict[str, Any]:
    """Evaluate a saved model on lm-eval `tasks` in one in-process `simple_evaluate` call.

    `include_defaults=None` indexes lm-eval's built-in tasks only if `task_dir` lacks one of
    `tasks`. `bootstrap_iters=0` skips lm-eval's stderr bootstrap (100k resamples by default,
    seconds per task); per-doc `items` are returned for paired statistics instead. Tasks listed in
    `suite.tasks` get their few-shot count and are scored by their configured metric (groups over
    all leaves); the suite also picks backend, dtype (default float32 without a suite) and extra
    model args. `device=None` means cuda when available. `trust_remote_code` applies to the
    tokenizer only (hf backend): the model itself always loads with transformers' own classes
    (a steered folder, rpb.eval_routing, through rpb's own type, registered in this process, which
    loads the family's class: no remote code).
    `experts_implementation` (hf backend) picks transformers' experts kernel (None: its default).
    """
    if not tasks:
        raise ValueError("run_lm_eval: no tasks given")
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"run_lm_eval: no saved model (config.json) in {model_dir}")
    _set_offline()
    t0 = time.perf_counter()
    import lm_eval
    import lm_eval.api.registry

    # Imported before anything loads: it registers a steered folder's own type (rpb_steered)
    # with transformers, which then loads it with rpb's classes, without remote code.
    from rpb.eval_routing import attach_eval_routing, eval_routing_spec, is_steered_folder

    settings = dict(suite.tasks) if suite else {}
    device = device or _default_device()
    dtype = dtype or (suite.dtype if suite else "float32")
    backend = _resolve_backend(suite.backend if suite else "hf")
    tm = _task_manager(Path(task_dir).resolve() if task_dir else None, tasks, include_defaults)
    objects, leaves = _load_tasks(tm, tasks, settings)
    for name in tasks:
        if name not in settings and leaves[name] != [name]:
            raise ValueError(f"run_lm_eval: {name!r} is a group or tag; give it a suite setting")
    model_args: dict[str, Any] = {"pretrained": str(model_dir), "dtype": dtype}
    model_args.update(suite.model_args if suite else {})
    if experts_implementation:
        model_args["experts_implementation"] = experts_implementation
    logged_args = dict(model_args)
    if trust_remote_code and backend == "hf":
        # A preloaded tokenizer keeps remote code away from the model class (Moonlight ships an
        # auto_map to inference-only remote modelling code; transformers' own class is used).
        from transformers import AutoTokenizer

        model_args["tokenizer"] = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
        logged_args["tokenizer"] = "preloaded (trust_remote_code)"
    elif trust_remote_code:
        model_args["trust_remote_code"] = logged_args["trust_remote_code"] = True
    # Built the way simple_evaluate builds it from (name, model_args, device=...), but kept so the
    # scored continuation tokens can be counted with lm-eval's own split (_encode_pair).
    # vLLM places the model itself (tensor_parallel_size) and forwards unknown keywords to vllm.
    run_cfg = {"batch_size": batch_size} | ({} if backend == "vllm" else {"device": device})

    routing_spec = eval_routing_spec(model_dir)
    if routing_spec is not None and backend != "hf":
        raise ValueError(
            f"run_lm_eval: {model_dir} keeps method {routing_spec.kind!r} routing at "
            f"evaluation (router hooks), which only the hf backend can apply, not {backend!r}"
        )
    if routing_spec is not None and is_steered_folder(model_dir):
        # lm-eval takes a model type it does not know (rpb_steered) for a causal LM, as it is,
        # with a warning that it may be an error: said here, the warning is not. Left out of the
        # recorded model_args, which are those of any folder.
        model_args["backend"] = "causal"
    lm = lm_eval.api.registry.get_model(backend).create_from_arg_obj(model_args, run_cfg)
    # hard / keep_bias_at_eval: the method's router hooks on the loaded model (the one a steered
    # folder loaded with; attached here for a folder saved before those had a type of their own).
    steering = attach_eval_routing(lm.model, model_dir) if routing_spec is not None else None
    t_load = time.perf_counter()
    logger.info("lm-eval: %d tasks on %s (%s, %s)", len(tasks), model_dir, backend, device)
    extra: dict[str, Any] = {}
    if suite is not None:
        extra = {
            "apply_chat_template": suite.apply_chat_template,
            "fewshot_as_multiturn": suite.fewshot_as_multiturn,
            "gen_kwargs": suite.gen_kwargs,
        }
    try:
        raw = lm_eval.simple_evaluate(
            model=lm,
            tasks=objects,
            task_manager=tm,
            batch_size=batch_size,
            device=device,
            limit=limit,
            log_samples=True,
            bootstrap_iters=bootstrap_iters,
            **extra,
        )
    finally:
        if steering is not None:
            steering.detach()
    if raw is None:  # only non-zero ranks get None; we run single-process
        raise RuntimeError("run_lm_eval: lm_eval.simple_evaluate returned no results")
    t_eval = time.perf_counter()
    compact = {
        t: (
            _compact_standard(t, leaves[t], settings[t], raw)
            if t in settings
            else _compact_task(lm, t, raw["configs"][t], raw["samples"][t])
        )
        for t in tasks
    }
    for t, r in compact.items():
        logger.info("lm-eval: %-28s %s=%.4f (n=%d)", t, r["metric"], r["score"], r["n"])
    config = dict(raw["config"], model=backend, model_args=logged_args)
    return {
        "model_dir": str(model_dir),
        "eval_routing": routing_spec.to_dict() if routing_spec is not None else None,
        "tasks": compact,
        "suite": suite.to_dict() if suite else None,
        "lm_eval": _jsonable(
            {
                "results": raw["results"],
                "versions": raw["versions"],
                "n-samples": raw["n-samples"],
                "configs": raw["configs"],
                "config": config,
            }
        ),
        "provenance": {
            "lm_eval_version": raw.get("lm_eval_version"),
            "transformers_version": raw.get("transformers_version"),
            "torch_version": _torch_version(),
            "git_hash": raw.get("git_hash"),
            "date": raw.get("date"),
        },
        "timing_s": {
            "load": round(t_load - t0, 3),
            "evaluate": round(t_eval - t_load, 3),
            "total": round(time.perf_counter() - t0, 3),
        },
    }


def prefetch_tasks(names: Sequence[str]) -> dict[str, list[str]]:
    """Build the standard lm-eval tasks `names` once, with network, so that their datasets land
    in the Hugging Face datasets cache and evaluation jobs can run offline; return their leaves."""
    if not names:
        raise ValueError("prefetch_tasks: no tasks given")
    from lm_eval.tasks import TaskManager

    tm = TaskManager()
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise ValueError(f"prefetch_tasks: unknown lm-eval task(s) {unknown}")
    # Building a task downloads its dataset (and few-shot split).
    return {name: sorted(tm.load([name])["tasks"]) for name in names}


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def save_results(result: dict[str, Any], path: Path) -> None:
    """Write `result` as JSON atomically (a reader never sees a half-written file), with its
    integrity record under the results folder (rpb.pipeline.results_folder)."""
    from rpb.artifacts import write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(result, indent=2, sort_keys=True, allow_nan=True) + "\n")


def evaluate_model(
    model_dir: Path,
    eval_dir: Path,
    names: Sequence[str],
    out_json: Path,
    work_dir: Path,
    *,
    batch_size: int | str = 64,
    device: str | None = None,
    limit: int | None = None,
    loglikelihood: bool = True,
    trust_remote_code: bool = False,
    experts_implementation: str | None = None,
) -> dict[str, Any]:
    """Evaluate `model_dir` on `names` and write `out_json`.

    A name with an eval set `{eval_dir}/{name}.jsonl` becomes the `rpb_{name}` (and, unless
    `loglikelihood=False`, `rpb_{name}_ll`) tasks written under `work_dir/tasks`; any other name
    is a standard lm-eval task run with its settings from `{eval_dir}/lm_eval_suite.json`.
    """
    t0 = time.perf_counter()
    eval_dir = Path(eval_dir)
    local = [n for n in names if (eval_dir / f"{n}.jsonl").is_file()]
    standard = [n for n in names if n not in local]
    suite = None
    if standard:
        suite_path = eval_dir / SUITE_FILE
        if not suite_path.is_file():
            raise FileNotFoundError(
                f"evaluate_model: no eval set {eval_dir}/{standard[0]}.jsonl and no lm-eval suite "
                f"{suite_path} for the standard task(s) {standard}"
            )
        suite = LMEvalSuite.load(suite_path)
        missing = [n for n in standard if n not in suite.tasks]
        if missing:
            raise ValueError(
                f"evaluate_model: task(s) {missing} are neither eval sets in {eval_dir} nor "
                f"listed in {suite_path} (listed: {', '.join(suite.tasks)})"
            )
    task_dir = Path(work_dir) / "tasks"
    tasks = write_tasks(eval_dir, task_dir, local, limit=limit) if local else []
    if not loglikelihood:
        tasks = [t for t in tasks if not t.endswith(LL_SUFFIX)]
    result = run_lm_eval(
        model_dir,
        task_dir if local else None,
        tasks + standard,
        batch_size=batch_size,
        device=device,
        # Local sets are already cut to `limit`; standard tasks are cut by lm-eval.
        limit=limit if standard else None,
        suite=suite,
        trust_remote_code=trust_remote_code,
        experts_implementation=experts_implementation,
    )
    result["eval_sets"] = {n: str(eval_dir.resolve() / f"{n}.jsonl") for n in local}
    save_results(result, out_json)
    logger.info(
        "evaluated %s on %d tasks in %.1f s -> %s",
        model_dir,
        len(tasks) + len(standard),
        time.perf_counter() - t0,
        out_json,
    )
    return result
