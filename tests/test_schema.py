"""The config has one description: the schema (workflow/schemas/config.schema.yaml), which
rpb.pipeline.config_check validates and fills in, and the typed config the planner parses it into
(rpb.pipeline.plan.PipelineConfig) agree key by key; the training settings are TrainSpec's fields,
written into the schema by rpb.pipeline.schema, never by hand.

- The typed config against the schema: every field of PipelineConfig and of the dataclasses it is
  made of reads a key the schema has, of the same JSON types and nullability; every key of the
  schema is read by a field, or passed on as is (by a field `entry`, or a mapping the planner does
  not look into); where the planner reads an absent key as a value of its own, that value is the
  schema's default.
- TrainSpec against the schema: the generated blocks of `posttrain` and `models.<name>.pretrain`
  are what `python -m rpb.pipeline.schema --write` writes; every TrainSpec field says whether a
  config sets it; the sections' other keys are the ones the planner takes out before TrainSpec.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from rpb.pipeline.config_check import check_config
from rpb.pipeline.plan import PipelineConfig, Plan, frozen
from rpb.pipeline.schema import SECTIONS, generate, train_settings
from rpb.specs import Run

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"

# Typed fields whose key has another name or place: a dotted path below the field's section, or
# "" where the field's dataclass reads keys of the same section.
KEYS = {
    "PipelineConfig.results": "results_dir",
    "PipelineConfig.probe_tasks": "analysis.probe_tasks",
    "PipelineConfig.probe_limit": "analysis.probe_limit",
    "PipelineConfig.table_seeds": "tables.seeds",
    "PipelineConfig.execution": "",
    "MethodEntry.method": "",
    "Execution.tracking_uri": "tracking.uri",
    "Execution.experiment": "tracking.experiment",
}
# Typed fields that no key holds: the parse derives them.
DERIVED = {"ModelConfig.name", "MethodEntry.label"}
# A field of this name holds its whole section as the config check left it (a job's spec starts
# from it): every key of the section is read.
ENTRY = "entry"
# Typed fields that read the schema's null as a value of their own type.
NULL_READ = {"Evaluation.limit": "null (no limit) is read as 0"}
# The keys of the training sections that are no TrainSpec field: the planner takes them out
# (Plan.posttrain_spec, Plan.pretrain_spec) before a job reads the rest as its TrainSpec.
PLANNER_KEYS = {"posttrain": {"lr_by_base"}, "pretrain": {"lbl_coef"}}
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
NO_DEFAULT = object()


def load_schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA.read_text())


def _checked(*names: str) -> dict[str, Any]:
    from snakemake.utils import update_config

    config: dict[str, Any] = {}
    for name in names:
        update_config(config, yaml.safe_load((ROOT / "config" / name).read_text()))
    check_config(config, SCHEMA)
    return config


def dotted(keys: tuple[str, ...]) -> str:
    return ".".join(keys).replace(".[]", "[]")


def non_null(hint: Any) -> Any:
    """`X` of `X | None` (and `X` itself)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def typed_types(hint: Any) -> set[str]:
    """The JSON types a typed field holds (empty: any)."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    out = set()
    for arg in typing.get_args(hint) if union else (hint,):
        origin = typing.get_origin(arg) or arg
        if arg is Any:
            return set()
        if dataclasses.is_dataclass(origin) or origin is Mapping:
            out.add("object")
        elif origin is tuple:
            out.add("array")
        else:
            out.add(JSON_TYPES[origin])
    return out


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A typed field of one key: its attribute path from PipelineConfig and its key path in the
    config (`<name>` for any entry of a mapping in both), and the schema's default."""

    attrs: tuple[str, ...]
    keys: tuple[str, ...]
    default: Any


