"""Multi-process training on CPU (torch.distributed with gloo, 2 ranks, one spawn): rpb_adaptive's
bias stays identical across ranks that see different data; anchor_weight under FSDP2
`fully_shard` gives the single-process loss and gradients (its term is taken inside the router
forward, where FSDP has gathered the full weight); `rpb pipeline train` on both ranks (the Trainer
under DDP, as `accelerate launch` starts it) opens one MLflow run and writes its outputs once; and
`RouterMethodTrainer` on both ranks logs the method term and drift of the whole global batch, the
values one process logs on the same data.

FSDP through the Trainer needs GPUs (accelerate has no FSDP on CPU), so the `trainer.save_model`
gather of a sharded model is not exercised here; DDP takes the other branch of the same code.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import make_batch, make_model, perturb_routers
from test_trainer import LENGTHS, collate, step_args, tiny_examples

from rpb.architectures import random_model
from rpb.methods import make_method
from rpb.prior import extract_prior
from rpb.routing import find_routers
from rpb.trainer import RouterMethodTrainer

WORLD = 2
ADAPTIVE = {"strength": 1.0, "update_rate": 0.5}  # large: the bias moves routing every step
ADAPTIVE_STEPS = 3
ANCHOR = 1.0  # strong enough that a lost anchor gradient shows next to the task gradient
# End to end: every test reads one 2-process run (spawned interpreters, `rpb train` on both).
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prior(model: torch.nn.Module) -> Any:
    return extract_prior(
        model, [make_batch()], model_id="m", revision="r", corpus_hash="h", progress=False
    )


def _rank_batch(rank: int) -> dict[str, torch.Tensor]:
    return make_batch(seed=10 + rank)


def _adaptive_bias(batches_per_step: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """rpb_adaptive's bias after ADAPTIVE_STEPS steps, each over all of `batches_per_step` (one
    forward and router_loss per micro-batch, then one optimizer-step update)."""
    model = make_model("qwen3_moe")
    prior = _prior(model)
    model.train()
    with make_method("rpb_adaptive", **ADAPTIVE).attach(model, prior) as method:
        for _ in range(ADAPTIVE_STEPS):
            for batch in batches_per_step:
                model(**batch)
                method.router_loss(batch["attention_mask"])
            method.on_step_end()
        return method.bias.clone()


def _anchor_step(model: torch.nn.Module, prior: Any, batch: dict[str, torch.Tensor]) -> Any:
    """One training forward/backward of task loss + anchor_weight; (router loss, method)."""
    method = make_method("anchor_weight", strength=ANCHOR).attach(model, prior)
    out = model(**batch, use_cache=False)
    router_loss = method.router_loss(batch["attention_mask"])
    (out.loss + router_loss).backward()
    method.detach()
    return router_loss.detach()


def _anchor_model(checkpointing: bool) -> tuple[torch.nn.Module, Any]:
    model = make_model("qwen3_moe")
    prior = _prior(model)
    perturb_routers(model)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()  # transformers', non-reentrant
    return model, prior


def _trainer_history(out: Path, batch: int, ga: int) -> list[dict[str, float]]:
    """`RouterMethodTrainer` with anchor_kl (a per-token term) on the perturbed tiny model: two
    SGD steps over LENGTHS' examples in order, every step logged. Under DDP each rank reads
    `batch` examples per micro-batch; every rank returns the history it logged."""
    model, prior = _anchor_model(checkpointing=False)
    method = make_method("anchor_kl", strength=ANCHOR).attach(model, prior)
    trainer = RouterMethodTrainer(
        model=model,
        args=step_args(out, batch, ga, steps=2, learning_rate=0.1),
        train_dataset=tiny_examples(LENGTHS),
        data_collator=collate,
        router_method=method,
    )
    with method:
        trainer.train()
    return trainer.router_history


def _train_job(world: dict[str, str]) -> list[str]:
    """`rpb pipeline train` arguments of a 2-step rpb_adaptive job, a checkpoint after step 1."""
    method = {"kind": "rpb_adaptive", "options": {"update_rate": 0.5}}
    spec = {"steps": 2, "batch_size": 2, "lr": 0.01, "max_length": 16, "log_every": 1}
    return [
        *("pipeline", "train", "--name", "tiny", "--label", "rpb_adaptive"),
        *("--base", world["base"]),
        *("--prior", world["prior"], "--corpus", world["corpus"], "--corpus-name", "c"),
        *("--method", json.dumps(method), "--spec", json.dumps({**spec, "save_every": 1})),
        *("--out", world["out"], "--tracking-uri", world["uri"], "--experiment", "dist"),
    ]


def _fsdp_anchor_step(mesh: Any, checkpointing: bool) -> dict[str, Any]:
    """anchor_weight's loss and full router gradients of one step of an FSDP2-sharded model."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model, prior = _anchor_model(checkpointing)
    # As in training: the method's hooks go on before FSDP wraps the model.
    method = make_method("anchor_weight", strength=ANCHOR).attach(model, prior)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = make_batch(seed=3)
    out = model(**batch, use_cache=False)
    router_loss = method.router_loss(batch["attention_mask"])
    (out.loss + router_loss).backward()
    method.detach()
    weights = [h.module.weight for h in find_routers(model)]
    return {
        # Between forwards each rank holds a row shard: the old after-forward formula raised.
        "sharded": all(isinstance(w, DTensor) for w in weights),
        "loss": router_loss.detach(),
        "grads": [w.grad.full_tensor() for w in weights],
    }


