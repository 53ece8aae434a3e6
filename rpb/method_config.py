"""One method choice as one value: `MethodConfig`, a router method's family (`kind`), strength
and options, checked and completed once, when it is made, and built into the library's
`RouterMethod` by `.build()` (one typed config per component, as OLMo-core's).

    method = MethodConfig("rpb", 0.25, {"keep_bias_at_eval": True})
    method.strength                  # 0.25; MethodConfig("rpb").strength is rpb's default, 1.0
    method.options.keep_bias_at_eval # the family's options as a frozen dataclass
    router_method = method.build()   # rpb.methods.RPB(strength=0.25, ...), not yet attached

It is what a config's `methods.<label>` entry becomes (`from_entry`; rpb.pipeline.plan), what a
training job gets on its command line and records in its train_history.json, what a steered model
folder keeps (rpb.eval_routing) and what MLflow logs (`method_params`): each
spells it `to_dict()`'s way, {"kind", "strength", "options"}, and reads it back with `from_dict`,
which also reads the spellings written before it. Torch-free until `.build()`: the planner holds
it at every Snakefile parse.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any

from rpb.specs import METHOD_SPECS, check_method, method_spec

if TYPE_CHECKING:
    from rpb.methods import RouterMethod

__all__ = ["MethodConfig", "options_class"]

# What a value is spelled with (`to_dict`), and what files written before it call the family:
# `name` (a training job's `--method` and train_history.json), `method` (a steered model folder's
# eval_routing/method.json).
KEYS = ("kind", "strength", "options")
_EARLIER_KIND_KEYS = ("name", "method")
# What an option left out of an earlier spelling meant where its family's default has changed
# since: rpb's bias was dropped at evaluation by default until issue 58 made table 1's reading,
# kept at evaluation, rpb's default.
_EARLIER_DEFAULTS = {"rpb": {"keep_bias_at_eval": False}}


@functools.cache
def options_class(kind: str) -> type:
    """The frozen dataclass of method family `kind`'s options, one field per option of its spec
    (rpb.specs.METHOD_SPECS) with the spec's default (`RpbOptions(bias_on='selection',
    keep_bias_at_eval=False)`)."""
    spec = METHOD_SPECS[kind]
    fields = [
        (key, type(option.default), dataclasses.field(default=option.default))
        for key, option in spec.options.items()
    ]
    name = "".join(part.title() for part in spec.name.split("_")) + "Options"
    return dataclasses.make_dataclass(name, fields, frozen=True)


@dataclass(frozen=True)
class MethodConfig:
    """A router method: its family `kind` (a key of rpb.specs.METHOD_SPECS), its `strength` (a
    float, the family's default when made without one; None for a family that takes none;
    "family" for lbl's model-family coefficient) and its `options` (the family's options
    dataclass, `options_class`; made from a mapping of the options to set, the rest at their
    defaults).

    Made through rpb.specs.check_method, so a bad value is refused when the value is made, in one
    line that starts with `key` (a config's `methods.<label>`) when one is given."""

    kind: str
    strength: float | str | None = None
    options: Any = None
    key: InitVar[str | None] = None

    def __post_init__(self, key: str | None) -> None:
        given = self.options
        if dataclasses.is_dataclass(given) and not isinstance(given, type):
            given = dataclasses.asdict(given)
        strength, options = check_method(self.kind, self.strength, given, key)
        # Frozen: the checked values replace what was given, once, here.
        object.__setattr__(self, "strength", strength)
        object.__setattr__(self, "options", options_class(self.kind)(**options))

    @classmethod
    def from_entry(cls, label: str, entry: Mapping[str, Any] | None) -> MethodConfig:
        """A config's `methods.<label>` entry (its `kind`, the label itself when it sets none;
        `strength`; `options`); a bad value names its key, `methods.<label>.strength`, ..."""
        entry = entry or {}
        options = entry.get("options") or {}
        return cls(entry.get("kind", label), entry.get("strength"), options, f"methods.{label}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "method") -> MethodConfig:
        """The value `to_dict` wrote. Also what was written before it, read alike: the family
        under `name` or `method`, a null strength for the family's default, options left out
        at the defaults of then (`_EARLIER_DEFAULTS`), and a strength 0.0 where the family takes
        none (what a steered `hard` folder kept). Anything else is refused in one line starting
        with `where`."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: {data!r} is not a mapping of {', '.join(KEYS)}")
        data = dict(data)
        earlier = [key for key in _EARLIER_KIND_KEYS if key in data]
        if "kind" not in data and len(earlier) == 1:
            data["kind"] = data.pop(earlier[0])
            data["options"] = {
                **_EARLIER_DEFAULTS.get(data["kind"], {}),
                **(data.get("options") or {}),
            }
            spec = METHOD_SPECS.get(data["kind"])
            if spec is not None and not spec.uses_strength and data.get("strength") == 0:
                data["strength"] = None
        unknown = sorted(set(data) - set(KEYS))
        if unknown or "kind" not in data:
            problem = f"unknown key(s) {', '.join(unknown)}" if unknown else "no 'kind'"
            raise ValueError(f"{where}: {problem} (a method is {', '.join(KEYS)})")
        try:
            return cls(data["kind"], data.get("strength"), data.get("options") or {})
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    @classmethod
    def of(cls, method: RouterMethod) -> MethodConfig:
        """The value a built method is (after attach: lbl's "family" as the number it read)."""
        strength = method.strength if method.uses_strength else None
        return cls(method.name, strength, method.options)

    def to_dict(self, *, defaults: bool = True) -> dict[str, Any]:
        """{"kind", "strength", "options"}: every option, or with `defaults` false only those
        off the family's default (a training job's command line, so that a new option, at a
        default that keeps what the family did, reruns nothing)."""
        options = dataclasses.asdict(self.options)
        if not defaults:
            spec = method_spec(self.kind).option_defaults
            options = {key: value for key, value in options.items() if value != spec[key]}
        return {"kind": self.kind, "strength": self.strength, "options": options}

    @property
    def keeps_routing_at_eval(self) -> bool:
        """Whether the method steers routing in eval mode too (`keep_bias_at_eval`, `hard`'s by
        default): its routing travels with the trained model (rpb.eval_routing)."""
        return bool(getattr(self.options, "keep_bias_at_eval", False))

    @property
    def gradient_path(self) -> str:
        """What reaches the router weight (rpb.methods.GRADIENT_PATHS; docs/methods.md)."""
        return self.build().gradient_path

    def build(self) -> RouterMethod:
        """The library's router method of this value, not yet attached (rpb.methods)."""
        from rpb.methods import make_method

        return make_method(self.kind, self.strength, **dataclasses.asdict(self.options))


def method_params(label: str, method: MethodConfig | None) -> dict[str, Any]:
    """What a post-training method is beside its label (the schema's `method`): its
    MethodConfig's `kind`, `strength` and `options` (JSON, every option), flat, never
    `method.<key>`; a strength of "-" for a family that takes none, and the label as the `kind` of
    a model without a method (the base)."""
    spelled = method.to_dict() if method is not None else {"kind": label, "options": {}}
    strength = spelled.get("strength")
    return {
        "kind": spelled["kind"],
        "strength": "-" if strength is None else strength,
        "options": json.dumps(spelled["options"], sort_keys=True),
    }
