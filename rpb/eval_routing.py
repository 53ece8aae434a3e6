"""Routing that a trained model keeps at evaluation: saved beside the model, re-attached on load.

Most methods steer routing only while training, so a saved checkpoint routes natively and needs
nothing more. `hard` (and any method with `keep_bias_at_eval: true`) is meant to be evaluated with
its steering in place: base-router selection for `hard`, the prior bias for RPB. The checkpoint
cannot hold forward hooks, so `save_eval_routing` writes the method (its MethodConfig, as
`{"kind", "strength", "options"}`, and its state such as rpb_adaptive's learned bias) and its
router prior into `<model_dir>/eval_routing/`,
and `attach_eval_routing` puts the same hooks back on a freshly loaded model. Evaluation
(lm-eval) and the co-activation analysis both call it, so accuracy and structure are measured on
the routing the model is trained for.

State that the model itself can hold needs nothing here: `rpb_adaptive` on DeepSeek-V3 writes its
bias into the router's own `e_score_correction_bias` buffer, which the checkpoint saves, so the
reloaded model routes with it natively (as DeepSeek-V3 keeps its own correction bias).

A steered folder also carries a model type of rpb's own, so that no loader scores it unsteered
without a word: `save_eval_routing` rewrites its config.json to `model_type: "rpb_steered"` (the
family's own type, architectures and auto_map kept under `rpb_base_*`), with an `auto_map` naming
`rpb_steered.py`, a small module it writes beside the weights that imports rpb's
`RpbSteeredConfig` and `RpbSteeredForCausalLM`. Either loads the family's own transformers class
and attaches the saved routing (`attach_eval_routing`): the model it returns steers, its method
kept as `model.rpb_eval_routing`.

Importing this module registers the type with transformers' Auto classes (`AutoConfig`,
`AutoModelForCausalLM`), so in a process that did (rpb's pipeline jobs, lm-eval called from rpb,
`load_model`) a plain `AutoModelForCausalLM.from_pretrained(folder)` loads it steered: transformers
prefers a registered type to the folder's auto_map, so no trust_remote_code is needed and nothing
is copied into its modules cache. A process without rpb imported (stock transformers, lm-eval's
CLI) refuses the folder unless given `trust_remote_code=True`, and with it imports rpb through
`rpb_steered.py`: the same classes. Folders written before (the family's model type, an
`eval_routing/`; a method file that names the family `method`) load as they did.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rpb.artifacts import save_safetensors, write_text
from rpb.method_config import MethodConfig
from rpb.methods import RouterMethod
from rpb.prior import RouterPrior

log = logging.getLogger(__name__)

EVAL_ROUTING_DIR = "eval_routing"
_METHOD_FILE = "method.json"
_PRIOR_FILE = "prior.safetensors"
_STATE_FILE = "state.safetensors"

# A steered folder's own model type, the module its config.json's auto_map names, and the
# attribute a loaded model keeps its attached method in.
STEERED_MODEL_TYPE = "rpb_steered"
STEERED_MODULE_FILE = "rpb_steered.py"
STEERING_ATTR = "rpb_eval_routing"
# config.json keys rpb_steered replaces; the family's own values are kept under rpb_base_<key>.
_REPLACED_KEYS = ("model_type", "architectures", "auto_map")
_BASE_PREFIX = "rpb_base_"
_NOTE_KEY = "rpb_note"
_NOTE = (
    "This model steers its routing at evaluation with the router method saved in eval_routing/ "
    "(rpb). Load it with trust_remote_code=True (rpb installed: pip install rpb), or in a "
    "process that imported rpb.eval_routing (rpb.eval_routing.load_model) without it; otherwise "
    "transformers refuses the folder rather than load it unsteered."
)
_AUTO_MAP = {
    "AutoConfig": "rpb_steered.RpbSteeredConfig",
    "AutoModelForCausalLM": "rpb_steered.RpbSteeredForCausalLM",
}
# The text of rpb_steered.py, written byte-identically into every steered folder. transformers
# skips imports inside try blocks when it checks a remote module's requirements, so a missing rpb
# is named by the error below.
STEERED_MODULE_TEXT = '''"""A model saved by rpb that steers its routing at evaluation.

The router method saved in eval_routing/ is part of this model: with its saved routers alone it
would route, and score, as another model. So config.json gives it a model type of rpb's own
("rpb_steered", the family's kept as rpb_base_model_type) and names this module. transformers
loads the folder only with trust_remote_code=True, and then through rpb's own classes (imported
below), which load the family's own transformers class and attach the saved routing (kept as
`model.rpb_eval_routing`). A process that imported rpb.eval_routing has the type registered and
needs neither trust_remote_code nor this module.

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # rpb installed
    lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True ...
    rpb.eval_routing.load_model(folder)
