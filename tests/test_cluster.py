"""Paper-scale training jobs across nodes (issue 57, item 4): the job's size from the model's
parameter count (rpb.pipeline.cluster), the sbatch command snakemake-executor-plugin-slurm makes
of those resources, and the launcher that starts accelerate once per node
(workflow/scripts/accelerate_launch.sh), run against stand-ins for srun, scontrol and accelerate.
The dry run of the paper plan on 2 nodes is in tests/test_paper_path.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from rpb.pipeline.cluster import Cluster, parameter_count, training_job

ROOT = Path(__file__).resolve().parents[1]
PAPER = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
LAUNCHER = ROOT / "workflow" / "scripts" / "accelerate_launch.sh"


def _built_parameters(model_type: str, architecture: dict[str, Any]) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from rpb.architectures import build_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(model_type, **architecture))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PAPER["models"]))
def test_parameter_count_is_the_built_models(name: str) -> None:
    """The formula counts what transformers builds (on the meta device: no memory), exactly:
    Moonlight 15.96e9, Qwen3-30B-A3B 30.53e9."""
    entry = PAPER["models"][name]
    counted = parameter_count(entry["model_type"], entry["architecture"])
    assert counted == _built_parameters(entry["model_type"], entry["architecture"])
    assert counted == {"moonlight": 15_960_108_544, "qwen3": 30_532_122_624}[name]


def test_parameter_count_with_a_query_rank_and_tied_embeddings() -> None:
    """The branches the paper models do not take: DeepSeek's low-rank query, tied embeddings."""
    arch = dict(PAPER["models"]["moonlight"]["architecture"], q_lora_rank=384)
    arch.update(num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=True)
    assert parameter_count("deepseek_v3", arch) == _built_parameters("deepseek_v3", arch)
    with pytest.raises(ValueError, match="model_type mixtral: no parameter count"):
        parameter_count("mixtral", arch)


def test_training_job_takes_whole_nodes_that_hold_16_bytes_per_parameter() -> None:
    moonlight, qwen3 = 15_960_108_544, 30_532_122_624
    # 80 GB GPUs, 16 GB kept for activations: 64 GB each; Qwen3's 488 GB needs 8 GPUs, one node.
    for parameters in (moonlight, qwen3):
        job = training_job(parameters, Cluster())
        assert (job.nodes, job.gpus) == (1, 8)
    # 40 GB GPUs: Moonlight's 255 GB needs 11 GPUs, so 2 nodes and all 16 of their GPUs.
    job = training_job(moonlight, Cluster(gpu_memory_gb=40.0))
    assert (job.nodes, job.gpus) == (2, 16)
    # Host memory per node: the fp32 checkpoint rank 0 reads, and 32 GB per GPU process.
    assert job.mem_mb == (64 + 8 * 32) * 1000
    assert job.slurm_resources() == {
        "nodes": 2,
        "gpu": 16,
        "cpus_per_task": 8,
        "mem_mb": 320_000,
        "mpi": "srun",
        "tasks": 16,
        "tasks_per_gpu": 0,
        "slurm_extra": "--signal=USR1@600",
    }
    # One GPU: no `mpi` mode (the plugin needs 2 tasks or more) and no USR1 (it would reach
    # Snakemake's own process in the job step).
    one = training_job(10**8, Cluster(gpus_per_node=1)).slurm_resources()
    assert "mpi" not in one and "slurm_extra" not in one and one["gpu"] == 1


def test_cluster_from_the_environment() -> None:
    cluster = Cluster.from_env({"RPB_SLURM_GPUS_PER_NODE": "4", "RPB_SLURM_GPU_MEMORY_GB": "141"})
    assert (cluster.gpus_per_node, cluster.gpu_memory_gb, cluster.activation_gb) == (4, 141.0, 16.0)
    with pytest.raises(ValueError, match="RPB_SLURM_GPUS_PER_NODE='eight': not a int"):
        Cluster.from_env({"RPB_SLURM_GPUS_PER_NODE": "eight"})
    with pytest.raises(ValueError, match=r"RPB_SLURM_GPU_MEMORY_GB \(16\) leaves nothing"):
        Cluster.from_env({"RPB_SLURM_GPU_MEMORY_GB": "16"})


