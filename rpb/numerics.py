"""One CPU numeric path: the settings under which a CPU computes the same float bits as any other.

Tiny MoE training amplifies last-bit float differences, so two CPUs that round differently end
with different models. Three things choose how a CPU rounds a PyTorch job, and each is pinned:

- ATen's vectorised kernels: `ATEN_CPU_CAPABILITY=avx2`, the widest instruction set every x86-64
  CPU of the last decade has (AVX-512 kernels would fall back, and change the bits, on CPUs
  without it);
- MKL's matrix multiplies: `MKL_CBWR=COMPATIBLE`, MKL's conditional numerical reproducibility on
  its one SSE2 code path, the only branch MKL keeps identical on Intel and non-Intel CPUs;
- oneDNN (`torch.backends.mkldnn`) off, so no third library picks kernels by CPU, and one
  intra-op thread, so every reduction is summed in one order.

ATen and MKL read their variables once, before their first kernel: they must be in a process's
environment when it starts (`pinned_environment`), and `apply_pinned` then sets the in-process
parts and checks that the path is in effect. How each setting was chosen, and what it costs:
docs/reproducibility.md (`bench/numeric_path.py` measures it on any CPU).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_ENV",
    "PINNED",
    "PIN_ENV",
    "NumericPathError",
    "apply_pinned",
    "cpu_model",
    "numeric_path",
    "pinned_environment",
]

# The variables that pick kernels; values as ATen and MKL spell them.
PINNED: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
# Set (to "pinned") in a job's environment by whoever pins it: the job then applies and checks it.
PIN_ENV = "RPB_CPU_NUMERICS"
# The sha256 of the lock file the environment was installed from, recorded with every run.
LOCK_ENV = "RPB_LOCK_SHA256"


class NumericPathError(RuntimeError):
    """The pinned numeric path is not in effect in this process (one line: what differs, and
    how to run anyway)."""


def pinned_environment() -> dict[str, str]:
    """The variables a process must start with to run on the pinned path."""
    return {**PINNED, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", PIN_ENV: "pinned"}


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (e.g. "AMD EPYC", "Intel(R) Xeon(R) ...")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def apply_pinned() -> None:
    """Set the in-process parts of the pinned path (one thread, oneDNN off) and check the parts
    that only a process's start can set; raises NumericPathError naming the first that differs."""
    import torch

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    wanted = PINNED["ATEN_CPU_CAPABILITY"].upper()
    if capability != wanted:
        setting = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
        raise NumericPathError(
            f"ATen runs {capability} kernels, the pinned numeric path needs {wanted} "
            f"(ATEN_CPU_CAPABILITY={setting} at this process's start; this CPU may lack it): "
            "set cpu_numerics: free in the config to run anyway, with numbers of this CPU's own"
        )
    for name, value in PINNED.items():
        if os.environ.get(name) != value:
            raise NumericPathError(
                f"{name}={os.environ.get(name, 'unset')} in this job's environment, the pinned "
                f"numeric path needs {value} from the process's start (the pipeline sets it)"
            )


def numeric_path() -> dict[str, Any]:
    """What this process computes with: CPU model, ATen capability, MKL mode, oneDNN, threads,
    library versions and the lock file's hash; `pinned` says whether the pinned path is on."""
    import torch
    import transformers

    return {
        "pinned": os.environ.get(PIN_ENV) == "pinned",
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", "unset"),
        "onednn": bool(torch.backends.mkldnn.enabled),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lock_sha256": os.environ.get(LOCK_ENV, "unknown"),
    }
