"""CPU numeric paths: the settings under which a CPU computes the same float bits run after run.

Tiny MoE training amplifies last-bit float differences, so two processes that round differently
end with different models. Three things choose how a CPU rounds a PyTorch job: ATen's vectorised
kernels (`ATEN_CPU_CAPABILITY`), MKL's matrix multiplies (`MKL_CBWR`) and oneDNN
(`torch.backends.mkldnn`); with one intra-op thread every reduction is summed in one order. A
path fixes all of them:

- `native` (the default): the CPU's own widest ATen kernels, MKL's own dispatch, oneDNN off, one
  thread. The fastest path measured that gives the same bits run after run
  (`bench/numeric_path.py`); its bits belong to the CPU model.
- `compatible`: ATen's AVX2 kernels and MKL's `COMPATIBLE` (SSE2) branch, oneDNN off, one thread.
  It was chosen hoping for the same bits on every x86-64 CPU; measured, Intel and AMD CPUs still
  differ under it, and a training step costs 1.6-1.7x the native path's. The committed bases were
  pretrained on it (`make bases` uses it) and the test suite computes on it.

ATen and MKL read their variables once, before their first kernel: they must be in a process's
environment when it starts (`path_environment`), and `apply_path` then sets the in-process parts
and checks that the path is in effect. The measurements behind the choice:
docs/reproducibility.md.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COMPATIBLE",
    "DEFAULT_PATH",
    "KERNEL_ENV",
    "LOCK_ENV",
    "PATHS",
    "PIN_ENV",
    "NumericPath",
    "NumericPathError",
    "apply_path",
    "cpu_model",
    "numeric_path",
    "path_environment",
]


@dataclass(frozen=True)
class NumericPath:
    """One CPU numeric path: the kernel variables a process starts with (unset where absent)
    and the ATen capability it must then run (None: whatever the CPU's widest is)."""

    name: str
    env: Mapping[str, str]
    capability: str | None = None


# The variables that pick kernels, as ATen and MKL spell them; a path sets some and unsets the rest.
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")
PATHS: dict[str, NumericPath] = {
    "native": NumericPath("native", {}),
    "compatible": NumericPath(
        "compatible", {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}, "AVX2"
    ),
}
DEFAULT_PATH = "native"
# The compatible path's variables: the test suite's kernels (tests/conftest.py).
COMPATIBLE: dict[str, str] = dict(PATHS["compatible"].env)
# Set (to a path's name) in a job's environment by whoever pins it: the job then applies and
# checks that path.
PIN_ENV = "RPB_CPU_NUMERICS"
# The sha256 of the lock file the environment was installed from, recorded with every run.
LOCK_ENV = "RPB_LOCK_SHA256"


class NumericPathError(RuntimeError):
    """The numeric path a job was started on is not in effect in this process (one line: what
    differs, and how to run anyway)."""


def path_environment(name: str) -> dict[str, str]:
    """The variables a process must start with to run on path `name` (one thread). The kernel
    variables the path leaves unset must be removed from the environment too (`KERNEL_ENV`)."""
    path = PATHS[name]
    return {**path.env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", PIN_ENV: name}


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (e.g. "AMD EPYC", "Intel(R) Xeon(R) ...")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def apply_path(name: str | None = None) -> None:
    """Set the in-process parts of path `name` (default: the one `PIN_ENV` names) — one thread,
    oneDNN off — and check the parts only a process's start can set; raises NumericPathError
    naming the first that differs."""
    import torch

    name = name or os.environ.get(PIN_ENV, "")
    if name not in PATHS:
        raise NumericPathError(
            f"{PIN_ENV}={name or 'unset'} names no CPU numeric path (known: {', '.join(PATHS)})"
        )
    path = PATHS[name]
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if path.capability is not None and capability != path.capability:
        setting = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
        raise NumericPathError(
            f"ATen runs {capability} kernels, the {name} numeric path needs {path.capability} "
            f"(ATEN_CPU_CAPABILITY={setting} at this process's start; this CPU may lack it): "
            "set cpu_numerics: native in the config to run on this CPU's own kernels"
        )
    for variable in KERNEL_ENV:
        wanted, found = path.env.get(variable), os.environ.get(variable)
        if found != wanted:
            raise NumericPathError(
                f"{variable}={found or 'unset'} in this job's environment, the {name} numeric "
                f"path needs {wanted or 'it unset'} from the process's start (the pipeline sets it)"
            )


def numeric_path() -> dict[str, Any]:
    """What this process computes with: the path's name (`free` when none is pinned), CPU model,
    ATen capability, MKL mode, oneDNN, threads, library versions and the lock file's hash;
    `pinned` says whether a path is in force."""
    import torch
    import transformers

    name = os.environ.get(PIN_ENV)
    return {
        "pinned": name in PATHS,
        "path": name if name in PATHS else "free",
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", "unset"),
        "onednn": bool(torch.backends.mkldnn.enabled),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lock_sha256": os.environ.get(LOCK_ENV, "unknown"),
    }
