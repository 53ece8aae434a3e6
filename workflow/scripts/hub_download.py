"""Snakemake script of the download rules (workflow/rules/download.smk): pinned Hugging Face Hub
models and datasets, and the lm-eval suite, fetched once with network so that compute jobs run
offline. Run by Snakemake (`script:`) in its own process; the functions are importable for tests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Files a model needs: weights, configs, tokenizer files and remote tokenizer code.
MODEL_FILES = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def _log(path: str | os.PathLike, message: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(message.rstrip() + "\n")


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, float) and isinstance(actual, int | float):
        return math.isclose(expected, actual, rel_tol=1e-9)
    return expected == actual


def check_hub_config(name: str, entry: Mapping[str, Any], cfg: Any) -> None:
    """Raise if a downloaded model's config (a transformers config, so that renamed fields such as
    qwen3_moe's num_experts resolve) is not the model that config models.<name> describes."""
    where = f"models.{name} ({entry['hf_id']}@{entry['revision']})"
    if cfg.model_type != entry["model_type"]:
        found, wanted = cfg.model_type, entry["model_type"]
        raise ValueError(f"{where}: the checkpoint has model_type {found!r}, not {wanted!r}")
    diffs = [
        f"{key}: expected {value!r}, checkpoint has {getattr(cfg, key, '<missing>')!r}"
        for key, value in (entry.get("architecture") or {}).items()
        if not _same(value, getattr(cfg, key, "<missing>"))
    ]
    if diffs:
        raise ValueError(f"{where}: the checkpoint differs from the config: {'; '.join(diffs)}")


def finalize_model_dir(name: str, entry: Mapping[str, Any], stage: Path) -> dict[str, Any]:
    """Check a downloaded snapshot and make it safe for offline jobs; return its manifest.

    Moonlight's config has an auto_map to inference-only remote modelling code: it is removed so
    every job loads transformers' native class, even where the tokenizer needs remote code. A
    tokenizer without a pad token gets eos as pad (training right-pads).
    """
    from transformers import AutoConfig, AutoTokenizer

    cfg_path = stage / "config.json"
    raw = json.loads(cfg_path.read_text())
    removed = raw.pop("auto_map", None)
    cfg_path.write_text(json.dumps(raw, indent=2) + "\n")
    check_hub_config(name, entry, AutoConfig.from_pretrained(stage))
    trust = bool(entry.get("trust_remote_code", False))
    tok = AutoTokenizer.from_pretrained(stage, trust_remote_code=trust)
    if tok.eos_token is None:
        raise ValueError(f"models.{name}: the tokenizer has no eos token (training appends one)")
    pad_set = None
    if tok.pad_token is None:
        tc_path = stage / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["pad_token"] = pad_set = tok.eos_token
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    shutil.rmtree(stage / ".cache", ignore_errors=True)
    manifest = {
        "hf_id": entry["hf_id"],
        "revision": entry["revision"],
        "trust_remote_code": trust,
        "removed_auto_map": removed,
        "pad_token_set_to": pad_set,
        "files": {p.name: p.stat().st_size for p in sorted(stage.iterdir()) if p.is_file()},
    }
    (stage / "rpb_download.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def fetch_model(
    name: str, entry: Mapping[str, Any], out_dir: Path, staging: Path, log: str
) -> None:
    """snapshot_download at the pinned revision into a staging folder (resumable), check, move."""
    from huggingface_hub import snapshot_download

    stage = Path(staging) / name / entry["revision"]
    _log(log, f"downloading {entry['hf_id']}@{entry['revision']} -> {stage}")
    snapshot_download(
        repo_id=entry["hf_id"],
        revision=entry["revision"],
        local_dir=stage,
        allow_patterns=MODEL_FILES,
    )
    manifest = finalize_model_dir(name, entry, stage)
    Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    os.replace(stage, out_dir)
    _log(log, f"done: {json.dumps(manifest)}")


