"""How big a paper-scale training job is: nodes, GPUs, CPUs and host memory from the model's size.

Under FSDP with AdamW in mixed precision every parameter costs 16 bytes of GPU memory (fp32
weights, gradients and the optimizer's two moments), sharded over all the job's GPUs; each GPU
also needs room for activations (8 x 1,024 tokens per GPU with checkpointing, the logits, NCCL
buffers). The job takes the fewest whole nodes whose GPUs hold both, and all their GPUs, so the
global batch stays `batch_size` x GPUs of a node per node. The parameter count comes from the
config's `architecture` (the checkpoint's own config.json, which the download rule checks), by
the modelling code's own shapes (tests/test_cluster.py counts a built model against it).

The GPU nodes are the cluster's, not the experiment's: read from the environment (`CLUSTER_ENV`,
defaults for 8 x 80 GB nodes), so the Snakefile can size jobs without torch. Torch-free.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# fp32 weights (4) + gradients (4) + AdamW's exp_avg and exp_avg_sq (4 + 4)
BYTES_PER_PARAMETER = 16
# Bytes per parameter of host memory on the first node: rank 0 reads the fp32 checkpoint
# (fsdp_cpu_ram_efficient_loading), the others start on the meta device.
HOST_BYTES_PER_PARAMETER = 4
# Slurm's warning before the time limit, in seconds: time for the checkpoint of a 30B model
# (rpb.pipeline.preemption saves and requeues on it).
PREEMPT_WARNING_S = 600
# The cluster's GPU nodes: environment variable -> (field, default).
CLUSTER_ENV = {
    "RPB_SLURM_GPUS_PER_NODE": ("gpus_per_node", 8),
    "RPB_SLURM_GPU_MEMORY_GB": ("gpu_memory_gb", 80.0),
    "RPB_SLURM_ACTIVATION_GB": ("activation_gb", 16.0),
    "RPB_SLURM_CPUS_PER_GPU": ("cpus_per_gpu", 8),
    "RPB_SLURM_HOST_GB_PER_GPU": ("host_gb_per_gpu", 32.0),
}


@dataclass(frozen=True)
class Cluster:
    """The GPU nodes a training job runs on: GPUs per node and memory per GPU (GB), the part of
    it kept for activations, CPUs per GPU and host memory per GPU process (GB)."""

    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    activation_gb: float = 16.0
    cpus_per_gpu: int = 8
    host_gb_per_gpu: float = 32.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Cluster:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for variable, (name, default) in CLUSTER_ENV.items():
            raw = environ.get(variable)
            if raw is None:
                continue
            try:
                values[name] = type(default)(raw)
            except ValueError:
                raise ValueError(f"{variable}={raw!r}: not a {type(default).__name__}") from None
        cluster = cls(**values)
        if cluster.gpu_memory_gb <= cluster.activation_gb:
            raise ValueError(
                f"RPB_SLURM_GPU_MEMORY_GB ({cluster.gpu_memory_gb:g}) leaves nothing beside "
                f"RPB_SLURM_ACTIVATION_GB ({cluster.activation_gb:g})"
            )
        if cluster.gpus_per_node < 1 or cluster.cpus_per_gpu < 1:
            raise ValueError("RPB_SLURM_GPUS_PER_NODE and RPB_SLURM_CPUS_PER_GPU must be >= 1")
        return cluster


@dataclass(frozen=True)
class TrainingJob:
    """A training job's size: whole nodes, every GPU of each, and per node its host memory."""

    parameters: int
    nodes: int
    gpus_per_node: int
    cpus_per_gpu: int
    mem_mb: int  # per node

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def slurm_resources(self) -> dict[str, Any]:
        """The rule's resources for snakemake-executor-plugin-slurm. Several GPUs: the plugin's
        `mpi` mode (sbatch --ntasks=<GPUs>, --cpus-per-task per GPU, and the rule's command runs
        in the batch step, not inside `srun -n1`), so the launcher's own `srun` starts one
        accelerate launch per node and Slurm's USR1 warning reaches the training processes alone
        (workflow/scripts/accelerate_launch.sh). `tasks_per_gpu: 0` keeps --ntasks-per-gpu off
        (it would bind each task to one GPU)."""
        resources: dict[str, Any] = {
            "nodes": self.nodes,
            "gpu": self.gpus,
            "cpus_per_task": self.cpus_per_gpu,
            "mem_mb": self.mem_mb,
        }
        if self.gpus > 1:
            resources.update(
                mpi="srun",
                tasks=self.gpus,
                tasks_per_gpu=0,
                slurm_extra=f"--signal=USR1@{PREEMPT_WARNING_S}",
            )
        return resources