def _worker(rank: int, port: int, out_dir: str, world: dict[str, str]) -> None:
    # What `accelerate launch` (torchrun) gives each process.
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # it would override --tracking-uri
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from accelerate import PartialState
        from torch.distributed.device_mesh import init_device_mesh

        from rpb.pipeline.cli import main

        result: dict[str, Any] = {"adaptive_bias": _adaptive_bias([_rank_batch(rank)])}
        mesh = init_device_mesh("cpu", (WORLD,))
        for checkpointing in (False, True):
            result[f"anchor_{checkpointing}"] = _fsdp_anchor_step(mesh, checkpointing)
        # The Trainer's accelerate state takes over this process group (DDP on CPU).
        assert main(_train_job(world)) == 0
        state = PartialState()
        result["trainer"] = {"processes": state.num_processes, "index": state.process_index}
        # Global batch 4 per step: 2 per rank, or 1 per rank and micro-batch at GA 2.
        result["drift"] = {
            ga: _trainer_history(Path(out_dir) / f"drift{ga}", batch, ga)
            for ga, batch in ((1, 2), (2, 1))
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _write_world(root: Path) -> dict[str, str]:
    """A saved tiny base with the testbed tokenizer, its prior, a corpus and an MLflow store."""
    from rpb.pipeline.analysis import extract_prior_from_corpus
    from rpb.pipeline.tokenizer import build_tokenizer
    from rpb.pipeline.tracking import init_store

    base = root / "base" / "model"
    tok = build_tokenizer(base)
    random_model("qwen3_moe", vocab_size=len(tok), pad_token_id=tok.pad_token_id).save_pretrained(
        base
    )
    corpus = root / "corpus.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(2)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prior = root / "prior.safetensors"
    extract_prior_from_corpus(base, corpus, prior, model_id="tiny", batch_size=4)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    init_store(uri, "dist")
    world = {"base": base, "prior": prior, "corpus": corpus, "out": root / "run", "uri": uri}
    return {k: str(v) for k, v in world.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of one 2-process gloo run; `world` of rank 0 describes the job."""
    out = tmp_path_factory.mktemp("dist")
    world = _write_world(out)
    mp.spawn(_worker, args=(_free_port(), str(out), world), nprocs=WORLD, join=True)
    results = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    results[0]["world"] = world
    return results


def test_rpb_adaptive_bias_is_the_same_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """Ranks with different data end with one bias: the one a single process gets from the
    whole global batch (both ranks' micro-batches) in each step."""
    biases = [r["adaptive_bias"] for r in ranks]
    assert torch.equal(biases[0], biases[1])
    assert torch.equal(biases[0], _adaptive_bias([_rank_batch(r) for r in range(WORLD)]))
    # Without the all-reduce each rank would follow its own data to a different bias.
    assert not torch.equal(_adaptive_bias([_rank_batch(0)]), _adaptive_bias([_rank_batch(1)]))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_anchor_weight_under_fsdp2_matches_one_process(
    ranks: list[dict[str, Any]], checkpointing: bool
) -> None:
    model, prior = _anchor_model(checkpointing)
    batch = make_batch(seed=3)
    task_only = copy.deepcopy(model)
    want_loss = _anchor_step(model, prior, batch)
    want = [h.module.weight.grad for h in find_routers(model)]
    task_only(**batch, use_cache=False).loss.backward()
    # The anchor term is a large part of the router gradient, so losing it would show.
    for g, t in zip(want, (h.module.weight.grad for h in find_routers(task_only)), strict=True):
        assert (g - t).norm() > 0.5 * g.norm()
    for rank in ranks:
        got = rank[f"anchor_{checkpointing}"]
        assert got["sharded"]
        assert torch.equal(got["loss"], want_loss) and want_loss > 0
        for g, w in zip(got["grads"], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_train_on_two_ranks_tracks_and_writes_once(ranks: list[dict[str, Any]]) -> None:
    from mlflow.tracking import MlflowClient

    assert [r["trainer"] for r in ranks] == [
        {"processes": WORLD, "index": rank} for rank in range(WORLD)
    ]
    world = ranks[0]["world"]
    client = MlflowClient(tracking_uri=world["uri"])
    experiment = client.get_experiment_by_name("dist")
    (run,) = client.search_runs([experiment.experiment_id])  # one run, not one per rank
    assert run.info.run_name == "train/tiny/c/rpb_adaptive/base0/seed0"
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "task_loss")]
    assert steps == [1, 2]
    out = Path(world["out"])
    assert json.loads((out / "mlflow_run.json").read_text())["run_id"] == run.info.run_id
    history = json.loads((out / "train_history.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2]
    # The checkpoint of step 1 is gone; the model folder holds the model and tokenizer only.
    assert not (out / "checkpoints").exists()
    files = sorted(p.name for p in (out / "model").iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert "training_args.bin" not in files


@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_logs_the_global_batch_on_every_rank(
    ranks: list[dict[str, Any]], tmp_path: Path, ga: int
) -> None:
    """Two ranks (2 examples each, or 1 per micro-batch at GA 2) log the method term, the drift
    and the expert load one process logs over the same 4 examples per step: token counts and
    routing sums are reduced across ranks before anything is divided. The ranks' examples hold
    different numbers of tokens, so averaging per-rank means would show."""
    want = _trainer_history(tmp_path, batch=4, ga=1)
    assert [h["step"] for h in want] == [1, 2]
    assert want[0]["router_loss"] > 0.01 and want[1]["mean/kl_to_base"] > 0.01
    for rank in ranks:
        got = rank["drift"][ga]
        assert [h["step"] for h in got] == [1, 2]
        for entry, ref in zip(got, want, strict=True):
            assert entry.keys() == ref.keys()
            for key, value in ref.items():
                assert entry[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (ga, key)
