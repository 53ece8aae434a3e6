"""The tiny testbed's fixed bases: pretrained once on the compatible CPU numeric path
(rpb.numerics), committed with their sha256, and used the way the paper's hub checkpoints are.

Every CPU that pretrained its own bases got other bases, and table 1 moved with them by tens of
points. So the bases are artifacts of the repository (`bases/<model>/base<b>/`: the model folder
and its `train_history.json`), listed in `bases/manifest.json` with

- `identity`: everything that decides a base's bytes besides the numeric path (model type,
  architecture, pretraining spec and seed, LBL coefficient, the corpora's settings); the planner
  uses a fixed base only for a pretraining job of exactly this identity;
- `inputs`: the sha256 of the pretraining corpus and of the tokenizer it was pretrained with,
  checked when the base is installed (a change of the corpus generator is caught here);
- `files`: the sha256 of every committed file, checked when the base is installed;
- `numeric_path`: where it was pretrained (rpb.numerics).

`install` copies a fixed base into the results folder; `compare` says in one line whether a base
pretrained here has the recorded bytes (`make bases`); `record` writes a results folder's bases
into `bases/` (a deliberate change of the testbed's pretraining).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rpb.artifacts import sha256_of

__all__ = [
    "FIXED_BASES",
    "FixedBaseError",
    "base_identity",
    "compare",
    "find_fixed_base",
    "install",
    "record",
]

# The committed bases, relative to the workflow's root (the Snakefile's folder).
FIXED_BASES = "bases"
MANIFEST = "manifest.json"
HISTORY = "train_history.json"
# The data settings that decide the pretraining corpus (rpb.pipeline.plan.DataConfig).
DATA_KEYS = ("seed", "preset", "level", "holdout")


class FixedBaseError(ValueError):
    """A fixed base that cannot be used as it is (one line: which file, and what to do)."""


def base_identity(
    model_type: str,
    architecture: Mapping[str, Any],
    spec: Mapping[str, Any],
    lbl_coef: float,
    data: Mapping[str, Any],
) -> dict[str, Any]:
    """What decides a pretrained base's bytes, besides the numeric path and the corpora's code."""
    return {
        "model_type": model_type,
        "architecture": dict(architecture),
        "pretrain": dict(spec),
        "lbl_coef": float(lbl_coef),
        "data": {key: data.get(key) for key in DATA_KEYS},
    }


def _key(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _tree_sha256(folder: Path) -> str:
    """One digest of a folder's files (names and bytes), e.g. a tokenizer's."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder)}\0{sha256_of(path)}\n".encode())
    return digest.hexdigest()


