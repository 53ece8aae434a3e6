#!/usr/bin/env bash
# The paper's training launcher (config/paper.yaml's train_launcher): `rpb "$@"` under accelerate
# (config/accelerate/fsdp.yaml: FSDP2), one process per GPU, on every node of the job.
#
# - In a Slurm job's batch step (SLURM_JOB_ID set, no SLURM_STEP_ID: the training rule's command,
#   which snakemake-executor-plugin-slurm runs there for a rule with the `mpi` resource,
#   rpb.pipeline.cluster): srun starts this script once per node, with every CPU and GPU of it.
# - On each node (RPB_LAUNCH_NODE set by the above): accelerate launch with the job's node count,
#   this node's rank, and the first node of the job as the rendezvous host, at a port of the job
#   id (the same on every node, another for the next job).
# - Elsewhere (inside a one-node job step, one workstation): accelerate launch on this machine.
set -euo pipefail
config="${RPB_ACCELERATE_CONFIG:-$(cd "$(dirname "$0")/../.." && pwd)/config/accelerate/fsdp.yaml}"
gpus=$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')
if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" && -z "${RPB_LAUNCH_NODE:-}" ]]; then
    # --kill-on-bad-exit: a node that fails ends the others (no rank waits for it forever).
    exec srun --ntasks-per-node=1 --cpus-per-task="$(nproc)" --gpus-per-node="$gpus" \
        --kill-on-bad-exit=1 --export=ALL,RPB_LAUNCH_NODE=1 bash "$0" "$@"
fi
if [[ -n "${RPB_LAUNCH_NODE:-}" ]]; then
    # Slurm's warning before the time limit (--signal=USR1@600) reaches every process of the step:
    # ignored by this shell and by accelerate (an ignored signal stays ignored across exec and in
    # children), caught by each training process, which saves and exits (rpb.pipeline.preemption).
    trap '' USR1
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    exec accelerate launch --config_file "$config" \
        --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
        --num_processes $((SLURM_NNODES * gpus)) \
        --main_process_ip "$first" --main_process_port $((20000 + SLURM_JOB_ID % 20000)) \
        -m rpb.cli "$@"
fi
exec accelerate launch --config_file "$config" --num_processes "$gpus" -m rpb.cli "$@"
