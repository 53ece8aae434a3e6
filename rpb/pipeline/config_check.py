"""Validate the pipeline config before any job runs; every problem is one line naming its key.

`check_config` validates against the JSON schema (workflow/schemas/config.schema.yaml), fills the
schema's defaults in place as Snakemake's `validate` does, runs the cross-key checks a schema
cannot express (names that must refer to other keys, wildcard-safe names), and parses the config
once into the planner's `PipelineConfig`, which checks each method's strength and options.
It imports neither torch nor transformers: the Snakefile calls it at every parse.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError, best_match

from rpb.pipeline.plan import PipelineConfig
from rpb.specs import EVAL_SETS, METHOD_SPECS, replicate_name

__all__ = [
    "METHOD_FAMILIES",
    "ConfigError",
    "check_config",
    "check_yaml_syntax",
    "format_key_path",
]

# What a config may name comes from rpb.specs (torch-free, like this module): the method families
# (a method's strength and options are checked where its MethodConfig is made), the tiny eval sets.
METHOD_FAMILIES = tuple(METHOD_SPECS)
RESERVED_METHOD_LABELS = ("base",)
# The tiny testbed's eval sets (rpb.pipeline.data): the OOD ones and the eval-only ones may be
# scored out of domain; any other evaluation name is a standard lm-eval task.
TINY_EVAL_SETS = {
    "in_domain": EVAL_SETS["in_domain"],
    "ood": (*EVAL_SETS["ood"], *EVAL_SETS["eval_only"]),
}
# Must match the `model` wildcard constraint in workflow/rules/common.smk, or no rule would match.
MODEL_NAME = re.compile(r"[A-Za-z0-9_]+")
# PyYAML (YAML 1.1, which Snakemake uses) reads `1e-3` as a string; it needs `1.0e-3`.
_YAML_FLOAT_TEXT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


class ConfigError(ValueError):
    """A config value that is wrong; the message is one line, starting with the key path."""


def format_key_path(path: Iterable[str | int]) -> str:
    """`['seeds', 1]` -> `seeds[1]`, `['methods', 'rpb', 'strength']` -> `methods.rpb.strength`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _is_integer(_checker: Any, instance: Any) -> bool:
    # jsonschema accepts 1.0 as an integer; a seed of 1.0 would name files `seed1.0.json`.
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_number(_checker: Any, instance: Any) -> bool:
    # YAML's .nan passes every minimum/maximum check (comparisons are False), so reject it here.
    return (
        isinstance(instance, int | float)
        and not isinstance(instance, bool)
        and math.isfinite(instance)
    )


def _with_defaults(validator_class: type) -> type:
    """The jsonschema FAQ's default-filling validator, safe on non-object instances."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator: Any, properties: Any, instance: Any, schema: Any) -> Any:
        # The FAQ recipe calls setdefault unconditionally and crashes on `tracking: 5`.
        if isinstance(instance, MutableMapping):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    checker = validator_class.TYPE_CHECKER.redefine_many(
        {"integer": _is_integer, "number": _is_number}
    )
    return validators.extend(validator_class, {"properties": set_defaults}, type_checker=checker)


_Validator = _with_defaults(Draft202012Validator)


def _suggest(name: str, choices: Iterable[str]) -> str:
    """`did you mean 'x'? ` for the closest choice (case-insensitive first), else ''."""
    choices = [str(c) for c in choices]
    same = [c for c in choices if c.lower() == str(name).lower()]
    close = same or difflib.get_close_matches(str(name), choices, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _duplicate(items: Sequence[Any]) -> Any:
    """The first item that occurs twice (items may be unhashable), else None."""
    return next((x for i, x in enumerate(items) if x in items[:i]), None)


def _resolve_ref(root: Mapping[str, Any], ref: str) -> Any:
    if not ref.startswith("#/"):
        return {}
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _parents(root: Mapping[str, Any], schema_path: Sequence[Any]) -> list[tuple[Any, Any]]:
    """(schema node, key) along an error's absolute_schema_path, which omits the `$ref` hops."""
    pairs = []
    node: Any = root
    for key in schema_path:
        while isinstance(node, Mapping) and key not in node and "$ref" in node:
            node = _resolve_ref(root, node["$ref"])
        pairs.append((node, key))
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            break
    return pairs