def read_manifest(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.exists():
        return {"bases": {}}
    try:
        manifest = json.loads(path.read_text())
        manifest["bases"].items()
    except (ValueError, KeyError, AttributeError, TypeError) as err:
        raise FixedBaseError(f"{path}: not a fixed-base manifest ({err}); git checkout it") from err
    return manifest


def find_fixed_base(root: Path, identity: Mapping[str, Any]) -> str | None:
    """The name (`<model>/base<b>`) of the fixed base of `identity` under `root`, or None."""
    key = _key(identity)
    for name, entry in read_manifest(root)["bases"].items():
        if entry.get("identity_sha256") == key:
            return name
    return None


def _model_files(folder: Path) -> list[Path]:
    """A model folder's files, without the markers others leave in it (Snakemake's
    `.snakemake_timestamp`)."""
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")]


def _files(folder: Path) -> dict[str, str]:
    files = {str(p.relative_to(folder)): sha256_of(p) for p in _model_files(folder / "model")}
    files[HISTORY] = sha256_of(folder / HISTORY)
    return files


def install(root: Path, name: str, out: Path, corpus: Path, tokenizer: Path) -> dict[str, Any]:
    """Copy fixed base `name` into the pretraining job's folder `out` (`out/model`, written whole,
    and `out/train_history.json`) after checking every committed file's sha256 and that `corpus`
    and `tokenizer` are the ones it was pretrained on. Returns its manifest entry."""
    from rpb.artifacts import atomic_folder, atomic_path

    root = Path(root)
    entry = read_manifest(root)["bases"][name]
    folder = root / name
    for relative, recorded in entry["files"].items():
        path = folder / relative
        if not path.exists():
            raise FixedBaseError(f"{path}: missing from the fixed base; git checkout {folder}")
        if sha256_of(path) != recorded:
            raise FixedBaseError(
                f"{path}: not the committed bytes (sha256 differs from {root / MANIFEST}); "
                f"git checkout {folder}"
            )
    for what, path, recorded, actual in (
        ("pretraining corpus", corpus, entry["inputs"]["corpus_sha256"], sha256_of(Path(corpus))),
        ("tokenizer", tokenizer, entry["inputs"]["tokenizer_sha256"], _tree_sha256(tokenizer)),
    ):
        if actual != recorded:
            raise FixedBaseError(
                f"{path}: the fixed base {folder} was pretrained on another {what} (sha256 "
                f"{recorded[:12]}, this one {actual[:12]}); set bases: pretrain in the config "
                "to pretrain on this one"
            )
    with atomic_folder(Path(out) / "model") as tmp:
        for path in _model_files(folder / "model"):
            target = tmp / path.relative_to(folder / "model")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    with atomic_path(Path(out) / HISTORY) as tmp:
        shutil.copyfile(folder / HISTORY, tmp)
    return entry


def compare(root: Path, name: str, out: Path) -> tuple[bool, str]:
    """Whether the base pretrained into `out` has fixed base `name`'s bytes, and one line
    saying so (with where each was pretrained when they differ)."""
    entry = read_manifest(root)["bases"][name]
    weights = "model/model.safetensors"
    recorded, actual = entry["files"][weights], sha256_of(Path(out) / weights)
    if actual == recorded:
        return True, f"{name}: pretrained here with the fixed base's bytes (sha256 {actual[:16]})"
    history = json.loads((Path(out) / HISTORY).read_text()).get("numeric_path") or {}
    return False, (
        f"{name}: pretrained here with other bytes than the fixed base (sha256 {actual[:16]}, "
        f"recorded {recorded[:16]}; recorded on {entry['numeric_path'].get('cpu')}, "
        f"{entry['numeric_path'].get('capability')}; here {history.get('cpu')}, "
        f"{history.get('capability')}): this CPU or environment computes other bits"
    )


def record(
    root: Path,
    name: str,
    results_base: Path,
    identity: Mapping[str, Any],
    corpus: Path,
    tokenizer: Path,
) -> dict[str, Any]:
    """Make the base pretrained in `results_base` (its `model/` and `train_history.json`) fixed
    base `name` under `root`, and write its manifest entry."""
    root, results_base = Path(root), Path(results_base)
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "model").mkdir(parents=True)
    for path in _model_files(results_base / "model"):
        target = folder / "model" / path.relative_to(results_base / "model")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    shutil.copyfile(results_base / HISTORY, folder / HISTORY)
    history = json.loads((folder / HISTORY).read_text())
    entry = {
        "identity": dict(identity),
        "identity_sha256": _key(identity),
        "inputs": {
            "corpus_sha256": sha256_of(Path(corpus)),
            "tokenizer_sha256": _tree_sha256(Path(tokenizer)),
        },
        "numeric_path": history.get("numeric_path") or {},
        "files": _files(folder),
    }
    manifest = read_manifest(root)
    manifest["bases"][name] = entry
    manifest["bases"] = dict(sorted(manifest["bases"].items()))
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    """`python -m rpb.pipeline.bases targets|compare RESULTS`: the model folders of every fixed
    base under RESULTS (Snakemake targets), or one line per base pretrained there saying whether
    it has the committed bytes (exit 1 if any differs or is missing); `make bases` runs both.
    `rpb pipeline fix-bases` records a results folder's bases as the fixed ones."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("targets", "compare"):
        print(main.__doc__.split(":")[0].strip("`"), file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[2] / FIXED_BASES
    results = Path(args[1])
    names = sorted(read_manifest(root)["bases"])
    if args[0] == "targets":
        print(" ".join(str(results / "models" / name / "model") for name in names))
        return 0
    status = 0
    for name in names:
        out = results / "models" / name
        if not (out / "model" / "model.safetensors").exists():
            print(f"{name}: not pretrained under {results}")
            status = 1
            continue
        same, line = compare(root, name, out)
        print(line)
        status |= not same
    return status


if __name__ == "__main__":
    raise SystemExit(main())