"""

try:
    from rpb.eval_routing import RpbSteeredConfig, RpbSteeredForCausalLM
except ModuleNotFoundError as err:
    if (err.name or "").split(".")[0] != "rpb":
        raise
    raise ImportError(
        "this model steers its routing at evaluation with rpb (its eval_routing/ folder): "
        "install rpb to load it (pip install . in a checkout of the rpb repository)"
    ) from None

__all__ = ["RpbSteeredConfig", "RpbSteeredForCausalLM"]
'''


# sha256 of each text rpb has written as rpb_steered.py: STEERED_MODULE_TEXT, and the first one
# (65da61e, before rpb_steered was registered in-process), which folders saved then still hold.
STEERED_MODULE_SHA256 = frozenset(
    {
        hashlib.sha256(STEERED_MODULE_TEXT.encode()).hexdigest(),
        "8ce0ac0f8457ae420f17cba227860b5bfe65faa1572f79721662e82be24f48ea",
    }
)


def check_steered_module(folder: str | Path) -> None:
    """Refuse, in one line, a steered folder whose rpb_steered.py is not a text rpb wrote: a
    stock trust_remote_code=True load runs that file, so a changed one is named before rpb loads
    the folder. A folder without it loads (rpb's classes need no module)."""
    path = Path(folder) / STEERED_MODULE_FILE
    if not path.is_file():
        return
    if hashlib.sha256(path.read_bytes()).hexdigest() not in STEERED_MODULE_SHA256:
        raise ValueError(
            f"{path}: not the module rpb writes (changed since the folder was saved; a "
            "trust_remote_code=True load would run the change): replace it with "
            "rpb.eval_routing.STEERED_MODULE_TEXT or delete it (rpb loads the folder without it)"
        )


def keeps_routing_at_eval(method: RouterMethod) -> bool:
    """Whether `method` steers routing in eval mode (its hooks must travel with the model)."""
    return MethodConfig.of(method).keeps_routing_at_eval


def save_eval_routing(
    model_dir: str | Path, method: RouterMethod, prior: RouterPrior | None
) -> Path | None:
    """Write `method` and `prior` under `model_dir/eval_routing/` if the method steers at
    evaluation, and make the folder a steered one (`rpb_steered.py`, config.json's model type
    `rpb_steered`); return that folder (None, and nothing written, for methods that do not).
    `model_dir` holds the saved model (its config.json) already."""
    if not keeps_routing_at_eval(method):
        return None
    if method.needs_prior and prior is None:
        raise ValueError(f"save_eval_routing: method {method.name!r} needs its router prior")
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"save_eval_routing: no saved model (config.json) in {model_dir}")
    config = _read_config(config_path)
    out = model_dir / EVAL_ROUTING_DIR
    out.mkdir(parents=True, exist_ok=True)
    spec = MethodConfig.of(method).to_dict()
    if prior is not None:
        prior.save(out / _PRIOR_FILE)
    state = method.state_dict()
    if state:
        save_safetensors({k: v.contiguous() for k, v in state.items()}, out / _STATE_FILE)
    write_text(out / _METHOD_FILE, json.dumps(spec, indent=2, sort_keys=True) + "\n")
    write_text(model_dir / STEERED_MODULE_FILE, STEERED_MODULE_TEXT)
    # Rewritten last: a folder whose config.json says rpb_steered has all its routing files.
    write_text(
        config_path, json.dumps(steered_config_dict(config), indent=2, sort_keys=True) + "\n"
    )
    return out


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def steered_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """A saved model's config.json made a steered folder's (the same for one already steered)."""
    if config.get("model_type") == STEERED_MODEL_TYPE:
        return dict(config)
    out = {k: v for k, v in config.items() if k not in _REPLACED_KEYS}
    for key in _REPLACED_KEYS:
        if key in config:
            out[_BASE_PREFIX + key] = config[key]
    out["model_type"] = STEERED_MODEL_TYPE
    out["architectures"] = ["RpbSteeredForCausalLM"]
    out["auto_map"] = dict(_AUTO_MAP)
    out[_NOTE_KEY] = _NOTE
    return out