class Comparison:
    """Walks PipelineConfig's dataclasses and the schema together: `problems`, each one line, and
    `leaves`, the fields that read one key of a plain value."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.schema = schema
        self.problems: list[str] = []
        self.leaves: list[Leaf] = []
        self.compare(PipelineConfig, [schema], (), ())

    def resolve(self, node: Any) -> Any:
        while isinstance(node, Mapping) and "$ref" in node:
            target: Any = self.schema
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            node = target
        return node

    def lookup(self, shape: Any, key: str) -> tuple[Any, bool] | None:
        """The property at dotted `key` of object schema `shape`, and whether it is required."""
        node, required = self.resolve(shape), True
        for part in key.split("."):
            if part not in (node.get("properties") or {}):
                return None
            required = required and part in node.get("required", ())
            node = self.resolve(node["properties"][part])
        return node, required

    def schema_types(self, node: Any) -> set[str]:
        """The JSON types a property accepts (empty: any)."""
        node = self.resolve(node)
        if "enum" in node:
            return {JSON_TYPES[type(v)] for v in node["enum"]}
        kind = node.get("type", ())
        return {kind} if isinstance(kind, str) else set(kind)

    def compare(
        self,
        cls: type,
        shapes: list[Any],
        attrs: tuple[str, ...],
        keys: tuple[str, ...],
        whole_section: bool = True,
    ) -> set[str]:
        """Check dataclass `cls` against `shapes`, the object schemas of the section it reads (a
        mapping's entries may have several: the tables); return the keys it reads. With
        `whole_section`, each key of the section must be read."""
        hints = typing.get_type_hints(cls)
        read: set[str] = set()
        pending = []
        passes_on = False
        for f in dataclasses.fields(cls):
            name = f"{cls.__name__}.{f.name}"
            if name in DERIVED:
                continue
            if f.name == ENTRY:
                passes_on = True
                continue
            key = KEYS.get(name, f.name)
            if key == "":
                read |= self.compare(hints[f.name], shapes, (*attrs, f.name), keys, False)
                continue
            read.add(key)
            pending.append((name, f.name, key, hints[f.name]))
        for name, attr, key, hint in pending:
            path = (*keys, *key.split("."))
            found = [hit for shape in shapes if (hit := self.lookup(shape, key))]
            if not found:
                self.problems.append(f"{name}: the schema has no key {dotted(path)}")
                continue
            nodes = [node for node, _ in found]
            optional = len(found) < len(shapes) or not all(req for _, req in found)
            self.check_type(name, hint, nodes, optional, path)
            self.descend(hint, nodes, (*attrs, attr), path, read, key)
        if whole_section and not passes_on:
            for shape in shapes:
                self.unread(cls, self.resolve(shape), read, keys, "")
        return read

    def check_type(
        self, name: str, hint: Any, nodes: list[Any], optional: bool, path: tuple[str, ...]
    ) -> None:
        typed = typed_types(hint)
        where = dotted(path)
        for node in nodes:
            accepted = self.schema_types(node)
            if not typed or not accepted:
                continue
            if typed - {"null"} != accepted - {"null"}:
                self.problems.append(
                    f"{name} holds {sorted(typed - {'null'})}; the schema's {where} is "
                    f"{sorted(accepted - {'null'})}"
                )
            if "null" in accepted and "null" not in typed and name not in NULL_READ:
                self.problems.append(f"{name} is never None; the schema's {where} may be null")
        nullable = any("null" in self.schema_types(node) for node in nodes)
        if "null" in typed and not optional and not nullable:
            self.problems.append(f"{name} may be None; the schema requires {where}, not null")

    def descend(
        self,
        hint: Any,
        nodes: list[Any],
        attrs: tuple[str, ...],
        path: tuple[str, ...],
        siblings: set[str],
        key: str,
    ) -> None:
        inner = non_null(hint)
        origin, args = typing.get_origin(inner), typing.get_args(inner)
        if dataclasses.is_dataclass(inner):
            self.compare(inner, nodes, attrs, path)
        elif origin is Mapping and dataclasses.is_dataclass(args[1]):
            # Every entry of the mapping: free-named ones and the named ones no other field reads.
            taken = {k.removeprefix(f"{key}.") for k in siblings if k.startswith(f"{key}.")}
            entries = []
            for node in map(self.resolve, nodes):
                if isinstance(node.get("additionalProperties"), Mapping):
                    entries.append(node["additionalProperties"])
                props = node.get("properties") or {}
                entries += [sub for k, sub in props.items() if k not in taken]
            self.compare(args[1], entries, (*attrs, "<name>"), (*path, "<name>"))
        elif origin is tuple and dataclasses.is_dataclass(args[0]):
            items = [self.resolve(node)["items"] for node in nodes]
            self.compare(args[0], items, (*attrs, "[]"), (*path, "[]"))
        else:
            defaults = [n["default"] for n in map(self.resolve, nodes) if "default" in n]
            self.leaves.append(Leaf(attrs, path, defaults[0] if defaults else NO_DEFAULT))

    def unread(
        self, cls: type, node: Any, read: set[str], keys: tuple[str, ...], prefix: str
    ) -> None:
        for key, sub in (node.get("properties") or {}).items():
            full = prefix + key
            if full in read:
                continue
            if any(r.startswith(f"{full}.") for r in read):
                self.unread(cls, self.resolve(sub), read, keys, f"{full}.")
                continue
            where = dotted((*keys, *full.split(".")))
            self.problems.append(f"{where}: no field of {cls.__name__} reads it")


# --- the typed config against the schema ---------------------------------------------------------


def test_every_typed_field_reads_a_schema_key_of_its_type_and_every_key_is_read() -> None:
    comparison = Comparison(load_schema())
    assert comparison.problems == []
    # The walk reached the nested dataclasses, renamed keys and mapping entries.
    keys = {dotted(leaf.keys) for leaf in comparison.leaves}
    for key in ("tracking.experiment", "tables.<name>.lower", "sweep.curves[].labels"):
        assert key in keys


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda s: s["properties"]["evaluation"]["properties"].pop("batch_size"),
            "Evaluation.batch_size: the schema has no key evaluation.batch_size",
        ),
        (
            lambda s: s["properties"]["evaluation"]["properties"].update(extra={"type": "string"}),
            "evaluation.extra: no field of Evaluation reads it",
        ),
        (
            lambda s: s["properties"]["tracking"]["properties"].update(port={"type": "integer"}),
            "tracking.port: no field of PipelineConfig reads it",
        ),
        (
            lambda s: s["properties"]["data"]["properties"]["level"].update(type="number"),
            "DataConfig.level holds ['integer']; the schema's data.level is ['number']",
        ),
        (
            lambda s: s["properties"]["table1"]["properties"]["model"].update(
                type=["string", "null"]
            ),
            "Table1.model is never None; the schema's table1.model may be null",
        ),
        (
            lambda s: (
                s["properties"]["data"].update(required=["seed", "preset", "holdout"])
                or s["properties"]["data"]["properties"]["holdout"].update(type="string")
            ),
            "DataConfig.holdout may be None; the schema requires data.holdout, not null",
        ),
        (
            lambda s: s["$defs"]["method"]["properties"].pop("prior"),
            "MethodEntry.prior: the schema has no key methods.<name>.prior",
        ),
        (
            lambda s: s["properties"]["sweep"]["properties"]["curves"]["items"]["properties"].pop(
                "name"
            ),
            "SweepCurve.name: the schema has no key sweep.curves[].name",
        ),
    ],
)
def test_the_comparison_names_a_drift(edit: Any, problem: str) -> None:
    schema = load_schema()
    edit(schema)
    assert any(p.startswith(problem) for p in Comparison(schema).problems), problem


def test_the_planners_own_defaults_are_the_schemas() -> None:
    """A key left out of a checked config: the planner either fails (it reads the default the
    schema filled in) or reads None (the key's absence), or reads the schema's default."""
    config = _checked("config.yaml")
    leaves = [
        leaf
        for leaf in Comparison(load_schema()).leaves
        if leaf.default is not NO_DEFAULT and "[]" not in leaf.keys
    ]
    compared = []
    for leaf in leaves:
        for name in _entry_names(config, leaf.keys):
            keys = [name if k == "<name>" else k for k in leaf.keys]
            edited = copy.deepcopy(config)
            parent = edited
            for key in keys[:-1]:
                parent = parent.get(key) if isinstance(parent, Mapping) else None
            if not isinstance(parent, Mapping) or keys[-1] not in parent:
                continue
            del parent[keys[-1]]
            try:
                value: Any = PipelineConfig.parse(edited)
            except KeyError:
                continue
            for attr in leaf.attrs:
                value = value[name] if attr == "<name>" else getattr(value, attr)
            if value is None:
                continue
            compared.append(".".join(keys))
            assert value == frozen(leaf.default), (".".join(keys), value, leaf.default)
    assert {"results_dir", "evaluation.batch_size", "data.level", "tracking.experiment"} <= set(
        compared
    )


def _entry_names(config: Mapping[str, Any], keys: tuple[str, ...]) -> list[str | None]:
    """The names a key path's `<name>` stands for in `config` (the mapping entries there)."""
    if "<name>" not in keys:
        return [None]
    node: Any = config
    for key in keys[: keys.index("<name>")]:
        node = node.get(key, {})
    return [name for name, entry in node.items() if isinstance(entry, Mapping)]


# --- TrainSpec against the schema --------------------------------------------------------------


def test_the_schemas_training_settings_are_written_from_trainspec() -> None:
    """Stale: run `python -m rpb.pipeline.schema --write`."""
    text = SCHEMA.read_text()
    assert generate(text) == text


def test_a_stale_training_setting_is_seen() -> None:
    text = SCHEMA.read_text()
    stale = text.replace("      log_every: {type: integer, minimum: 1}\n", "", 1)
    assert stale != text and generate(stale) == text
    with pytest.raises(ValueError, match="no generated block for pretrain"):
        generate(text.replace("# TrainSpec's pretrain settings", "# pretrain settings"))


def test_every_trainspec_field_says_whether_a_config_sets_it() -> None:
    from rpb.pipeline.training import CONFIG_SETTING, TrainSpec

    for f in dataclasses.fields(TrainSpec):
        assert CONFIG_SETTING in f.metadata, f"TrainSpec.{f.name}: no _setting(...) metadata"
        assert set(f.metadata[CONFIG_SETTING]["sections"]) <= set(SECTIONS), f.name


def _section(schema: Mapping[str, Any], section: str) -> Mapping[str, Any]:
    if section == "pretrain":
        return schema["$defs"]["model"]["properties"]["pretrain"]
    return schema["properties"][section]


def test_a_training_sections_other_keys_are_the_planners() -> None:
    """posttrain and pretrain hold TrainSpec's settings (required: those without a default) and
    the keys the planner takes out; what the planner hands a job is a TrainSpec."""
    from rpb.pipeline.training import TrainSpec

    schema = load_schema()
    fields = {f.name: f for f in dataclasses.fields(TrainSpec)}
    for section in SECTIONS:
        node, generated = _section(schema, section), train_settings(section)
        assert set(node["properties"]) - set(generated) == PLANNER_KEYS[section]
        assert not PLANNER_KEYS[section] & set(fields)
        required = {k for k in generated if fields[k].default is dataclasses.MISSING}
        assert set(node["required"]) & set(fields) == required
    plan = Plan(PipelineConfig.parse(_checked("config.yaml")))
    for spec in (plan.posttrain_spec("tinyA", Run(1, 1)), plan.pretrain_spec("tinyA")):
        assert not set(spec) & set().union(*PLANNER_KEYS.values())
        TrainSpec.from_dict(spec)


def test_the_schema_has_no_key_twice() -> None:
    """YAML keeps the last of two equal keys: a hand-written copy of a generated training setting
    would win silently."""

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader: Strict, node: yaml.MappingNode) -> dict[Any, Any]:
        keys = [loader.construct_object(k) for k, _ in node.value]
        twice = {k for k in keys if keys.count(k) > 1}
        assert not twice, f"{SCHEMA.name}:{node.start_mark.line + 1}: {sorted(twice)} twice"
        return loader.construct_mapping(node)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    assert yaml.load(SCHEMA.read_text(), Loader=Strict) == load_schema()


def test_the_regimes_trainable_choices_are_posttrains() -> None:
    """diagnostics.regime.trainable names a posttrain.trainable (rpb.specs.TRAINABLE)."""
    from rpb.specs import TRAINABLE

    schema = load_schema()
    regime = schema["properties"]["diagnostics"]["properties"]["regime"]["properties"]
    assert regime["trainable"]["enum"] == list(TRAINABLE)
    assert train_settings("posttrain")["trainable"]["enum"] == list(TRAINABLE)
