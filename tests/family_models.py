"""Tiny random models of every MoE family rpb.families describes, shared by the family tests
(tests/test_families.py, tests/test_router_check.py): one cached base per model type, fresh
copies of it, and its router prior."""

from __future__ import annotations

import copy
import functools

from conftest import make_batch
from torch import nn

from rpb.architectures import random_model
from rpb.families import FAMILIES
from rpb.prior import RouterPrior, extract_prior

# The tiny model type that stands for each family (text-only configs of multimodal families).
TINY_TYPE = {name: family.text_model_type or name for name, family in FAMILIES.items()}
# The tiny model types of the families rpb routes (phimoe is refused).
ROUTED_TYPES = [TINY_TYPE[name] for name in FAMILIES if name != "phimoe"]


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