def _condition(if_schema: Any) -> str:
    """`{properties: {source: {const: hub}}}` -> `source is 'hub'`."""
    props = if_schema.get("properties", {}) if isinstance(if_schema, Mapping) else {}
    parts = [f"{k} is {v['const']!r}" for k, v in props.items() if "const" in v]
    return " and ".join(parts)


def _describe(error: ValidationError, schema: Mapping[str, Any]) -> tuple[list[Any], str]:
    """Key path and problem for one schema error, phrased for someone editing the YAML."""
    path = list(error.absolute_path)
    instance, value = error.instance, error.validator_value
    kind = error.validator
    if kind == "additionalProperties" and value is False and isinstance(instance, Mapping):
        known = list(error.schema.get("properties", {}))
        extra = sorted(str(k) for k in instance if k not in known)
        if extra:
            hint = _suggest(extra[0], known).rstrip() or f"known: {', '.join(known)}"
            return [*path, extra[0]], f"unknown key ({hint})"
    if kind == "required" and isinstance(instance, Mapping):
        missing = [k for k in value if k not in instance]
        if missing:
            problem = "missing required key"
            # A key required by an if/then rule: say under which condition.
            for parent, key in _parents(schema, list(error.absolute_schema_path)):
                if key == "then" and isinstance(parent, Mapping) and "if" in parent:
                    condition = _condition(parent["if"])
                    if condition:
                        problem += f" (required when {condition})"
            return [*path, missing[0]], problem
    if "propertyNames" in error.absolute_schema_path:
        return [*path, str(instance)], f"name must match {value}"
    if kind == "uniqueItems" and isinstance(instance, list):
        return path, f"duplicate value {_duplicate(instance)!r} in {instance}"
    if kind == "type" and isinstance(instance, str) and _YAML_FLOAT_TEXT.fullmatch(instance):
        return path, (
            f"{instance!r} is text, not a number: YAML needs a dot in exponent notation "
            f"(write {float(instance)!r})"
        )
    if kind == "type" and isinstance(instance, float) and not math.isfinite(instance):
        return path, f"{instance} is not a finite number"
    if kind == "type" and (instance is None or isinstance(instance, bool)):
        # Say it as the YAML was written: `null`/`true`, not Python's None/True.
        hint = " (write {} for an empty mapping)" if instance is None and value == "object" else ""
        return path, f"{json.dumps(instance)} is not of type {value!r}{hint}"
    return path, error.message


def _load_schema(schema_path: Path | str) -> dict[str, Any]:
    path = Path(schema_path)
    if not path.is_file():
        raise FileNotFoundError(f"config schema not found: {path}")
    # libyaml's parser where PyYAML has it: the same documents, 9x faster on the schema (every
    # Snakefile parse and config check reads it).
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _table_shapes() -> dict[str, Any]:
    """The shape of every table the pipeline plans, by key (rpb.report.registry: each table's
    module declares it)."""
    from rpb.report.registry import REPORTS

    return {key: job.shape for key, job in REPORTS.items() if job.shape is not None}


def table_schema(shape: Any) -> dict[str, Any]:
    """The schema of a `tables.<name>` entry of `shape` (rpb.report.registry.Shape): its `model`
    or `models`, its `corpus` or `corpora`, each key naming labels a list of them, and for an
    exploratory table its own `seeds`; nothing else. `Shape()`'s is the schema's `$defs/table`."""
    names = {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"type": "string"}}
    properties: dict[str, Any] = {
        "models" if shape.models else "model": names if shape.models else {"type": "string"},
        "corpora" if shape.corpora else "corpus": names if shape.corpora else {"type": "string"},
    }
    properties |= {key: {"$ref": "#/$defs/labels"} for key in shape.entry_keys}
    required = list(properties)
    if shape.exploratory:
        properties["seeds"] = {"$ref": "#/$defs/exploratory_seeds"}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
    }


