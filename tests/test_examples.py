"""examples/: each script runs offline as a user would run it (its own process, the repository
root as working directory), exits 0 and prints the method's metrics for every step; with
`--model` it trains a checkpoint directory instead of the built-in tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# script -> a method that gives it a non-zero router term or steering, and whether it needs trl
EXAMPLES = {
    "plain_loop.py": ("lbl", False),
    "trainer.py": ("anchor_kl", False),
    "trl_sft.py": ("rpb", True),
}
METRICS = ("task_loss", "router_loss", "mean/kl_to_base", "mean/topk_overlap_with_base")
# End to end: each test runs an example script in its own interpreter, training a model.
pytestmark = pytest.mark.slow


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def step_lines(stdout: str) -> list[dict[str, float]]:
    """The `step N key=value ...` lines the examples print, as dicts."""
    lines = [line for line in stdout.splitlines() if re.match(r"step \d+ ", line)]
    return [{k: float(v) for k, v in re.findall(r"(\S+)=(\S+)", line)} for line in lines]


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_example_runs_and_prints_the_metrics(script: str) -> None:
    method, needs_trl = EXAMPLES[script]
    if needs_trl:
        pytest.importorskip("trl")
    proc = run_example(script, "--steps", "3", "--method", method)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{method} on 2 routers of Qwen3MoeForCausalLM" in proc.stdout
    steps = step_lines(proc.stdout)
    assert len(steps) == 3, proc.stdout[-2000:]
    for entry in steps:
        assert set(METRICS) <= entry.keys()
    if method in ("lbl", "anchor_kl"):  # terms that are positive once the router has moved
        assert steps[-1]["router_loss"] > 0
    # The routing moved away from the base while training.
    assert steps[-1]["mean/kl_to_base"] > 0 or steps[-1]["mean/topk_overlap_with_base"] < 1


def test_rpb_shows_its_drift_first_and_a_zero_router_term() -> None:
    """rpb steers selection and has no loss term: router_loss is 0 at every step, and the
    drift, which does move, comes first on each line."""
    proc = run_example("plain_loop.py", "--steps", "3", "--method", "rpb")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = step_lines(proc.stdout)
    assert len(steps) == 3 and all(entry["router_loss"] == 0 for entry in steps)
    assert all(next(iter(entry)).startswith("mean/") for entry in steps)
    assert steps[-1]["mean/kl_to_base"] > 0 or steps[-1]["mean/topk_overlap_with_base"] < 1


def test_example_trains_a_checkpoint_directory(tmp_path: Path) -> None:
    from rpb.architectures import random_model
    from rpb.pipeline.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path)
    # Three MoE layers where the built-in model has two: the script says which it trained.
    model = random_model(
        "qwen3_moe", num_hidden_layers=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(tmp_path)
    proc = run_example("trainer.py", "--model", str(tmp_path), "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rpb on 3 routers of Qwen3MoeForCausalLM" in proc.stdout
    steps = step_lines(proc.stdout)
    assert len(steps) == 2 and set(METRICS) <= steps[0].keys()


def test_the_readme_loop_runs_as_it_is(tmp_path: Path) -> None:
    """README's "Use the method in your own training" loop is complete: saved as a file and run
    in a fresh interpreter, it trains two steps, prints the drift from the base each step and
    writes the prior (it names nothing it does not define)."""
    from test_light_install import _readme_library_snippet

    script = tmp_path / "loop.py"
    script.write_text(_readme_library_snippet())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if "mean/kl_to_base" in line]
    assert [line.split()[0] for line in printed] == ["0", "1"], proc.stdout
    assert (tmp_path / "prior.safetensors").is_file()
