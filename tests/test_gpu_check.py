"""bench/gpu_check.py's CPU half runs as a user runs it (`--cpu`, its own process) and records
what it checked: two identical CPU runs of every family and method give identical bits, the
Trainer trains on the CPU, gpu_smoke's tiny slices are timed, no method adds a host wait of its
own (tests/test_no_sync.py's recorder), and the GPU-only FSDP check says it was skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"qwen3_moe", "deepseek_v3", "mixtral", "olmoe"}
METHODS = {"none", "lbl", "rpb", "rpb_adaptive", "anchor_kl", "hard"}
CHECKS = {"equivalence", "trainer", "fsdp", "overhead", "syncs"}


@pytest.mark.slow  # its own interpreter: 48 short training runs, a Trainer, gpu_smoke; ~20 s
def test_the_cpu_half_passes_and_records_every_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert {"date", "commit", "torch", "transformers", "device", "mode", "passed"} <= record.keys()
    assert record["mode"] == "cpu" and record["passed"] is True and record["complete"] is True
    assert len(record["commit"]) == 40
    checks = record["checks"]
    assert checks.keys() == CHECKS
    assert record["summary"] == {name: check["passed"] for name, check in checks.items()}

    equivalence = checks["equivalence"]
    assert equivalence["passed"] and equivalence["kind"] == "cpu_repeat_determinism"
    assert equivalence["results"].keys() == FAMILIES
    for family, rows in equivalence["results"].items():
        assert rows.keys() == METHODS, family
        for name, row in rows.items():
            assert row["identical_losses"] and row["identical_weights"], (family, name)

    trainer = checks["trainer"]
    assert trainer["passed"] and trainer["device"] == "cpu"
    assert len(trainer["task_loss"]) == trainer["steps"]

    assert checks["fsdp"]["passed"] is None and "GPU only" in checks["fsdp"]["skipped"]

    overhead = checks["overhead"]
    assert overhead["passed"] and overhead["ratio_to_none"].keys() == {"moonlight", "qwen3"}
    for ratios in overhead["ratio_to_none"].values():
        assert ratios.keys() == METHODS and ratios["none"] == 1.0
    # Steady steps: each timed step follows untimed ones with the method attached.
    assert overhead["sizes"]["untimed_steps_after_each_attach"] == 2

    syncs = checks["syncs"]
    assert syncs["passed"], syncs
    for arch, rows in syncs["results"].items():
        assert rows.keys() == METHODS, arch
        assert rows["rpb"]["from_rpb"] == [] and rows["none"]["extra_over_none"] == 0
    # One allowance, the method's own: lbl's sequence-wise loss on DeepSeek-V3 only.
    allowed = {a: r["lbl"]["allowed_waits_per_moe_layer"] for a, r in syncs["results"].items()}
    assert allowed == {"deepseek_v3": 2, "qwen3_moe": 0}


def test_the_record_is_written_as_checks_finish(tmp_path: Path, monkeypatch) -> None:
    """A run stopped part way (a timeout, a kill) leaves the checks that finished on disk,
    marked incomplete."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def killed(args):
        raise KeyboardInterrupt  # as a timeout's signal would stop it

    monkeypatch.setattr(gpu_check, "check_trainer", lambda args, cuda: {"passed": True, "x": 1})
    monkeypatch.setattr(gpu_check, "syncs_by_recorder", killed)
    out = tmp_path / "gpu_check.json"
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--cpu", "--skip", "equivalence", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["complete"] is False and record["passed"] is False
    assert record["checks"]["trainer"]["x"] == 1 and record["summary"]["trainer"] is True
    assert "syncs" not in record["checks"] and "overhead" not in record["checks"]
