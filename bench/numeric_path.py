"""Which CPU numeric settings change the bits of a tiny MoE training run, and what each costs.

Each setting runs in a fresh process (ATen reads ATEN_CPU_CAPABILITY and MKL reads MKL_CBWR once,
before their first kernel): 40 AdamW steps of tiny random qwen3_moe and deepseek_v3 models on one
thread, then a sha256 of the final parameters and the wall time. Run it on two CPU models and
compare the fingerprints of a setting: equal fingerprints mean that setting is portable between
them (docs/reproducibility.md). Writes bench/results/numeric_path_<cpu>.json.

    python bench/numeric_path.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from any folder

from rpb.numerics import cpu_model  # noqa: E402

CHILD = r"""
import hashlib, json, sys, time
import torch
torch.set_num_threads(1)
torch.backends.mkldnn.enabled = sys.argv[1] == "on"
from rpb.architectures import random_model
start = time.perf_counter()
prints = {}
for family in ("qwen3_moe", "deepseek_v3"):
    torch.manual_seed(0)
    model = random_model(family, vocab_size=128, pad_token_id=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    for _ in range(40):
        ids = torch.randint(3, 128, (16, 24), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().numpy().tobytes())
    prints[family] = digest.hexdigest()[:16]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "prints": prints,
                  "seconds": time.perf_counter() - start}))
"""


def run(capability: str, cbwr: str, onednn: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if capability != "unset":
        env["ATEN_CPU_CAPABILITY"] = capability
    if cbwr != "unset":
        env["MKL_CBWR"] = cbwr
    out = subprocess.run(
        [sys.executable, "-c", CHILD, onednn], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    settings = list(
        itertools.product(("default", "avx2", "avx512"), ("unset", "COMPATIBLE"), ("on", "off"))
    )
    for capability, cbwr, onednn in settings:
        times, prints = [], set()
        for _ in range(args.repeats):
            result = run(capability, cbwr, onednn)
            times.append(result["seconds"])
            prints.add(json.dumps(result["prints"], sort_keys=True))
        row = {
            "ATEN_CPU_CAPABILITY": capability,
            "MKL_CBWR": cbwr,
            "onednn": onednn,
            "capability_in_use": result["capability"],
            "prints": result["prints"],
            "repeatable": len(prints) == 1,
            "seconds_min": round(min(times), 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    fastest = min(r["seconds_min"] for r in rows)
    for row in rows:
        row["time_vs_fastest"] = round(row["seconds_min"] / fastest, 3)
    import torch
    import transformers

    cpu = cpu_model()
    record = {
        "cpu_model": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": f"python bench/numeric_path.py --repeats {args.repeats}",
        "date": time.strftime("%Y-%m-%d"),
        "settings": rows,
    }
    slug = hashlib.sha256(cpu.encode()).hexdigest()[:8]
    out = ROOT / "bench" / "results" / f"numeric_path_{slug}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({cpu})")


if __name__ == "__main__":
    main()
