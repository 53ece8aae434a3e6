"""Shared fixtures: tiny random models of every supported MoE architecture, a padded batch and a
router prior. Everything is offline, single-threaded and deterministic."""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The suite computes on the compatible CPU kernels (rpb.numerics: ATen AVX2, MKL's SSE2 branch), set
# before torch is imported: a test on near-tied scores or exact bytes then sees the kernels it was
# written on whatever the CPU's widest are.
from rpb.numerics import COMPATIBLE  # torch-free

os.environ.update(COMPATIBLE)

import pytest

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def _runs_tests(config: pytest.Config) -> bool:
    """False in pytest-xdist's controller (`make test-fast`), which only hands out tests."""
    return not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not _runs_tests(config):
        return  # spares the controller torch's import (5 s before any worker could start)
    import torch

    torch.set_num_threads(1)  # the dev machines are 2 shared cores
    # The tests keep many tiny models and tensors alive: at Python's default thresholds
    # (700, 10, 10) the cyclic collector took a fifth of a worker's time scanning them
    # (2026-12-04, 39 s of about 200 in `make test-fast`).
    gc.set_threshold(10_000, 20, 50)


def pytest_collection_finish(session: pytest.Session) -> None:
    if _runs_tests(session.config):
        gc.freeze()  # what the test modules imported lives to the end: no collection rescans it


# Test id -> (model_type, config overrides). The grouped DeepSeek-V3 exercises group-limited
# selection (4 groups of 2 experts, best 2 groups) on top of a random correction bias.
ARCHS: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "olmoe": ("olmoe", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_grouped": ("deepseek_v3", {"n_group": 4, "topk_group": 2}),
}
SOFTMAX_ARCHS = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]


@functools.cache
def _cached_model(arch: str) -> PreTrainedModel:
    from rpb.architectures import random_model

    model_type, overrides = ARCHS[arch]
    return random_model(model_type, seed=0, **overrides)


def make_model(arch: str) -> PreTrainedModel:
    """A fresh copy of the cached tiny random model (eval mode) for `arch` (an ARCHS key)."""
    return copy.deepcopy(_cached_model(arch))


def save_tiny_base(folder: Path, num_experts: int = 8) -> Path:
    """A tiny random qwen3_moe base saved with the testbed tokenizer in `folder` (what a
    post-training job takes as its `--base`)."""
    from rpb.architectures import random_model
    from rpb.pipeline.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = random_model(
        "qwen3_moe",
        seed=0,
        num_experts=num_experts,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_batch(
    batch: int = 2, seq: int = 8, pad: int = 3, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random input_ids with a right-padded last row (`pad` masked tokens) and LM labels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 64, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad:
        mask[-1, seq - pad :] = 0
        input_ids[-1, seq - pad :] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


@pytest.fixture(params=list(ARCHS))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def saved_registry():
    """Restores rpb's router registry (and its checked classes) after a test that registers
    router classes."""
    from rpb.router.check import CHECKED
    from rpb.routing import ROUTER_REGISTRY

    saved = dict(ROUTER_REGISTRY)
    yield
    ROUTER_REGISTRY.clear()
    ROUTER_REGISTRY.update(saved)
    CHECKED.clear()


@pytest.fixture
def tiny_model(arch: str) -> PreTrainedModel:
    return make_model(arch)


@pytest.fixture
def tiny_batch() -> dict[str, torch.Tensor]:
    return make_batch()


@pytest.fixture
def tiny_prior(tiny_model: PreTrainedModel):
    """The router prior of `tiny_model` (the base) on a few random padded batches."""
    from rpb.prior import extract_prior

    batches = [make_batch(seed=s) for s in range(3)]
    return extract_prior(
        tiny_model, batches, model_id="tiny", revision="r0", corpus_hash="0" * 64, progress=False
    )


def skip_table_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build method tables without drawing their co-activation heatmaps (about a second per
    figure on the 2-core machines), for tests about a table's numbers and text; the tests that
    look at the figures draw them (tests/test_tables.py, tests/test_render.py)."""
    import rpb.report.table1
    import rpb.report.table4
    import rpb.report.table5

    # Each table module that draws them names `table_figures` itself.
    for module in (rpb.report.table1, rpb.report.table4, rpb.report.table5):
        monkeypatch.setattr(module, "table_figures", lambda results, spec, stem: [])


def perturb_routers(model: PreTrainedModel, scale: float = 0.5, seed: int = 1) -> None:
    """Move every router weight away from the base (as fine-tuning would)."""
    import torch

    from rpb.routing import find_routers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for h in find_routers(model):
            w = h.module.weight
            w.add_(scale * w.std() * torch.randn(w.shape, generator=g))


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite store holding its schema alone (what a first connection creates): making
    one costs a second or two, a copy of it (`new_store`) milliseconds."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("empty_store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def new_store(empty_store: Path, db: Path) -> str:
    """The URI of a fresh sqlite store at `db`, a copy of `empty_store` (the session's)."""
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(empty_store, db)
    return f"sqlite:///{db}"


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory: pytest.TempPathFactory):
    """Results folder of the suite's one smoke pipeline run up to table 1 (tests/smoke_pipeline.py);
    later tests may extend it (test_report.py builds `all` in it)."""
    from smoke_pipeline import run_or_fail

    results = tmp_path_factory.mktemp("smoke") / "results"
    run_or_fail(results, str(results / "table1.csv"), "--cores", "2")
    return results


# The modules that share the one smoke run (`smoke_run`), in the order they must run: the
# determinism, pipeline and browser-check tests read it at table 1, test_report extends it to
# `all`, and the rerun and tracking tests read the extended folder. Only these modules' slots are
# reordered; every other test keeps its place.
SMOKE_ORDER = (
    "test_determinism",
    "test_pipeline",
    "test_browser_check",
    "test_report",
    "test_rerun_triggers",
    "test_tracking",
)


def starts_snakemake(args: object) -> bool:
    """Whether a subprocess command line runs Snakemake (`snakemake ...`, `python -m snakemake`)."""
    if not isinstance(args, Sequence) or isinstance(args, (str, bytes)):
        args = str(args).split()
    words = [str(a) for a in args]
    return any(Path(w).name == "snakemake" for w in words[:1]) or any(
        pair == ("-m", "snakemake") for pair in itertools.pairwise(words)
    )


@pytest.fixture(autouse=True)
def unit_tests_start_no_snakemake(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit tier (`make test-fast`: not slow, not workflow) stays fast because none of its
    tests starts Snakemake (seconds each); a test that does must be marked `workflow`."""
    node = request.node
    if node.get_closest_marker("workflow") or node.get_closest_marker("slow"):
        return
    popen_init = subprocess.Popen.__init__

    def refuse_snakemake(self: subprocess.Popen, args: object, *rest: object, **kw: object):
        if starts_snakemake(args):
            pytest.fail(f"{node.nodeid} starts Snakemake: mark it @pytest.mark.workflow")
        popen_init(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_snakemake)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slots = [i for i, item in enumerate(items) if item.path.stem in SMOKE_ORDER]
    ordered = sorted((items[i] for i in slots), key=lambda it: SMOKE_ORDER.index(it.path.stem))
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item