def fetch_corpus(
    name: str,
    spec: Mapping[str, Any],
    seed: int,
    out_train: Path,
    out_probe: Path,
    out_manifest: Path,
    log: str,
) -> dict[str, Any]:
    """A pinned hub dataset -> shuffled, disjoint prompt/target probe and prompt/completion
    training JSONL, rendered with the config's templates (in the dataset's field names)."""
    import datasets

    ds = datasets.load_dataset(
        spec["hf_id"], name=spec.get("config"), revision=spec["revision"], split=spec["split"]
    )
    n_train, n_probe = spec["train_examples"], spec["probe_examples"]
    if n_train + n_probe > len(ds):
        raise ValueError(
            f"data.corpora.{name}: {n_train} + {n_probe} examples asked, "
            f"{spec['hf_id']} has {len(ds)}"
        )
    ds = ds.shuffle(seed=seed).select(range(n_probe + n_train))

    def render(i: int) -> tuple[str, str]:
        row = ds[i]
        try:
            pair = spec["prompt"].format(**row), spec["completion"].format(**row)
        except KeyError as err:
            raise ValueError(
                f"data.corpora.{name}: field {err} is not a column of {spec['hf_id']} "
                f"({', '.join(ds.column_names)})"
            ) from None
        if not pair[0].strip() or not pair[1].strip():
            raise ValueError(f"data.corpora.{name}: row {i} renders an empty prompt or completion")
        return pair

    parts = (
        (out_probe, range(n_probe), ("prompt", "target")),
        (out_train, range(n_probe, n_probe + n_train), ("prompt", "completion")),
    )
    for path, indices, keys in parts:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for i in indices:
                record = dict(zip(keys, render(i), strict=True))
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    rows = {"probe": n_probe, "train": n_train}
    manifest = {
        "hf_id": spec["hf_id"],
        "revision": spec["revision"],
        "split": spec["split"],
        "seed": seed,
        "prompt": spec["prompt"],
        "completion": spec["completion"],
        "rows": rows,
        "source_fingerprint": ds._fingerprint,
        "datasets": datasets.__version__,
    }
    Path(out_manifest).write_text(json.dumps(manifest, indent=2) + "\n")
    _log(log, f"{name}: {json.dumps(rows)}")
    return manifest


def write_lm_eval_suite(spec: Mapping[str, Any], names: Sequence[str], out: Path, log: str) -> None:
    """The suite file rpb.pipeline.evaluation reads; every benchmark the config evaluates must be in
    it."""
    from rpb.pipeline.evaluation import LMEvalSuite

    suite = LMEvalSuite.from_dict(spec, where="evaluation.lm_eval")
    missing = [n for n in names if n not in suite.tasks]
    if missing:
        raise ValueError(f"evaluation.lm_eval.tasks: no settings for {missing}")
    suite.save(out)
    _log(log, f"wrote {out}")


def prefetch_lm_eval(names: Sequence[str], out: Path, log: str) -> None:
    """Build the lm-eval tasks once with network: their datasets land in the HF datasets cache."""
    import lm_eval

    from rpb.pipeline.evaluation import prefetch_tasks

    leaves = prefetch_tasks(names)
    cache = os.environ.get("HF_DATASETS_CACHE") or os.environ.get("HF_HOME") or "~/.cache"
    payload = {"tasks": leaves, "lm_eval": lm_eval.__version__, "hf_cache": cache}
    Path(out).write_text(json.dumps(payload, indent=2) + "\n")
    _log(log, f"prefetched {sum(map(len, leaves.values()))} lm-eval tasks into {cache}")


def main(smk: Any) -> None:
    """Dispatch on the rule that runs this script."""
    log, p = smk.log[0], smk.params
    if smk.rule == "download_model":
        fetch_model(smk.wildcards.model, p.entry, smk.output.model, p.staging, log)
    elif smk.rule == "download_corpus":
        out = smk.output
        fetch_corpus(smk.wildcards.corpus, p.spec, p.seed, out.train, out.probe, out.manifest, log)
    elif smk.rule == "lm_eval_suite":
        write_lm_eval_suite(p.spec, p.names, smk.output[0], log)
    elif smk.rule == "prefetch_lm_eval":
        prefetch_lm_eval(p.names, smk.output[0], log)
    else:
        raise ValueError(f"hub_download.py: no action for rule {smk.rule!r}")


if "snakemake" in globals():
    # Downloads need the hub even where the environment says offline (the Makefile, tests);
    # this is a fresh process, so setting the flags before any HF import takes effect.
    os.environ["HF_HUB_OFFLINE"] = "0"
    os.environ["HF_DATASETS_OFFLINE"] = "0"
    main(globals()["snakemake"])
