"""The config schema's training settings, written from `TrainSpec` (rpb.train_spec).

`posttrain` and each model's `pretrain` (workflow/schemas/config.schema.yaml) set fields of the
training job's TrainSpec. Their properties are not written by hand: each TrainSpec field's metadata
names the sections that set it and its JSON-schema keywords, and this module writes them between
the marker comments of each section (`# TrainSpec's <section> settings, generated ...` and
`# end of TrainSpec's <section> settings`); the section's other keys (posttrain.lr_by_base,
pretrain.lbl_coef) and its `required` stay hand-written after the block.

    python -m rpb.pipeline.schema --write   # rewrite the generated blocks
    python -m rpb.pipeline.schema --check   # exit 1 if they are stale (tests/test_schema.py too)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import textwrap
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
SECTIONS = ("posttrain", "pretrain")
WIDTH = 100
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
_BEGIN = re.compile(r"^( *)# TrainSpec's (\w+) settings, generated", re.MULTILINE)
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Plain words YAML 1.1 (PyYAML) reads as something other than text.
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null"}


def _begin(section: str) -> str:
    return f"# TrainSpec's {section} settings, generated (python -m rpb.pipeline.schema --write)"


def _end(section: str) -> str:
    return f"# end of TrainSpec's {section} settings"


def train_settings(section: str) -> dict[str, dict[str, Any]]:
    """The JSON-schema property of each TrainSpec field that config section `section` sets, in
    field order: its description, its type (or its enum), its keywords, its default if the schema
    fills it in."""
    from rpb.train_spec import CONFIG_SETTING, TrainSpec

    hints = typing.get_type_hints(TrainSpec)
    properties = {}
    for f in dataclasses.fields(TrainSpec):
        if CONFIG_SETTING not in f.metadata:
            raise ValueError(
                f"TrainSpec.{f.name}: its metadata does not say whether a config sets it "
                "(rpb.train_spec._setting)"
            )
        setting = f.metadata[CONFIG_SETTING]
        if section not in setting["sections"]:
            continue
        prop: dict[str, Any] = {}
        if setting["description"]:
            prop["description"] = setting["description"]
        if "enum" not in setting["schema"]:
            prop["type"] = JSON_TYPES[hints[f.name]]
        prop |= setting["schema"]
        if setting["fill_default"]:
            prop["default"] = f.default
        properties[f.name] = prop
    return properties


def _flow(value: Any) -> str:
    """`value` in YAML flow style, as the schema writes it (`{type: integer, minimum: 1}`)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, str) and _PLAIN.fullmatch(value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)


def render(section: str, indent: int) -> list[str]:
    """The generated lines of `section` (marker comments included) at `indent` spaces."""
    pad = " " * indent
    lines = [pad + _begin(section)]
    for name, prop in train_settings(section).items():
        description = prop.pop("description", None)
        if description is None:
            lines.append(f"{pad}{name}: {_flow(prop)}")
            continue
        lines += [f"{pad}{name}:", f"{pad}  description: >-"]
        lines += textwrap.wrap(
            description,
            WIDTH,
            initial_indent=pad + "    ",
            subsequent_indent=pad + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        lines += [f"{pad}  {key}: {_flow(value)}" for key, value in prop.items()]
    lines.append(pad + _end(section))
    return lines


def generate(text: str) -> str:
    """`text` (the schema) with each section's generated block written afresh. Every section of
    SECTIONS has exactly one block; a missing or doubled marker is an error."""
    lines = text.split("\n")
    found = []
    blocks = []
    for match in _BEGIN.finditer(text):
        indent, section = len(match.group(1)), match.group(2)
        if section not in SECTIONS or section in found:
            raise ValueError(f"{SCHEMA.name}: unexpected generated block {section!r}")
        found.append(section)
        start = text[: match.start()].count("\n")
        end_line = " " * indent + _end(section)
        try:
            end = lines.index(end_line, start)
        except ValueError:
            raise ValueError(f"{SCHEMA.name}: no line {end_line.strip()!r}") from None
        blocks.append((start, end, section, indent))
    for start, end, section, indent in reversed(blocks):  # later lines first: indices hold
        lines[start : end + 1] = render(section, indent)
    missing = [s for s in SECTIONS if s not in found]
    if missing:
        raise ValueError(f"{SCHEMA.name}: no generated block for {', '.join(missing)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rpb.pipeline.schema", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="rewrite the generated blocks")
    group.add_argument("--check", action="store_true", help="exit 1 if they are stale")
    args = parser.parse_args(argv)
    text = SCHEMA.read_text()
    fresh = generate(text)
    if args.write:
        if fresh != text:
            SCHEMA.write_text(fresh)
            print(f"wrote {SCHEMA}")
        return 0
    if fresh != text:
        print(
            f"{SCHEMA}: TrainSpec's settings are stale: run python -m rpb.pipeline.schema --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
