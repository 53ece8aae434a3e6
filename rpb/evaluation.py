"""Evaluation through lm-evaluation-harness: task YAMLs for the tiny eval sets, one in-process run.

Every eval set `{eval_dir}/{name}.jsonl` (lines `{"prompt": str, "target": str}`) becomes two
lm-eval tasks, both reading the JSONL through `dataset_path: json` by absolute path:

- `rpb_{name}`: `generate_until`, greedy, stops at the eos string, `max_gen_toks` = longest target
  (in characters, an upper bound on its tokens) + 2; metric `exact_match` with no normalisation
  (no case folding, punctuation or whitespace stripping).
- `rpb_{name}_ll`: `loglikelihood` of the target given the prompt (the continuation is exactly
  the target: `target_delimiter: ""`, no inserted space); lm-eval metrics `perplexity`
  (per-document total log-likelihood, aggregated as exp(-mean)) and `acc` (the target is the
  greedy continuation under teacher forcing). This loss-based measure does not floor out at zero
  accuracy.

`run_lm_eval` runs all tasks in ONE `simple_evaluate` call (the model is loaded and each request
type batched once) and returns a compact dict, per task:

- generate_until: `metric="exact_match"`, `items` = per-doc 0/1 in doc order, `score` = mean;
- loglikelihood: `metric="ll_per_token"`, `items` = per-doc MEAN per-token log-likelihood of the
  target (nats), `score` = mean of `items` (so `score` is always the mean of `items`, which keeps
  paired bootstraps over items consistent with the score); `ll_sum` (per-doc total, what lm-eval
  reports), `n_tokens` (target tokens as lm-eval split them) and `greedy` (lm-eval's is_greedy)
  are given beside it;
- multiple_choice (standard paper-scale tasks): `metric="acc"`, per-doc 0/1.

plus lm-eval's raw aggregate metrics, task configs and package versions for provenance.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
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
        extra = {"ll_sum": ll_sum, "n_tokens": n_tok, "greedy": greedy}
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


def run_lm_eval(
    model_dir: Path,
    task_dir: Path | None,
    tasks: Sequence[str],
    *,
    batch_size: int = 64,
    device: str = "cpu",
    limit: int | None = None,
    include_defaults: bool | None = None,
    bootstrap_iters: int = 0,
) -> dict[str, Any]:
    """Evaluate a saved model on lm-eval `tasks` in one in-process `simple_evaluate` call.

    `include_defaults=None` indexes lm-eval's built-in tasks only if `task_dir` lacks one of
    `tasks`. `bootstrap_iters=0` skips lm-eval's stderr bootstrap (100k resamples by default,
    seconds per task); per-doc `items` are returned for paired statistics instead.
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

    tm = _task_manager(Path(task_dir).resolve() if task_dir else None, tasks, include_defaults)
    model_args = {"pretrained": str(model_dir), "dtype": "float32"}
    # Built the way simple_evaluate builds it from ("hf", model_args, device=...), but kept so the
    # scored continuation tokens can be counted with lm-eval's own split (_encode_pair).
    lm = lm_eval.api.registry.get_model("hf").create_from_arg_obj(
        model_args, {"batch_size": batch_size, "device": device}
    )
    t_load = time.perf_counter()
    logger.info("lm-eval: %d tasks on %s (%s)", len(tasks), model_dir, device)
    raw = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=tm,
        batch_size=batch_size,
        device=device,
        limit=limit,
        log_samples=True,
        bootstrap_iters=bootstrap_iters,
    )
    if raw is None:  # only non-zero ranks get None; we run single-process
        raise RuntimeError("run_lm_eval: lm_eval.simple_evaluate returned no results")
    t_eval = time.perf_counter()
    compact = {t: _compact_task(lm, t, raw["configs"][t], raw["samples"][t]) for t in tasks}
    for t, r in compact.items():
        logger.info("lm-eval: %-28s %s=%.4f (n=%d)", t, r["metric"], r["score"], r["n"])
    config = dict(raw["config"], model="hf", model_args=model_args)
    return {
        "model_dir": str(model_dir),
        "tasks": compact,
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


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def save_results(result: dict[str, Any], path: Path) -> None:
    """Write `result` as JSON atomically (a reader never sees a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
    ) as f:
        json.dump(result, f, indent=2, sort_keys=True, allow_nan=True)
        f.write("\n")
    os.replace(f.name, path)


def evaluate_model(
    model_dir: Path,
    eval_dir: Path,
    names: Sequence[str],
    out_json: Path,
    work_dir: Path,
    *,
    batch_size: int = 64,
    device: str = "cpu",
    limit: int | None = None,
    loglikelihood: bool = True,
) -> dict[str, Any]:
    """Write the tasks for `names` under `work_dir/tasks`, evaluate `model_dir`, write `out_json`.

    `loglikelihood=False` runs only the exact-match tasks.
    """
    t0 = time.perf_counter()
    tasks = write_tasks(eval_dir, Path(work_dir) / "tasks", names, limit=limit)
    if not loglikelihood:
        tasks = [t for t in tasks if not t.endswith(LL_SUFFIX)]
    result = run_lm_eval(
        model_dir, Path(work_dir) / "tasks", tasks, batch_size=batch_size, device=device
    )
    result["eval_sets"] = {n: str(Path(eval_dir).resolve() / f"{n}.jsonl") for n in names}
    save_results(result, out_json)
    logger.info(
        "evaluated %s on %d tasks in %.1f s -> %s",
        model_dir,
        len(tasks),
        time.perf_counter() - t0,
        out_json,
    )
    return result


def summary(result: dict[str, Any]) -> dict[str, float]:
    """`{task: score}` of a run_lm_eval result (for tables and MLflow metrics)."""
    if "tasks" not in result:
        raise ValueError("summary: not a run_lm_eval result (no 'tasks')")
    return {t: r["score"] for t, r in result["tasks"].items()}
