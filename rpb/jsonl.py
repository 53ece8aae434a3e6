"""JSON Lines files of objects, read with errors that name file:line (torch-free)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def jsonl_objects(path: Path, skip_blank: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each line of a JSONL file; a line that is not a JSON object is a
    ValueError naming file:line. `skip_blank` passes over empty lines."""
    # Bytes, decoded line by line: a text-mode reader's decoding error names no line.
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}); save the file as UTF-8"
                ) from None
            if skip_blank and not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({err.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}"
                )
            yield lineno, rec


def check_string_fields(
    rec: dict[str, Any], keys: Sequence[str], where: str, noun: str = "key"
) -> None:
    """Every one of `keys` is in `rec` and holds a string; errors name `where` (file:line)."""
    missing = [k for k in keys if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing {noun}(s) {missing}")
    wrong = [k for k in keys if not isinstance(rec[k], str)]
    if wrong:
        raise ValueError(f"{where}: {noun}(s) {wrong} must hold strings")


def load_jsonl(path: Path, required_keys: Sequence[str]) -> list[dict[str, Any]]:
    """Read a JSONL file of objects whose required keys hold strings; errors name file:line."""
    path = Path(path)
    records = []
    for lineno, rec in jsonl_objects(path):
        check_string_fields(rec, required_keys, f"{path}:{lineno}")
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: empty file, expected JSON lines with keys {list(required_keys)}")
    return records
