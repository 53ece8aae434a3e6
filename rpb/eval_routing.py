"""Routing that a trained model keeps at evaluation: saved beside the model, re-attached on load.

Most methods steer routing only while training, so a saved checkpoint routes natively and needs
nothing more. `hard` (and any method with `keep_bias_at_eval: true`) is meant to be evaluated with
its steering in place: base-router selection for `hard`, the prior bias for RPB. The checkpoint
cannot hold forward hooks, so `save_eval_routing` writes the method (name, strength, options, its
state such as rpb_adaptive's learned bias) and its router prior into `<model_dir>/eval_routing/`,
and `attach_eval_routing` puts the same hooks back on a freshly loaded model. Evaluation
(lm-eval) and the co-activation analysis both call it, so accuracy and structure are measured on
the routing the model is trained for.

State that the model itself can hold needs nothing here: `rpb_adaptive` on DeepSeek-V3 writes its
bias into the router's own `e_score_correction_bias` buffer, which the checkpoint saves, so the
reloaded model routes with it natively (as DeepSeek-V3 keeps its own correction bias).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import nn

from rpb.artifacts import save_safetensors, write_text
from rpb.methods import METHODS, RouterMethod, make_method
from rpb.prior import RouterPrior

EVAL_ROUTING_DIR = "eval_routing"
_METHOD_FILE = "method.json"
_PRIOR_FILE = "prior.safetensors"
_STATE_FILE = "state.safetensors"


def keeps_routing_at_eval(method: RouterMethod) -> bool:
    """Whether `method` steers routing in eval mode (its hooks must travel with the model)."""
    return bool(method.options.get("keep_bias_at_eval", False))


def save_eval_routing(
    model_dir: str | Path, method: RouterMethod, prior: RouterPrior | None
) -> Path | None:
    """Write `method` and `prior` under `model_dir/eval_routing/` if the method steers at
    evaluation; return that folder (None, and nothing written, for methods that do not)."""
    if not keeps_routing_at_eval(method):
        return None
    if method.needs_prior and prior is None:
        raise ValueError(f"save_eval_routing: method {method.name!r} needs its router prior")
    out = Path(model_dir) / EVAL_ROUTING_DIR
    out.mkdir(parents=True, exist_ok=True)
    spec = {"method": method.name, "strength": method.strength, "options": method.options}
    if prior is not None:
        prior.save(out / _PRIOR_FILE)
    state = method.state_dict()
    if state:
        save_safetensors({k: v.contiguous() for k, v in state.items()}, out / _STATE_FILE)
    # Written last: its presence marks a complete folder.
    write_text(out / _METHOD_FILE, json.dumps(spec, indent=2, sort_keys=True) + "\n")
    return out


def eval_routing_spec(model_dir: str | Path) -> dict[str, Any] | None:
    """The saved method spec of `model_dir` (None if the model routes natively at evaluation)."""
    path = Path(model_dir) / EVAL_ROUTING_DIR / _METHOD_FILE
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    missing = {"method", "strength", "options"} - set(spec)
    if missing:
        raise ValueError(f"{path}: missing key(s) {', '.join(sorted(missing))}")
    return spec


def attach_eval_routing(model: nn.Module, model_dir: str | Path) -> RouterMethod | None:
    """Re-attach the routing saved with `model_dir` to `model` (loaded from it); None if the
    model routes natively. The caller detaches the returned method when done."""
    spec = eval_routing_spec(model_dir)
    if spec is None:
        return None
    folder = Path(model_dir) / EVAL_ROUTING_DIR
    name = spec["method"]
    if name not in METHODS:
        raise ValueError(f"{folder / _METHOD_FILE}: unknown router method {name!r}")
    strength = spec["strength"] if METHODS[name].uses_strength else None
    method = make_method(name, strength=strength, **spec["options"])
    prior_path = folder / _PRIOR_FILE
    prior = RouterPrior.load(prior_path) if prior_path.is_file() else None
    method.attach(model, prior)
    state_path = folder / _STATE_FILE
    if state_path.is_file():
        method.load_state_dict(load_file(str(state_path)))
    return method
