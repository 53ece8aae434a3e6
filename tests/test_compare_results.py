"""bench/compare_results.py's recorded digests: what two CPUs must agree on, what not."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_results", ROOT / "bench/compare_results.py")
compare_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_results)


def _results(root: Path, cpu: str, accuracy: str) -> Path:
    results = root / "results"
    (results / "runs").mkdir(parents=True)
    (results / "table1.csv").write_text(f"method,in_domain\nnone,{accuracy}\n")
    history = {"history": [{"loss": 1.5}], "numeric_path": {"cpu": cpu, "capability": "AVX2"}}
    (results / "runs" / "train_history.json").write_text(json.dumps(history))
    (results / "logs").mkdir()
    (results / "logs" / "job.log").write_text(cpu)  # logs are never compared
    scratch = results / "eval" / "seed0.work" / "tasks"  # nor a job's scratch folder, left or not
    scratch.mkdir(parents=True)
    (scratch / "dataset_info.json").write_text(json.dumps({"cpu": cpu}))
    return results


def test_a_folder_matches_its_record_across_cpus_and_not_across_numbers(tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    amd = _results(tmp_path / "amd", "AMD EPYC", "97.0")
    assert compare_results.main(["--record", str(record), str(amd)]) == 0
    assert set(json.loads(record.read_text())["files"]) == {
        "table1.csv",
        "runs/train_history.json",
    }
    intel = _results(tmp_path / "intel", "Intel(R) Xeon(R)", "97.0")
    assert compare_results.main(["--against", str(record), str(intel)]) == 0
    drifted = _results(tmp_path / "drifted", "Intel(R) Xeon(R)", "96.5")
    assert compare_results.main(["--against", str(record), str(drifted)]) == 1


def test_a_record_with_a_plan_keeps_only_that_targets_outputs(tmp_path: Path) -> None:
    """A folder that also holds another target's runs records what a fresh run of the planned
    target makes (a file, or any file under a declared folder), so that run misses nothing."""
    results = _results(tmp_path / "amd", "AMD EPYC", "97.0")
    (results / "runs" / "model").mkdir()
    (results / "runs" / "model" / "config.json").write_text("{}")
    (results / "rpb_readings.csv").write_text("method\nnone\n")  # another target's
    plan = tmp_path / "plan.json"
    jobs = [{"output": ["<results>/table1.csv", "<results>/runs/model"]}]
    plan.write_text(json.dumps({"jobs": jobs}))
    record = tmp_path / "record.json"
    assert compare_results.main(["--record", str(record), str(results), "--plan", str(plan)]) == 0
    assert set(json.loads(record.read_text())["files"]) == {"table1.csv", "runs/model/config.json"}
