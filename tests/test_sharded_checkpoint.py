"""Sharded checkpoints (issue 57, item 3): config/accelerate/fsdp.yaml's SHARDED_STATE_DICT, as
the Trainer writes and reads it under FSDP2, on 2 CPU processes (gloo).

accelerate offers FSDP on GPUs only (on CPU processes the Trainer runs the FSDP config as DDP), so
the Trainer's own sharded path cannot run here. What it calls can: accelerate's
`save_fsdp_model` / `save_fsdp_optimizer` and `load_fsdp_model` / `load_fsdp_optimizer` with the
config's plugin, on a tiny MoE sharded with `fully_shard` per decoder layer as accelerate wraps
it. Two steps, a sharded checkpoint (each rank writes its own shard files), a fresh model and
optimizer that load it and take two more steps: the full weights are the uninterrupted four
steps', bit for bit, and gathering them (`get_state_dict`, what `_save_model` writes as the one
model.safetensors) gives every tensor whole on the main process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from conftest import make_batch, make_model
from test_distributed import _free_port

WORLD = 2
STEPS, SAVED_AT = 4, 2
FSDP_CONFIG = Path(__file__).resolve().parents[1] / "config" / "accelerate" / "fsdp.yaml"
pytestmark = pytest.mark.slow


def _plugin() -> Any:
    from accelerate import FullyShardedDataParallelPlugin

    options = yaml.safe_load(FSDP_CONFIG.read_text())["fsdp_config"]
    return FullyShardedDataParallelPlugin(
        fsdp_version=options["fsdp_version"], state_dict_type=options["fsdp_state_dict_type"]
    )


def _sharded_model(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = make_model("qwen3_moe")
    model.train()
    for layer in model.model.layers:  # fsdp.yaml's TRANSFORMER_BASED_WRAP: one unit per layer
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int):
    for step in steps:
        model(**make_batch(seed=100 + WORLD * step + rank), use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model: torch.nn.Module, on_rank0: bool = False) -> dict[str, torch.Tensor]:
    """The whole tensors behind the shards, on every rank; `on_rank0`: as accelerate's
    get_state_dict gathers them for FSDP2 (rank 0 alone holds them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=on_rank0, cpu_offload=True
    )
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from accelerate.utils import (
            load_fsdp_model,
            load_fsdp_optimizer,
            save_fsdp_model,
            save_fsdp_optimizer,
        )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        from accelerate import PartialState

        # What the functions read of the Accelerator (its process count and index, its logging).
        plugin, accelerator = _plugin(), PartialState(cpu=True)
        checkpoint = Path(out_dir) / "checkpoint"

        model, optimizer = _sharded_model(mesh)
        _steps(model, optimizer, range(STEPS), rank)
        uninterrupted = _full(model)

        model, optimizer = _sharded_model(mesh)
        _steps(model, optimizer, range(SAVED_AT), rank)
        save_fsdp_model(plugin, accelerator, model, str(checkpoint))
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(checkpoint))
        dist.barrier()
        model, optimizer = _sharded_model(mesh)  # the requeued job: fresh from the base
        load_fsdp_model(plugin, accelerator, model, str(checkpoint))
        load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(checkpoint))
        _steps(model, optimizer, range(SAVED_AT, STEPS), rank)
        resumed = _full(model)
        gathered = _full(model, on_rank0=True)  # what _save_model writes
        shapes = {k: tuple(v.shape) for k, v in make_model("qwen3_moe").state_dict().items()}
        shards = {
            p.relative_to(checkpoint).as_posix(): p.stat().st_size
            for p in checkpoint.rglob("*")
            if p.is_file()
        }
        torch.save(
            {
                "uninterrupted": uninterrupted,
                "resumed": resumed,
                "gathered": gathered,
                "shape": shapes,
                "shards": shards,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_the_config_checkpoints_sharded() -> None:
    assert str(_plugin().state_dict_type).endswith("SHARDED_STATE_DICT")


def test_resume_from_a_sharded_checkpoint_gives_the_uninterrupted_weights(ranks) -> None:
    for rank in ranks:
        want, got = rank["uninterrupted"], rank["resumed"]
        assert want.keys() == got.keys()
        differ = [k for k in want if not want[k].equal(got[k])]
        assert not differ, f"resumed weights differ: {differ[:5]}"
    # Each rank wrote its own shard files of the model and the optimizer; no full state dict.
    shards = ranks[0]["shards"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {f"{folder}/__{r}_0.distcp" for r in range(WORLD)} <= set(shards), shards
    assert not [name for name in shards if name.endswith((".bin", ".safetensors"))], shards


def test_the_final_gather_is_whole_on_the_main_process(ranks) -> None:
    main = ranks[0]
    assert {k: tuple(v.shape) for k, v in main["gathered"].items()} == main["shape"]
    assert all(main["gathered"][k].equal(main["resumed"][k]) for k in main["shape"])
    assert ranks[1]["gathered"] == {}  # the others hold nothing: rank 0 writes the file