def base_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The family's own config.json of a steered folder's `config` (unchanged if not steered):
    the dict transformers read before `save_eval_routing` rewrote it."""
    if config.get("model_type") != STEERED_MODEL_TYPE:
        return dict(config)
    if not isinstance(config.get(_BASE_PREFIX + "model_type"), str):
        raise ValueError(f"a {STEERED_MODEL_TYPE} config.json without rpb_base_model_type")
    out = {k: v for k, v in config.items() if k not in _REPLACED_KEYS and not k.startswith("rpb_")}
    for key in _REPLACED_KEYS:
        if _BASE_PREFIX + key in config:
            out[key] = config[_BASE_PREFIX + key]
    return out


def saved_model_type(model_dir: str | Path) -> str | None:
    """The family's model type of a saved model folder (a steered folder's rpb_base_model_type)."""
    return base_config_dict(_read_config(Path(model_dir) / "config.json")).get("model_type")


def is_steered_folder(model_dir: str | Path) -> bool:
    """Whether `model_dir`'s config.json has rpb's steered model type (written by
    `save_eval_routing`; older steered folders keep the family's type and are not)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and _read_config(path).get("model_type") == STEERED_MODEL_TYPE


def eval_routing_spec(model_dir: str | Path) -> MethodConfig | None:
    """The method `model_dir` keeps at evaluation (None if the model routes natively); a file
    written before MethodConfig (the family under `method`) reads as the same value."""
    path = Path(model_dir) / EVAL_ROUTING_DIR / _METHOD_FILE
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    return MethodConfig.from_dict(spec, where=str(path))


def attach_eval_routing(model: nn.Module, model_dir: str | Path) -> RouterMethod | None:
    """Re-attach the routing saved with `model_dir` to `model` (loaded from it); None if the
    model routes natively. The caller detaches the returned method when done.

    A model that carries its routing attached already (`model.rpb_eval_routing`, as a steered
    folder loads) gets none twice: that method is returned."""
    spec = eval_routing_spec(model_dir)
    if spec is None:
        return None
    carried = getattr(model, STEERING_ATTR, None)
    if isinstance(carried, RouterMethod) and carried.control is not None:
        return carried
    folder = Path(model_dir) / EVAL_ROUTING_DIR
    method = spec.build()
    prior_path = folder / _PRIOR_FILE
    prior = RouterPrior.load(prior_path) if prior_path.is_file() else None
    method.attach(model, prior)
    state_path = folder / _STATE_FILE
    if state_path.is_file():
        method.load_state_dict(load_file(str(state_path)))
    # A plain attribute (RouterMethod is no nn.Module): the model's state_dict is unchanged.
    setattr(model, STEERING_ATTR, method)
    return method


def load_model(model_dir: str | Path, *, steer: bool = True, **kwargs: Any) -> PreTrainedModel:
    """The causal LM saved in `model_dir`, with transformers' own class of its family: routing as
    it is evaluated (`steer`: its saved eval routing attached, `model.rpb_eval_routing`) or with
    its saved routers alone. `kwargs` go to `from_pretrained` (dtype, device_map, ...).

    A steered folder loads through its own model type (`RpbSteeredForCausalLM`, registered with
    transformers by this module: no remote code), so its config is built from the same keywords
    as for any folder; a folder saved before steered folders had a type of their own loads as it
    always did and has its routing attached here."""
    if is_steered_folder(model_dir):
        return AutoModelForCausalLM.from_pretrained(model_dir, rpb_steer=steer, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if steer:
        attach_eval_routing(model, model_dir)
    return model


class RpbSteeredConfig(PreTrainedConfig):
    """The config of a steered folder (config.json's model type `rpb_steered`).

    `base_config` is the family's own config, built from the folder's config.json as transformers
    builds it for an unsteered folder (the same loading keywords absorbed); attributes this config
    lacks are read from it (`num_hidden_layers`, ...)."""

    model_type = STEERED_MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return_unused_kwargs = kwargs.pop("return_unused_kwargs", False)
        family = base_config_dict(config_dict)
        base_type = family.get("model_type")
        if base_type not in CONFIG_MAPPING:
            raise ValueError(
                f"{STEERED_MODEL_TYPE}: the family's model type {base_type!r} is not one this "
                "transformers knows"
            )
        base, unused = CONFIG_MAPPING[base_type].from_dict(
            family, return_unused_kwargs=True, **kwargs
        )
        config = cls(
            **{
                k: v
                for k, v in config_dict.items()
                if k in ("architectures", "auto_map") or k.startswith("rpb_")
            }
        )
        config.base_config = base
        config._name_or_path = base._name_or_path
        return (config, unused) if return_unused_kwargs else config

    def __getattr__(self, name: str) -> Any:
        # Only for names not found otherwise; none before base_config is set (within __init__).
        base = self.__dict__.get("base_config")
        if base is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(base, name)


class RpbSteeredForCausalLM:
    """The loader a steered folder's auto_map names for AutoModelForCausalLM: `from_pretrained`
    returns the family's own transformers model (e.g. Qwen3MoeForCausalLM) with the folder's eval
    routing attached. It is never instantiated itself."""

    config_class = RpbSteeredConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "RpbSteeredForCausalLM loads a saved steered folder: use "
            "AutoModelForCausalLM.from_pretrained(folder) (rpb.eval_routing imported) or "
            "rpb.eval_routing.load_model(folder)"
        )

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoModelForCausalLM") -> None:
        """Called by transformers on a class an auto_map names; nothing to record here."""

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a steered model (rpb_steered) is loaded from its folder, with its saved routing: "
            "AutoModelForCausalLM.from_pretrained(folder) or rpb.eval_routing.load_model(folder)"
        )

    _from_config = from_config

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *model_args: Any,
        config: RpbSteeredConfig | None = None,
        rpb_steer: bool = True,
        **kwargs: Any,
    ) -> PreTrainedModel:
        """The family's model from the folder, its config `config.base_config`, the keywords as
        transformers' AutoModelForCausalLM passes them to a family's class; with its saved
        routing attached unless `rpb_steer` is false."""
        from transformers.models.auto.auto_factory import _get_model_class
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        folder = Path(pretrained_model_name_or_path)
        if not folder.is_dir():
            raise ValueError(
                f"{pretrained_model_name_or_path}: a steered model (rpb_steered) loads from a "
                "local folder (download the repository first)"
            )
        check_steered_module(folder)
        if not isinstance(config, RpbSteeredConfig):
            # Called directly: the Auto class builds the config from the keywords and calls back
            # (the type is registered, so it does without remote code).
            return AutoModelForCausalLM.from_pretrained(
                folder, *model_args, rpb_steer=rpb_steer, **kwargs
            )
        if rpb_steer and eval_routing_spec(folder) is None:
            raise ValueError(
                f"{folder}: config.json says {STEERED_MODEL_TYPE} but {EVAL_ROUTING_DIR}/"
                f"{_METHOD_FILE} is missing (an incomplete steered folder)"
            )
        base = config.base_config
        model_class = _get_model_class(base, MODEL_FOR_CAUSAL_LM_MAPPING)
        model = model_class.from_pretrained(folder, *model_args, config=base, **kwargs)
        if rpb_steer:
            method = attach_eval_routing(model, folder)
            log.info("%s: routing at evaluation with %r (%s/)", folder, method, EVAL_ROUTING_DIR)
        return model


