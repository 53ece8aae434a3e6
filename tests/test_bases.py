"""The committed fixed bases (rpb.pipeline.bases): recorded, found by their pretraining's identity,
installed only with the committed bytes and the corpus they were pretrained on, and compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpb.pipeline.bases import (
    FixedBaseError,
    base_identity,
    compare,
    find_fixed_base,
    install,
    record,
)

IDENTITY = base_identity(
    "deepseek_v3",
    {"hidden_size": 64},
    {"steps": 2000, "seed": 1},
    0.001,
    {"seed": 1234, "preset": "default", "level": 1, "holdout": None},
)


def _pretrained(folder: Path, weights: bytes = b"weights") -> Path:
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "model" / "model.safetensors").write_bytes(weights)
    path = {"cpu": "AMD EPYC", "capability": "AVX2"}
    (folder / "train_history.json").write_text(json.dumps({"numeric_path": path}))
    return folder


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    corpus = tmp_path / "data" / "pretrain.jsonl"
    tokenizer = tmp_path / "data" / "tokenizer"
    tokenizer.mkdir(parents=True)
    corpus.write_text('{"text": "1+2=3"}\n')
    (tokenizer / "tokenizer.json").write_text("{}")
    root = tmp_path / "bases"
    base = _pretrained(tmp_path / "results" / "models" / "tinyA" / "base1")
    record(root, "tinyA/base1", base, IDENTITY, corpus, tokenizer)
    return {"root": root, "corpus": corpus, "tokenizer": tokenizer, "tmp": tmp_path}


def test_a_recorded_base_is_found_by_its_identity_only(world: dict[str, Path]) -> None:
    assert find_fixed_base(world["root"], IDENTITY) == "tinyA/base1"
    other = {**IDENTITY, "pretrain": {"steps": 2000, "seed": 2}}  # another pretraining seed
    assert find_fixed_base(world["root"], other) is None
    assert find_fixed_base(world["tmp"] / "nowhere", IDENTITY) is None


def test_install_copies_the_committed_base(world: dict[str, Path]) -> None:
    out = world["tmp"] / "run" / "models" / "tinyA" / "base1"
    entry = install(world["root"], "tinyA/base1", out, world["corpus"], world["tokenizer"])
    assert (out / "model" / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((out / "train_history.json").read_text())["numeric_path"]["cpu"]
    assert entry["numeric_path"]["capability"] == "AVX2"


def test_a_changed_committed_file_is_refused_in_one_line(world: dict[str, Path]) -> None:
    (world["root"] / "tinyA" / "base1" / "model" / "model.safetensors").write_bytes(b"edited")
    out = world["tmp"] / "run"
    with pytest.raises(FixedBaseError) as info:
        install(world["root"], "tinyA/base1", out, world["corpus"], world["tokenizer"])
    assert "model.safetensors: not the committed bytes" in str(info.value)
    assert "git checkout" in str(info.value) and "\n" not in str(info.value)
    assert not (out / "model").exists()


def test_another_corpus_is_refused_in_one_line(world: dict[str, Path]) -> None:
    world["corpus"].write_text('{"text": "1+2=4"}\n')  # e.g. a changed corpus generator
    with pytest.raises(FixedBaseError) as info:
        install(
            world["root"], "tinyA/base1", world["tmp"] / "run", world["corpus"], world["tokenizer"]
        )
    message = str(info.value)
    assert message.startswith(str(world["corpus"])) and "another pretraining corpus" in message
    assert "bases: pretrain" in message


def test_compare_says_whether_the_bytes_are_the_fixed_bases(world: dict[str, Path]) -> None:
    same = _pretrained(world["tmp"] / "again")
    assert compare(world["root"], "tinyA/base1", same)[0]
    other = _pretrained(world["tmp"] / "elsewhere", weights=b"other bits")
    ok, line = compare(world["root"], "tinyA/base1", other)
    assert not ok and "other bytes than the fixed base" in line and "AMD EPYC" in line


def test_the_repository_manifest_lists_every_committed_file() -> None:
    root = Path(__file__).resolve().parents[1] / "bases"
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["bases"], "no fixed base committed"
    for name, entry in manifest["bases"].items():
        listed = set(entry["files"])
        present = {str(p.relative_to(root / name)) for p in (root / name).rglob("*") if p.is_file()}
        assert listed == present, name
        assert entry["numeric_path"]["pinned"] is True, name


def test_make_bases_compares_every_committed_base(tmp_path: Path) -> None:
    """`python -m rpb.pipeline.bases compare RESULTS` (make bases): one line per committed base,
    exit 1 when one was pretrained with other bytes."""
    import shutil

    from rpb.pipeline.bases import main

    root = Path(__file__).resolve().parents[1] / "bases"
    names = sorted(json.loads((root / "manifest.json").read_text())["bases"])
    for name in names:
        shutil.copytree(root / name, tmp_path / "models" / name)
    assert main(["compare", str(tmp_path)]) == 0
    weights = tmp_path / "models" / names[0] / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    assert main(["compare", str(tmp_path)]) == 1
    assert main(["compare", str(tmp_path / "empty")]) == 1  # nothing pretrained there