def training_job(parameters: int, cluster: Cluster) -> TrainingJob:
    """The fewest whole nodes whose GPUs hold `parameters` x 16 bytes beside the activations."""
    per_gpu = (cluster.gpu_memory_gb - cluster.activation_gb) * 1e9
    gpus = math.ceil(BYTES_PER_PARAMETER * parameters / per_gpu)
    nodes = max(1, math.ceil(gpus / cluster.gpus_per_node))
    host_gb = HOST_BYTES_PER_PARAMETER * parameters / 1e9
    host_gb += cluster.host_gb_per_gpu * cluster.gpus_per_node
    return TrainingJob(
        parameters=parameters,
        nodes=nodes,
        gpus_per_node=cluster.gpus_per_node,
        cpus_per_gpu=cluster.cpus_per_gpu,
        mem_mb=math.ceil(host_gb) * 1000,
    )


def parameter_count(model_type: str, architecture: Mapping[str, Any]) -> int:
    """Parameters of a deepseek_v3 or qwen3_moe model of `architecture` (config.json's keys),
    by transformers' modelling shapes: embeddings and an untied output layer, attention, dense and
    MoE MLPs (routed and shared experts, router), RMSNorms: the trained parameters."""
    a = dict(architecture)
    vocab, hidden, layers = a["vocab_size"], a["hidden_size"], a["num_hidden_layers"]
    heads = a["num_attention_heads"]
    embeddings = vocab * hidden * (1 if a.get("tie_word_embeddings") else 2)
    norms = 2 * hidden * layers + hidden  # two per layer, one final

    def experts(count: int, intermediate: int) -> int:  # gate, up and down projections
        return count * 3 * hidden * intermediate

    if model_type == "qwen3_moe":
        head_dim = a.get("head_dim") or hidden // heads
        kv = a.get("num_key_value_heads", heads)
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 2 * head_dim
        n_experts = a["num_experts"]
        moe = experts(n_experts, a["moe_intermediate_size"]) + n_experts * hidden
        return embeddings + norms + layers * (attention + moe)
    if model_type == "deepseek_v3":
        qk_head = a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
        q_rank, kv_rank = a.get("q_lora_rank"), a["kv_lora_rank"]
        if q_rank is None:
            query = hidden * heads * qk_head
        else:
            query = hidden * q_rank + q_rank + q_rank * heads * qk_head
        key_value = hidden * (kv_rank + a["qk_rope_head_dim"]) + kv_rank
        key_value += kv_rank * heads * (a["qk_nope_head_dim"] + a["v_head_dim"])
        attention = query + key_value + heads * a["v_head_dim"] * hidden
        dense_layers = a.get("first_k_dense_replace", 0)
        n_experts, moe_width = a["n_routed_experts"], a["moe_intermediate_size"]
        moe = experts(n_experts, moe_width) + experts(1, moe_width * a.get("n_shared_experts", 0))
        moe += n_experts * hidden  # the router (its correction bias is a buffer)
        mlps = dense_layers * experts(1, a["intermediate_size"]) + (layers - dense_layers) * moe
        return embeddings + norms + layers * attention + mlps
    raise ValueError(f"model_type {model_type}: no parameter count (deepseek_v3, qwen3_moe)")
