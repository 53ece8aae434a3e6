"""Tiny random models of every MoE family rpb.router_specs describes, shared by the family tests
(tests/test_router_specs.py, tests/test_router_check.py): one cached base per model type, fresh
copies of it, and its router prior."""

from __future__ import annotations

import copy
import functools

from conftest import make_batch
from torch import nn

from rpb.architectures import random_model
from rpb.prior import RouterPrior, extract_prior
from rpb.router_specs import FAMILY_ROUTERS, MODEL_TYPE_ALIASES

# The tiny model type that stands for each family (text-only configs of multimodal families).
TINY_TYPE = {family: family for family in FAMILY_ROUTERS} | {
    f: alias for alias, f in MODEL_TYPE_ALIASES.items()
}
FAMILIES = [TINY_TYPE[f] for f in FAMILY_ROUTERS if f != "phimoe"]


@functools.cache
def family_base(model_type: str) -> nn.Module:
    return random_model(model_type, seed=0)


def family_model(model_type: str) -> nn.Module:
    """A fresh copy of the cached tiny base of `model_type`."""
    return copy.deepcopy(family_base(model_type))


@functools.cache
def family_prior(model_type: str) -> RouterPrior:
    batches = [make_batch(seed=s) for s in range(2)]
    return extract_prior(
        family_base(model_type),
        batches,
        model_id="tiny",
        revision="r0",
        corpus_hash="0",
        progress=False,
    )
