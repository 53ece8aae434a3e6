"""config/README.md documents every key of the config schema, and nothing the schema lacks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
README = ROOT / "config" / "README.md"


def schema_keys(schema: dict[str, Any]) -> Iterator[str]:
    """Key paths the schema accepts: `a.b`, `<name>` for free-named entries, `[]` for list items."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        return node

    def walk(node: Any, path: str) -> Iterator[str]:
        node = resolve(node)
        if not isinstance(node, dict):
            return
        for key, sub in (node.get("properties") or {}).items():
            child = f"{path}.{key}" if path else key
            yield child
            yield from walk(sub, child)
        if isinstance(node.get("additionalProperties"), dict):
            yield from walk(node["additionalProperties"], f"{path}.<name>")
        items = resolve(node.get("items"))
        if isinstance(items, dict) and items.get("properties"):
            yield from walk(items, f"{path}[]")

    yield from walk(schema, "")


def documented_keys(text: str) -> list[str]:
    """The key of each `- `key`: ...` bullet of the README's key reference."""
    reference = text.split("## Key reference", 1)[1]
    return re.findall(r"^- `([^`]+)`:", reference, flags=re.MULTILINE)


def test_schema_walk_sees_nested_and_free_named_keys() -> None:
    schema = {
        "$defs": {"m": {"properties": {"x": {}}}},
        "properties": {
            "a": {"additionalProperties": {"$ref": "#/$defs/m"}},
            "b": {"items": {"properties": {"c": {}}}},
        },
    }
    assert list(schema_keys(schema)) == ["a", "a.<name>.x", "b", "b[].c"]


def test_config_readme_documents_exactly_the_schema_keys() -> None:
    keys = list(schema_keys(yaml.safe_load(SCHEMA.read_text())))
    documented = documented_keys(README.read_text())
    missing = [k for k in keys if k not in documented]
    unknown = [k for k in documented if k not in keys]
    assert not missing, f"config/README.md lacks: {missing}"
    assert not unknown, f"config/README.md documents keys the schema lacks: {unknown}"
    assert len(documented) == len(set(documented)), "a key is documented twice"