def sbatch_command(resources: dict[str, Any], threads: int = 8) -> str:
    """The sbatch call snakemake-executor-plugin-slurm builds for a job with `resources` (its own
    functions, as the executor calls them), with the profile's `slurm-requeue`."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

    class Resources(dict):
        __getattr__ = dict.__getitem__

    job = SimpleNamespace(resources=Resources(resources), threads=threads, name="posttrain")
    validate_slurm_extra(job)  # the plugin refuses options it sets itself
    params = {
        "run_uuid": "u",
        "slurm_logfile": "log",
        "comment_str": "rule_posttrain",
        "account": "",
        "partition": "",
        "workdir": "/w",
    }
    settings = SimpleNamespace(requeue=True, no_requeue=False, qos=None, reservation=None)
    return get_submit_command(job, params, settings=settings) + set_gres_string(job)


def test_the_plugin_submits_two_nodes_with_a_task_per_gpu_and_the_usr1_warning() -> None:
    job = training_job(15_960_108_544, Cluster(gpu_memory_gb=40.0))
    call = sbatch_command({**job.slurm_resources(), "runtime": 1440})
    for flag in (
        "--nodes=2",
        "--gpus=16",
        "--ntasks=16",
        "--cpus-per-task=8",
        "--mem 320000",
        "-t 1440",
        "--requeue",
        "--signal=USR1@600",
    ):
        assert f" {flag}" in call, (flag, call)
    assert "--ntasks-per-gpu" not in call  # it would bind each node's one task to one GPU


def _stand_ins(bin_dir: Path, calls: Path) -> None:
    """srun: runs its command once per node of a 2-node job (SLURM_NODEID 0, 1), with the
    variables srun sets for a step; scontrol: the job's hostnames; accelerate: records its
    arguments and whether SIGUSR1 is ignored in it."""
    bin_dir.mkdir()
    scripts = {
        "srun": f"""#!/bin/bash
echo "srun $*" >> {calls}
while [[ $1 == --* ]]; do
    [[ $1 == --export=ALL,RPB_LAUNCH_NODE=1 ]] && export RPB_LAUNCH_NODE=1
    shift
done
for node in 0 1; do
    SLURM_NNODES=2 SLURM_NODEID=$node SLURM_STEP_ID=0 SLURM_JOB_NODELIST='gpu[07-08]' "$@" || exit
done
""",
        "scontrol": (
            '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n'
        ),
        "accelerate": f"""#!/usr/bin/env python3
import signal, sys
ignored = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
with open("{calls}", "a") as f:
    f.write(f"accelerate {{' '.join(sys.argv[1:])}} usr1_ignored={{ignored}}\\n")
""",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def _launch(tmp_path: Path, **env: str) -> list[str]:
    calls = tmp_path / "calls"
    _stand_ins(tmp_path / "bin", calls)
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(LAUNCHER), "pipeline", "train", "--name", "m x"],
        env={**environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return calls.read_text().splitlines()


@pytest.mark.slow  # the launcher asks torch for the GPU count (an interpreter start per node)
def test_launcher_starts_accelerate_once_per_node_of_the_slurm_job(tmp_path: Path) -> None:
    config = ROOT / "config" / "accelerate" / "fsdp.yaml"
    srun, *nodes = _launch(tmp_path, SLURM_JOB_ID="4242")
    assert srun.startswith("srun --ntasks-per-node=1 --cpus-per-task=")
    assert "--gpus-per-node=1 --kill-on-bad-exit=1" in srun  # CPU here: torch counts 0, so 1
    # Node rank from Slurm, the first host as rendezvous, a port of the job id, all GPUs of both
    # nodes; USR1 ignored by the launcher's processes, for the training processes to catch.
    assert nodes == [
        f"accelerate launch --config_file {config} --num_machines 2 --machine_rank {rank}"
        " --num_processes 2 --main_process_ip gpu07 --main_process_port 24242"
        " -m rpb.cli pipeline train --name m x usr1_ignored=True"
        for rank in (0, 1)
    ]


@pytest.mark.slow
def test_launcher_outside_a_slurm_batch_step_runs_accelerate_here(tmp_path: Path) -> None:
    """A one-node job step (SLURM_STEP_ID set) or a workstation: no srun, no multi-node flags."""
    config = ROOT / "config" / "accelerate" / "fsdp.yaml"
    (call,) = _launch(tmp_path, SLURM_JOB_ID="4242", SLURM_STEP_ID="0")
    assert call == (
        f"accelerate launch --config_file {config} --num_processes 1"
        " -m rpb.cli pipeline train --name m x usr1_ignored=False"
    )