def _with_table_schemas(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with an entry under `tables` for each table the file names none for, from its
    shape: a table of any shape is its module (the file keeps the entries it names)."""
    tables = schema.get("properties", {}).get("tables")
    if tables is not None:
        named = tables.setdefault("properties", {})
        for key, shape in _table_shapes().items():
            named.setdefault(key, table_schema(shape))
    return schema


def _schema_errors(config: Any, schema: Mapping[str, Any]) -> None:
    errors = list(_Validator(schema).iter_errors(config))
    if not errors:
        return
    error = best_match(errors)
    path, problem = _describe(error, schema)
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    raise ConfigError(f"{format_key_path(path)}: {problem}{more}")


def _check_method(label: str, entry: Mapping[str, Any]) -> None:
    """`methods.<label>` names a method family; its strength and options are checked where the
    config is parsed (`_parse`: rpb.method_config.MethodConfig, once)."""
    family = entry.get("kind", label)
    if label in RESERVED_METHOD_LABELS:
        raise ConfigError(f"methods.{label}: '{label}' is reserved for the untrained base")
    if family not in METHOD_FAMILIES:
        hint = _suggest(family, METHOD_FAMILIES)
        where = f"methods.{label}.kind" if "kind" in entry else f"methods.{label}"
        raise ConfigError(
            f"{where}: unknown method '{family}' ({hint}known: "
            f"{', '.join(METHOD_FAMILIES)}; set 'kind' for a variant label)"
        )


def _check_controls(config: Mapping[str, Any]) -> None:
    """The claims audit's control labels (claims.placebo, claims.permuted) and `prior` keys
    (`_check_parsed_methods`: the permuted control's strength and options)."""
    methods = config["methods"]
    for label, entry in methods.items():
        entry = entry or {}
        family = entry.get("kind", label)
        # A method that reads no router prior: a permuted one would silently change nothing.
        if entry.get("prior") == "permuted" and not METHOD_SPECS[family].needs_prior:
            raise ConfigError(
                f"methods.{label}.prior: method '{family}' reads no router prior, so a permuted "
                "one changes nothing"
            )
    claims = config.get("claims") or {}
    for key in ("placebo", "permuted"):
        label = claims.get(key)
        if label is None:
            continue
        if label not in methods:
            raise ConfigError(
                f"claims.{key}: '{label}' is not a key of methods "
                f"({_suggest(label, methods)}methods: {', '.join(methods)})"
            )
    permuted = claims.get("permuted")
    if permuted is not None:
        entry = methods[permuted] or {}
        if entry.get("prior") != "permuted":
            raise ConfigError(f"claims.permuted: methods.{permuted} lacks 'prior: permuted'")
        method = claims.get("method", "rpb")
        family = entry.get("kind", permuted)
        if family != (methods.get(method) or {}).get("kind", method):
            raise ConfigError(
                f"claims.permuted: methods.{permuted} is a '{family}', not a variant of "
                f"claims.method '{method}'"
            )


def _check_lengths(config: Mapping[str, Any]) -> None:
    """A sequence longer than the position table fails deep inside a training job."""
    models = config["models"]
    checks = [
        (name, f"models.{name}.pretrain.max_length", (spec.get("pretrain") or {}).get("max_length"))
        for name, spec in models.items()
    ]
    # Post-training settings are shared by every model; check them against the one table 1
    # trains (a paper-scale config still carries the tiny entries, with short position tables).
    model = config["table1"]["model"]
    checks.append((model, "posttrain.max_length", config["posttrain"].get("max_length")))
    for name, where, length in checks:
        limit = (models[name].get("architecture") or {}).get("max_position_embeddings")
        if limit is not None and length is not None and length > limit:
            raise ConfigError(
                f"{where}: {length} exceeds models.{name}.architecture"
                f".max_position_embeddings ({limit})"
            )


def _check_lr_by_base(config: Mapping[str, Any]) -> None:
    """`posttrain.lr_by_base` names bases that exist: a model's base0 and one per replicate."""
    models = config["models"]
    for model, rates in (config["posttrain"].get("lr_by_base") or {}).items():
        where = f"posttrain.lr_by_base.{model}"
        if model not in models or "replicate_of" in models[model]:
            known = [n for n, e in models.items() if "replicate_of" not in e]
            hint = _suggest(model, known) or f"known: {', '.join(known)}"
            raise ConfigError(f"{where}: not a model of the config; {hint.rstrip()}")
        bases = [f"base{k}" for k in range(1 + len(models[model].get("replicates") or []))]
        for base in rates:
            if base not in bases:
                raise ConfigError(f"{where}.{base}: models.{model} has bases {bases}")


def _check_architecture(name: str, model_type: str, arch: Mapping[str, Any]) -> None:
    """Settings that cannot build (or cannot route) a model; caught here, not inside a job."""
    where = f"models.{name}.architecture"

    def positive(key: str) -> int | None:
        value = arch.get(key)
        if value is None:
            return None
        if not _is_integer(None, value) or value < 1:
            raise ConfigError(f"{where}.{key}: {value!r} is not a positive integer")
        return value

    hidden, heads, kv_heads = (
        positive(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")
    )
    layers = positive("num_hidden_layers")
    if hidden and heads and arch.get("head_dim") is None and hidden % heads:
        raise ConfigError(
            f"{where}.num_attention_heads: {heads} does not divide hidden_size ({hidden}) "
            "(not divisible; set head_dim to decouple them)"
        )
    if heads and kv_heads and heads % kv_heads:
        raise ConfigError(
            f"{where}.num_key_value_heads: {kv_heads} does not divide "
            f"num_attention_heads ({heads}) (not divisible)"
        )
    from rpb.families import FAMILIES, MODEL_TYPE_ALIASES  # pure data: no torch import

    family = FAMILIES.get(MODEL_TYPE_ALIASES.get(model_type, model_type))
    expert_key = family.expert_count_key if family else None
    experts = positive(expert_key) if expert_key else None
    top_k = positive("num_experts_per_tok")
    if experts and top_k and top_k > experts:
        raise ConfigError(f"{where}.num_experts_per_tok: {top_k} exceeds {expert_key} ({experts})")
    groups, topk_group = positive("n_group"), positive("topk_group")
    if groups and experts and experts % groups:
        raise ConfigError(f"{where}.n_group: {experts} experts do not split into {groups} groups")
    if groups and topk_group and topk_group > groups:
        raise ConfigError(f"{where}.topk_group: {topk_group} exceeds n_group ({groups})")
    if groups and topk_group and experts and top_k and top_k > experts // groups * topk_group:
        raise ConfigError(
            f"{where}.num_experts_per_tok: {top_k} exceeds the {experts // groups * topk_group} "
            f"experts in the topk_group ({topk_group}) selected groups of {experts // groups}"
        )
    dense = arch.get("first_k_dense_replace")
    if layers and dense is not None and dense >= layers:
        raise ConfigError(
            f"{where}.first_k_dense_replace: {dense} leaves no MoE layer among "
            f"num_hidden_layers ({layers})"
        )


def _check_model_type(name: str, spec: Mapping[str, Any]) -> None:
    """A hub model may be of any family rpb routes, a pretrained one of any family marked
    `pretrain` (rpb.families decides, not a fixed list)."""
    from rpb.families import PRETRAIN_MODEL_TYPES, routed_model_types  # pure data: no torch

    model_type, source = spec.get("model_type"), spec.get("source")
    if source == "hub":
        known, what = routed_model_types(), "a family rpb routes"
    elif source == "pretrain":
        known, what = list(PRETRAIN_MODEL_TYPES), "a family the pipeline pretrains"
    else:
        return
    if model_type not in known:
        hint = _suggest(str(model_type), known)
        raise ConfigError(
            f"models.{name}.model_type: '{model_type}' is not {what} "
            f"({hint}known: {', '.join(known)})"
        )


def _check_calibration(config: Mapping[str, Any]) -> None:
    """data.level must be a level of the generator; the families recorded as not testable must
    be models the tables name."""
    from rpb.pipeline.data import POST_LEVELS

    known = ", ".join(map(str, POST_LEVELS))
    level = (config.get("data") or {}).get("level", 1)
    if level not in POST_LEVELS:
        raise ConfigError(f"data.level: {level} is not a difficulty level (known: {known})")
    section = config.get("calibration")
    if section is None:
        return
    for name in section.get("premise_not_met") or {}:
        entry = config["models"].get(name)
        if entry is None or "replicate_of" in entry:
            raise ConfigError(
                f"calibration.premise_not_met: '{name}' is not a model the tables name "
                f"({_suggest(name, config['models'])}models: {', '.join(config['models'])})"
            )


def _cross_key_errors(config: Mapping[str, Any]) -> None:
    if config["cpu_numerics"] != "free" and config["threads_per_job"] != 1:
        # Summation order follows the thread count: a pinned path is one thread per job.
        raise ConfigError(
            f"threads_per_job: {config['threads_per_job']} with cpu_numerics: "
            f"{config['cpu_numerics']}, which computes on one thread per job (set "
            "threads_per_job: 1, or cpu_numerics: free)"
        )
    _check_calibration(config)
    for name in config["models"]:
        if not MODEL_NAME.fullmatch(str(name)):
            raise ConfigError(f"models.{name}: model names may use only letters, digits and _")
        _check_model_type(name, config["models"][name])
    for name, spec in config["models"].items():
        _check_architecture(name, spec["model_type"], spec.get("architecture") or {})
    for label, entry in config["methods"].items():
        _check_method(label, entry or {})
    standard = (config["evaluation"].get("lm_eval") or {}).get("tasks") or {}
    for key in ("in_domain", "ood"):
        dup = _duplicate(config["evaluation"][key])
        if dup is not None:
            raise ConfigError(f"evaluation.{key}: '{dup}' is listed twice")
        for i, name in enumerate(config["evaluation"][key]):
            if name not in TINY_EVAL_SETS[key] and name not in standard:
                raise ConfigError(
                    f"evaluation.{key}[{i}]: '{name}' is neither an eval set "
                    f"({', '.join(TINY_EVAL_SETS[key])}) nor a task of evaluation.lm_eval.tasks"
                )
    probe = (config.get("analysis") or {}).get("probe_tasks") or []
    if _duplicate(probe) is not None:
        raise ConfigError(f"analysis.probe_tasks: '{_duplicate(probe)}' is listed twice")
    eval_sets = [*TINY_EVAL_SETS["in_domain"], *TINY_EVAL_SETS["ood"]]
    # An eval-only set is written beside the synthetic corpora (rule eval_only_set).
    if config["data"].get("corpora"):
        for key, names in (
            ("evaluation.ood", config["evaluation"]["ood"]),
            ("analysis.probe_tasks", probe),
        ):
            for i, name in enumerate(names):
                if name in EVAL_SETS["eval_only"]:
                    raise ConfigError(
                        f"{key}[{i}]: '{name}' is an eval-only set of the synthetic corpora, "
                        "and data.corpora names hub corpora"
                    )
    for i, name in enumerate(probe):
        if name not in eval_sets:
            raise ConfigError(
                f"analysis.probe_tasks[{i}]: '{name}' is not an eval set "
                f"({_suggest(name, eval_sets)}known: {', '.join(eval_sets)})"
            )
    table1 = config["table1"]
    if table1["model"] not in config["models"]:
        hint = _suggest(table1["model"], config["models"])
        raise ConfigError(
            f"table1.model: '{table1['model']}' is not a key of models "
            f"({hint}models: {', '.join(config['models'])})"
        )
    for name in table1["methods"]:
        if name not in config["methods"]:
            raise ConfigError(
                f"table1.methods: '{name}' is not a key of methods "
                f"({_suggest(name, config['methods'])}methods: {', '.join(config['methods'])})"
            )
    dup = _duplicate(table1["methods"])
    if dup is not None:
        raise ConfigError(f"table1.methods: '{dup}' is listed twice")
    # Hub corpora (paper scale) are named under data.corpora; the synthetic ones double as the
    # in-domain eval task of the same name, which table 1 reads.
    corpora = config["data"].get("corpora")
    known, where = (
        (list(corpora), "a key of data.corpora")
        if corpora
        else (list(config["evaluation"]["in_domain"]), "one of evaluation.in_domain")
    )
    if table1["corpus"] not in known:
        raise ConfigError(
            f"table1.corpus: '{table1['corpus']}' must be {where} ({', '.join(known)})"
        )
    _check_lengths(config)
    _check_lr_by_base(config)
    _check_diagnostics(config, known, where)
    _check_report_keys(config)
    _check_controls(config)


def _check_diagnostics(config: Mapping[str, Any], corpora: list[str], corpora_where: str) -> None:
    """Names in `diagnostics` must refer to models, methods and corpora of this config."""
    diagnostics = config.get("diagnostics") or {}
    for section, entry in diagnostics.items():
        for pool in ("models", "methods"):
            field = pool if pool in entry else pool[:-1]
            for name in entry[pool] if field == pool else [entry[field]]:
                if name not in config[pool]:
                    raise ConfigError(
                        f"diagnostics.{section}.{field}: '{name}' is not a key of {pool} "
                        f"({_suggest(name, config[pool])}{pool}: {', '.join(config[pool])})"
                    )
        if entry["corpus"] not in corpora:
            raise ConfigError(
                f"diagnostics.{section}.corpus: '{entry['corpus']}' must be {corpora_where} "
                f"({', '.join(corpora)})"
            )
    regime = diagnostics.get("regime")
    if regime is not None and regime.get("trunk_lr_scale") and regime["trainable"] != "moe":
        raise ConfigError(
            f"diagnostics.regime.trunk_lr_scale: {regime['trunk_lr_scale']} needs "
            f"diagnostics.regime.trainable: moe, not {regime['trainable']!r}"
        )


def _check_report_keys(config: Mapping[str, Any]) -> None:
    """Names in tables/claims/sweep must refer to models, methods and corpora of this config."""
    corpora = list(config["data"].get("corpora") or config["evaluation"]["in_domain"])
    tables = config.get("tables") or {}
    claims = config.get("claims")
    sweep = config.get("sweep")

    def model(where: str, name: Any) -> None:
        if name not in config["models"]:
            raise ConfigError(f"{where}: '{name}' is not a key of models")

    def corpus(where: str, name: Any) -> None:
        if name not in corpora:
            raise ConfigError(f"{where}: '{name}' is not a known corpus ({', '.join(corpora)})")

    def labels(where: str, names: Iterable[Any]) -> None:
        for name in names:
            if name not in config["methods"]:
                raise ConfigError(f"{where}: '{name}' is not a key of methods")

    for c, tasks in (config["evaluation"].get("corpus_tasks") or {}).items():
        corpus("evaluation.corpus_tasks", c)
        for task in tasks:
            if task not in config["evaluation"]["in_domain"]:
                raise ConfigError(
                    f"evaluation.corpus_tasks.{c}: '{task}' is not in evaluation.in_domain"
                )
    shapes = _table_shapes()
    for key, entry in tables.items():
        if key == "seeds" or not isinstance(entry, Mapping):
            continue
        if key not in shapes:
            # Every table is a report job of that name with a shape: its rule, and its job
            # `rpb pipeline <name>` (underscores spelled as dashes).
            raise ConfigError(
                f"tables.{key}: unknown table ({_suggest(key, shapes)}a table is a report "
                "job with a shape, declared by a module of rpb/report in its REPORT_ENTRIES)"
            )
        for m in entry.get("models", [entry.get("model")]):
            model(f"tables.{key}.model", m)
        for c in entry.get("corpora", [entry.get("corpus")]):
            corpus(f"tables.{key}.corpus", c)
        for field in shapes[key].entry_keys:
            value = entry.get(field, [])
            labels(f"tables.{key}.{field}", [value] if isinstance(value, str) else value)
    for key in tables:
        roles = shapes[key].claims_roles if key in shapes else ()
        if roles and claims is None:
            named = " and ".join(f"claims.{role}" for role in roles)
            raise ConfigError(f"tables.{key}: reads {named}: add claims")
    if claims is not None:
        # The claims audit reads the audited tables (2-5), and judges its pair on their runs.
        audited = [key for key, shape in shapes.items() if shape.audited]
        missing = [key for key in audited if key not in tables]
        if missing:
            raise ConfigError(f"claims: needs tables.{missing[0]}")
        for role in ("method", "reference"):
            labels(f"claims.{role}", [claims[role]])
        lists = [("table1.methods", config["table1"]["methods"], ("method", "reference"))]
        lists += [
            (f"tables.{key}.methods", tables[key]["methods"], shapes[key].lists_claims)
            for key in audited
            if shapes[key].lists_claims
        ]
        for where, names, roles in lists:
            for role in roles:
                if claims[role] not in names:
                    raise ConfigError(f"{where}: lacks claims.{role} '{claims[role]}'")
    if sweep is not None:
        model("sweep.model", sweep["model"])
        corpus("sweep.corpus", sweep["corpus"])
        for i, curve in enumerate(sweep["curves"]):
            labels(f"sweep.curves[{i}].labels", curve["labels"])
            for name in curve["labels"]:
                # A sweep places each label at its strength on a softness axis: "family" (the
                # model's own coefficient) has no place there until the model is read.
                if isinstance(config["methods"][name].get("strength"), str):
                    raise ConfigError(
                        f"sweep.curves[{i}].labels: '{name}' has strength "
                        f"'{config['methods'][name]['strength']}'; a sweep needs numeric strengths"
                    )


# YTE (Snakemake's YAML templating) evaluates a config's expressions as Python code while
# Snakemake reads the file, when its top level sets this key: a config must stay plain data.
YTE_KEY = "__use_yte__"
_YTE_LINE = rf"""["']?{YTE_KEY}["']?\s*:"""


def _line_of(text: str, pattern: str) -> str:
    """`:<line>` of the first line matching `pattern` in `text`, or ''."""
    for number, line in enumerate(text.splitlines(), start=1):
        if re.match(pattern, line):
            return f":{number}"
    return ""


def check_yaml_syntax(path: Path | str) -> None:
    """Raise ConfigError, one line naming the file (and line), if the config file `path` is not
    plain YAML data: not UTF-8, a syntax error (`<file>:<line>:<column>: YAML syntax error:
    ...`), a tag that builds a Python object (`!!python/name:...`, which Snakemake's loader
    builds), or YTE templating (`__use_yte__`, which makes Snakemake run the file's expressions as
    code, even in a dry run). Snakemake's own messages name neither the file nor the line. A file
    that is absent is left to Snakemake. Snakemake reads JSON first, then YAML (a JSON document is
    YAML too)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}): "
            "save the config as UTF-8"
        ) from None
    try:  # as Snakemake: JSON first (plain data, never templated), then YAML
        json.loads(text)
        return
    except ValueError:
        pass
    try:
        document = yaml.safe_load(text)  # PyYAML's messages (libyaml words them otherwise)
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        found = re.search(r"tag '([^']*)'", err.problem or "")
        tag = found.group(1).replace("tag:yaml.org,2002:", "!!") if found else "a tag"
        raise ConfigError(
            f"{where}: YAML tag {tag} is refused: a config holds plain data (mappings, lists, "
            "numbers, text), never Python objects; remove the tag"
        ) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = err.problem or err.context or "not valid YAML"
        if "'\\t'" in problem:  # PyYAML: "found character '\t' that cannot start any token"
            problem += " (indent with spaces, not tabs)"
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML syntax error: {' '.join(str(err).split())}") from None
    if isinstance(document, dict) and YTE_KEY in document:
        where = f"{path}{_line_of(text, _YTE_LINE)}"
        raise ConfigError(
            f"{where}: {YTE_KEY} is refused: it makes Snakemake run the file's expressions as "
            "Python code (YTE templates) while it reads the config, even in a dry run; write the "
            "values themselves"
        )


def check_config(config: MutableMapping[str, Any], schema_path: Path | str) -> PipelineConfig:
    """Validate `config` against the schema at `schema_path`, fill its defaults in place, check
    cross-key consistency, and parse it, once: the PipelineConfig the planner reads. Raise
    ConfigError (one line, key path first) on the first problem."""
    schema = _with_table_schemas(_load_schema(schema_path))
    _schema_errors(config, schema)
    expand_replicates(config)
    _cross_key_errors(config)
    parsed = _parse(config)
    _check_parsed_methods(config, parsed)
    return parsed


def _parse(config: Mapping[str, Any]) -> PipelineConfig:
    """The config parsed: each method's MethodConfig is made here alone, which checks its
    strength and options (the schema leaves them to it) and names a bad one by its key."""
    try:
        return PipelineConfig.parse(config)
    except ValueError as err:  # MethodConfig's one line, `methods.<label>.strength: ...`
        raise ConfigError(str(err)) from None


def _check_parsed_methods(config: Mapping[str, Any], parsed: PipelineConfig) -> None:
    """The checks that compare methods as parsed (strength and options completed)."""
    methods = parsed.methods
    claims = config.get("claims") or {}
    permuted = claims.get("permuted")
    if permuted is not None:
        method = claims.get("method", "rpb")
        control, reference = methods[permuted].method, methods[method].method
        for key in ("strength", "options"):
            if getattr(control, key) != getattr(reference, key):
                raise ConfigError(
                    f"claims.permuted: methods.{permuted}.{key} differs from methods.{method}"
                    f".{key}: the control must be claims.method with only its prior changed"
                )
    swap = (config.get("diagnostics") or {}).get("router_swap")
    if swap and methods[swap["method"]].method.keeps_routing_at_eval:
        raise ConfigError(
            f"diagnostics.router_swap.method: '{swap['method']}' keeps its routing at "
            "evaluation, so swapping its router weights would not swap its routing"
        )


def expand_replicates(config: MutableMapping[str, Any]) -> None:
    """Add a model per pretraining seed in a model's `replicates` (rpb.specs.replicate_name:
    `<model>_base<k>` for the k-th), its copy with that seed; idempotent, so a config checked
    twice stays the same."""
    models = config["models"]
    for name, entry in list(models.items()):
        seeds = entry.get("replicates") or []
        if seeds and entry["source"] != "pretrain":
            raise ConfigError(f"models.{name}.replicates: only a pretrained model has replicates")
        for i, seed in enumerate(seeds):
            if seed == entry["pretrain"].get("seed", 0):
                raise ConfigError(
                    f"models.{name}.replicates[{i}]: {seed} is the model's own pretrain.seed"
                )
            derived = replicate_name(name, i + 1)
            existing = models.get(derived)
            if existing is not None and existing.get("replicate_of") != name:
                raise ConfigError(
                    f"models.{derived}: the name of models.{name}'s replicate {seed} is taken"
                )
            copy = json.loads(json.dumps({k: v for k, v in entry.items() if k != "replicates"}))
            copy["pretrain"]["seed"] = seed
            models[derived] = copy | {"replicate_of": name}
    # A table pools a model's runs over its bases (rpb.specs.runs_on); tables that compare models
    # (table 3) need the same bases per model.
    counts = {
        n: len(e.get("replicates") or [])
        for n, e in models.items()
        if e["source"] == "pretrain" and "replicate_of" not in e
    }
    if len(set(counts.values())) > 1:
        name = max(counts, key=lambda n: counts[n])
        raise ConfigError(
            f"models.{name}.replicates: every pretrained model needs the same number of "
            f"replicates ({', '.join(f'{n}: {c}' for n, c in counts.items())})"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rpb.pipeline.config_check FILE...`: the YAML syntax of config files, one line
    per bad file. Snakemake reads `--configfile` files itself, before the workflow runs, and its
    message for a syntax error names neither the file nor the line."""
    import sys

    bad = 0
    for name in sys.argv[1:] if argv is None else argv:
        try:
            check_yaml_syntax(name)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
