"""bench/numeric_path.py's in-process parts: the per-operation fingerprints are stable within one
process, cover a training step's operations, and `--compare` names an operation whose fingerprint
differs between two records."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "numeric_path.py"
TINY = {
    "batch": 2,
    "seq": 8,
    "hidden": 16,
    "dense_hidden": 32,
    "expert_hidden": 16,
    "experts": 4,
    "top_k": 2,
    "heads": 2,
    "qk_head_dim": 8,
    "v_head_dim": 8,
    "kv_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "vocab": 20,
}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("numeric_path_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_op_prints_stable_and_complete(bench):
    first = bench.op_prints(TINY)
    assert first == bench.op_prints(TINY)
    assert first != bench.op_prints(TINY, seed=1)  # the inputs reach the digests
    for op in (
        "linear_router",
        "linear_expert_down.grad_w",
        "grouped_mm_experts",
        "sdpa_causal.grad_q",
        "softmax",
        "sigmoid",
        "silu",
        "rms_norm.grad_x",
        "topk.indices",
        "gather",
        "scatter",
        "index_add.grad_src",
        "cross_entropy.grad_logits",
        "adamw_step",
    ):
        assert len(first[op]) == 12 and not first[op].startswith("error"), op


def test_candidates_table(bench):
    """The candidate paths as the pipeline will name them, and their environments."""
    module = bench
    assert module.CANDIDATES["compatible"] == (
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"},
        False,
    )
    env = module.child_env("native")
    assert "ATEN_CPU_CAPABILITY" not in env and "MKL_CBWR" not in env
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"


def test_compare_names_the_differing_op(bench, tmp_path):
    ops = bench.op_prints(TINY)
    row = {
        "name": "native",
        "train_digest": "a" * 16,
        "probe_prints": {"qwen3_moe": "b" * 16, "deepseek_v3": "c" * 16},
        "op_prints": ops,
    }
    mine = {"cpu_model": "CPU A", "date": "d", "candidates": [row]}
    other = copy.deepcopy(mine)
    other["cpu_model"] = "CPU B"
    other["candidates"][0]["op_prints"]["sdpa_causal"] = "0" * 12
    lines = bench.compare(mine, other)
    assert "native: train same; probe same; ops differ: sdpa_causal (1 of" in lines[-1]
    assert "ops all same" in bench.compare(mine, mine)[-1]
    # The command line reads two record files.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(mine))
    b.write_text(json.dumps(other))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--compare", str(a), str(b)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "ops differ: sdpa_causal" in out


def test_op_groups_split_the_candidates(bench):
    rows = [
        {"name": "a", "op_prints": {"mm": "1", "sdpa": "1", "silu": "1"}},
        {"name": "b", "op_prints": {"mm": "2", "sdpa": "1", "silu": "1"}},
        {"name": "c", "op_prints": {"mm": "2", "sdpa": "3", "silu": "1"}},
    ]
    assert bench.op_groups(rows) == {"a | b c": ["mm"], "a b | c": ["sdpa"]}
