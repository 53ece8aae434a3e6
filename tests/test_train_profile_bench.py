"""bench/train_profile.py on a tiny job: it trains through the pipeline's own job, and its parts
nest as the Trainer calls them (a renamed entry point in transformers or rpb reads 0 s and fails
here, instead of a profile that silently misses a part)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from test_distributed import _write_world

ROOT = Path(__file__).resolve().parents[1]


def test_the_profile_splits_a_training_job_into_parts_that_nest(tmp_path: Path) -> None:
    world = _write_world(tmp_path)
    spec = importlib.util.spec_from_file_location(
        "train_profile", ROOT / "bench" / "train_profile.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "profile.json"
    args = ["--base", world["base"], "--prior", world["prior"], "--corpus", world["corpus"]]
    assert bench.main([*args, "--steps", "3", "--batch-size", "2", "--out", str(out)]) == 0
    parts = {k: v["seconds"] for k, v in json.loads(out.read_text())["parts"].items()}
    assert all(parts[p] > 0 for p in bench.PARTS), parts
    assert parts["job"] >= parts["training_loop"] >= parts["training_step"]
    assert parts["training_step"] >= parts["forward_and_loss"] + parts["backward"] * 0.99
    assert parts["forward_and_loss"] >= parts["router_hooks"]
    assert parts["other_per_step"] >= 0