def load_for_inference(
    model_dir: Path, *, trust_remote_code: bool = False, experts_implementation: str | None = None
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """Tokenizer and eval-mode model of `model_dir`: fp32 on the CPU, or bf16 spread over the
    visible GPUs (`device_map="auto"`) when CUDA is available, as a 16-30B model needs.

    `trust_remote_code` applies to the tokenizer only (Moonlight's needs it); the model always
    loads with transformers' own class, with `experts_implementation` (None: transformers'
    default), and routes with its saved routers alone (a steered folder too:
    `attach_eval_routing` steers it).
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    experts = {"experts_implementation": experts_implementation} if experts_implementation else {}
    if torch.cuda.is_available():
        model = load_model(
            model_dir, steer=False, dtype=torch.bfloat16, device_map="auto", **experts
        )
    else:
        model = load_model(model_dir, steer=False, dtype=torch.float32, **experts)
    return tokenizer, model.eval()


def register_steered_type() -> None:
    """Register `rpb_steered` with transformers' AutoConfig and AutoModelForCausalLM (done when
    this module is imported; calling it again is harmless). A registered type is loaded with
    these classes, not with the folder's auto_map: no trust_remote_code, no modules-cache copy."""
    from transformers import AutoConfig

    # exist_ok: registering again (a second call, a reloaded module's new classes) replaces the
    # entry; rpb_steered is no transformers type, so nothing of transformers' own is displaced.
    AutoConfig.register(STEERED_MODEL_TYPE, RpbSteeredConfig, exist_ok=True)
    AutoModelForCausalLM.register(RpbSteeredConfig, RpbSteeredForCausalLM, exist_ok=True)


register_steered_type()
