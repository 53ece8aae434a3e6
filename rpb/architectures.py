"""Tiny configs and random models of the transformers MoE families that rpb routes.

`build_config` returns transformers' own config class for a model type with tiny defaults (any
field can be overridden, so the same call builds the tiny testbed bases and paper-shaped test
models); `random_model` instantiates one deterministically with non-trivial routing. The tiny
configs are the families' own (rpb.families); the pipeline pretrains bases of those marked
`pretrain` (`PRETRAIN_MODEL_TYPES`), the others exist so every registered family is tested on a
model of its own config class.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from rpb.families import FAMILIES, PRETRAIN_MODEL_TYPES, routed_model_types

__all__ = [
    "PRETRAIN_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "TINY_MODEL_TYPES",
    "build_config",
    "random_model",
]

_COMMON: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# model_type -> its tiny config (rpb.families); multimodal families under their text config's name.
_FAMILY: dict[str, Mapping[str, Any]] = {
    family.text_model_type or name: family.tiny for name, family in FAMILIES.items()
}
# Fields the modelling code reads that the config class does not declare (Qwen3-30B-A3B sets
# head_dim 128 while hidden_size / num_attention_heads is 64).
_READ_BY_MODEL: dict[str, set[str]] = {
    family.text_model_type or name: set(family.undeclared_fields)
    for name, family in FAMILIES.items()
}

# Every model type with a tiny config (phimoe only to show that rpb refuses it); those rpb routes.
TINY_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILY)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for t in _FAMILY if t in routed_model_types())


def _known_keys(config_cls: type[PretrainedConfig]) -> set[str]:
    keys = (
        {f.name for f in dataclasses.fields(config_cls)}
        if dataclasses.is_dataclass(config_cls)
        else set()
    )
    for alias, target in getattr(config_cls, "attribute_map", {}).items():
        keys.update((alias, target))
    return keys | {"attn_implementation"}


def build_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """transformers' config for `model_type` with tiny defaults; `overrides` replace any field."""
    if model_type not in _FAMILY:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(TINY_MODEL_TYPES)})"
        )
    config_cls = CONFIG_MAPPING[model_type]
    known = _known_keys(config_cls) | _READ_BY_MODEL.get(model_type, set())
    # transformers configs accept any keyword silently; a typo would build the wrong model.
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ValueError(f"unknown {model_type} config field(s): {', '.join(unknown)}")
    return config_cls(**{**_COMMON, **_FAMILY[model_type], **overrides})


def random_model(
    model_type: str,
    seed: int = 0,
    *,
    router_std: float | None = None,
    correction_bias_std: float = 0.05,
    **overrides: Any,
) -> PreTrainedModel:
    """A deterministic randomly initialised float32 causal LM in eval mode.

    Router weights are redrawn with std `router_std` (default 1/sqrt(hidden), so logits are O(1)
    and routing is far from uniform), and DeepSeek-V3 correction biases (zeros by default) get
    N(0, `correction_bias_std`) values so the biased selection path is exercised; so do router
    logit biases (gpt_oss) and other families' correction biases. The global RNG is left untouched.
    """
    from rpb.routing import find_routers  # local: routing imports nothing from here

    config = build_config(model_type, **overrides)
    std = router_std if router_std is not None else 1.0 / math.sqrt(config.hidden_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for handle in find_routers(model):
                handle.weight.normal_(0.0, std)
                for bias in (handle.router_bias, handle.correction_bias):
                    if bias is not None:
                        bias.normal_(0.0, correction_bias_std)
    return model.eval()


def char_tokenizer(alphabet: str = "0123456789+-*=() ") -> Any:
    """A character-level fast tokenizer over `alphabet` plus `<eos>` and `<pad>` (no BOS, no
    unknown token, right padding), for a `random_model` in examples and tests: token ids are
    `<pad>` 0, `<eos>` 1, then the alphabet in order, so `vocab_size=len(tokenizer)`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    vocab = {"<pad>": 0, "<eos>": 1} | {c: i + 2 for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab))
    # Specials first so `<eos>` in a text is one token; then every character alone.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"<eos>|<pad>|."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
