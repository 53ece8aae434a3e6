"""Cross-key checks of the pipeline config that a JSON schema cannot express.

The schema (workflow/schemas/config.schema.yaml) checks each key's type and range; this module
checks that names refer to things that exist. Errors are one line naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The method families the library implements (rpb.methods registry); a config entry names one of
# these directly or through `kind`.
METHOD_FAMILIES = (
    "none",
    "lbl",
    "rpb",
    "rpb_marginal",
    "rpb_adaptive",
    "anchor_weight",
    "anchor_logit",
    "anchor_kl",
    "hard",
)
RESERVED_METHOD_LABELS = ("base",)


class ConfigError(ValueError):
    """A config value that is well-typed but refers to something that does not exist."""


def check_config(config: Mapping[str, Any]) -> None:
    """Raise ConfigError naming the first inconsistent key."""
    methods = config["methods"]
    for label, entry in methods.items():
        if label in RESERVED_METHOD_LABELS:
            raise ConfigError(f"methods.{label}: '{label}' is reserved for the untrained base")
        family = (entry or {}).get("kind", label)
        if family not in METHOD_FAMILIES:
            raise ConfigError(
                f"methods.{label}: unknown method '{family}' "
                f"(known: {', '.join(METHOD_FAMILIES)}; set 'kind' for a variant label)"
            )
    table1 = config["table1"]
    if table1["model"] not in config["models"]:
        raise ConfigError(
            f"table1.model: '{table1['model']}' is not a key of models "
            f"({', '.join(config['models'])})"
        )
    for name in table1["methods"]:
        if name not in methods:
            raise ConfigError(f"table1.methods: '{name}' is not a key of methods")
    if table1["corpus"] not in config["evaluation"]["in_domain"]:
        raise ConfigError(
            f"table1.corpus: '{table1['corpus']}' must be one of evaluation.in_domain"
        )
