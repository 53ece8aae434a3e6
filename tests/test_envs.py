"""envs/*.yaml agree with pyproject.toml: every project dependency with the same name and version
specifier, torch pinned to the Makefile's version, extras only as pyproject declares them, and a
post-deploy script that installs the project. conda is not installed on the development machines,
so the files are checked, not built."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ENVS = sorted((ROOT / "envs").glob("*.yaml"))
# Paper-scale packages no pyproject group declares yet; once pyproject gets them (e.g. a `paper`
# extra), the extras check below holds them to pyproject's specifier instead.
ENV_ONLY = {"paper.yaml": {"tiktoken"}}


def _requirements(specs: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(s) for s in specs]
    names = [canonicalize_name(r.name) for r in reqs]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"listed twice: {dup}"
    return dict(zip(names, reqs, strict=True))


PROJECT = _requirements(PYPROJECT["dependencies"])
OPTIONAL: dict[str, Requirement] = {}
for _group in PYPROJECT.get("optional-dependencies", {}).values():
    for _name, _req in _requirements(_group).items():
        # A package may sit in two extras (slurm and dev), but with one specifier.
        assert OPTIONAL.setdefault(_name, _req).specifier == _req.specifier, _name


def _torch_pin() -> str:
    """The torch release `make install` installs: the lock file's, less its local `+cpu` tag."""
    lock = (ROOT / "requirements" / "lock.txt").read_text()
    match = re.search(r"^torch==([^\s+]+)(\+cpu)? ", lock, re.M)
    assert match, "requirements/lock.txt: no `torch==<version>` pin"
    return match.group(1)


def _env(path: Path) -> tuple[list, dict[str, Requirement]]:
    env = yaml.safe_load(path.read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return conda, _requirements(pip)


def test_there_are_envs():
    assert {p.name for p in ENVS} >= {"rpb.yaml", "paper.yaml"}


@pytest.mark.parametrize("path", ENVS, ids=lambda p: p.name)
def test_env_matches_pyproject(path: Path):
    conda, pip = _env(path)
    python = next(d for d in conda if d.startswith("python="))
    assert SpecifierSet(PYPROJECT["requires-python"]).contains(python.split("=", 1)[1])
    assert "pip" in conda
    missing = sorted(set(PROJECT) - set(pip))
    assert not missing, f"{path.name} lacks project dependencies {missing}"
    for name, req in PROJECT.items():
        got = pip[name].specifier
        if name == "torch":
            # The envs pin what the Makefile installs, inside pyproject's range.
            assert str(got) == f"=={_torch_pin()}", path.name
            assert req.specifier.contains(_torch_pin()), "Makefile torch outside pyproject range"
        else:
            assert got == req.specifier, f"{path.name}: {name} {got} != pyproject {req.specifier}"
    for name, req in pip.items():
        if name in PROJECT:
            continue
        if name in OPTIONAL:
            assert req.specifier == OPTIONAL[name].specifier, f"{path.name}: {name}"
        else:
            assert name in ENV_ONLY.get(path.name, set()), f"{path.name}: {name} not in pyproject"
            assert str(req.specifier), f"{path.name}: {name} needs a version specifier"


@pytest.mark.parametrize("path", ENVS, ids=lambda p: p.name)
def test_env_installs_the_project_after_creation(path: Path):
    """Snakemake copies env files to .snakemake/conda/, so a relative `-e` path would point
    elsewhere; the post-deploy script installs the checkout instead."""
    _, pip = _env(path)
    assert "rpb" not in pip
    script = path.with_suffix(".post-deploy.sh")
    assert script.is_file(), f"{script.name} missing"
    assert re.search(r"pip install --no-deps -e \.$", script.read_text(), re.M)


@pytest.mark.parametrize("path", ENVS, ids=lambda p: p.name)
def test_dev_environment_satisfies_env(path: Path):
    """The versions this suite runs on satisfy every env specifier (so the envs are not stale)."""
    _, pip = _env(path)
    for name, req in pip.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue  # e.g. tiktoken: paper scale only
        assert req.specifier.contains(installed, prereleases=True), (path.name, name, installed)


def test_the_lock_file_satisfies_every_range_of_pyproject() -> None:
    """`make install` installs the lock file's versions: each must be inside pyproject.toml's
    range for it, or the lock is stale (`make lock` regenerates it)."""
    locked = dict(
        re.findall(
            r"^([A-Za-z0-9_.-]+)==(\S+) ", (ROOT / "requirements/lock.txt").read_text(), re.M
        )
    )
    locked = {name.lower().replace("_", "-"): version for name, version in locked.items()}
    for name, req in {**PROJECT, **OPTIONAL}.items():
        if name == "rpb":
            continue
        version = locked.get(name.lower().replace("_", "-"))
        assert version is not None, f"{name} is not in requirements/lock.txt: run make lock"
        assert req.specifier.contains(version, prereleases=True), (
            f"requirements/lock.txt has {name}=={version}, outside pyproject's {req}: make lock"
        )


def _locked(path: Path) -> dict[str, str]:
    """A lock file's pins: canonical name -> version."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) ", path.read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pins}


def _gpu_extra(name: str) -> bool:
    """What torch's CUDA build pulls in beyond the CPU build: the nvidia-* CUDA libraries, triton,
    and the CUDA meta-packages (cuda-*)."""
    return name.startswith(("nvidia-", "cuda-")) or name == "triton"


def test_the_gpu_lock_pins_the_cpu_locks_versions() -> None:
    """requirements/lock-gpu.txt (`make install-gpu`) is the CPU lock with torch's CUDA build of
    the same release: every other package at the same version, nothing dropped, nothing added
    but torch's CUDA libraries, and every pin with its hashes (`--require-hashes`)."""
    cpu = _locked(ROOT / "requirements" / "lock.txt")
    gpu = _locked(ROOT / "requirements" / "lock-gpu.txt")
    assert cpu["torch"] == f"{_torch_pin()}+cpu"
    assert gpu["torch"] == _torch_pin(), "the GPU lock's torch is PyPI's build of the same release"
    same = {n: (v, gpu.get(n)) for n, v in cpu.items() if n != "torch" and gpu.get(n) != v}
    assert not same, f"versions that differ between the locks (make lock-gpu): {same}"
    extra = sorted(n for n in gpu.keys() - cpu.keys() if not _gpu_extra(n))
    assert not extra, f"the GPU lock adds more than torch's CUDA libraries: {extra}"
    assert any(n.startswith("nvidia-") for n in gpu) and "triton" in gpu
    text = (ROOT / "requirements" / "lock-gpu.txt").read_text()
    blocks = re.split(r"^(?=[A-Za-z0-9_.-]+==)", text, flags=re.M)[1:]
    unhashed = [b.split()[0] for b in blocks if "--hash=sha256:" not in b]
    assert not unhashed, f"pins without a hash: {unhashed}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    ("args", "lock"),
    [
        ((), "requirements/lock.txt"),
        (("GPU=1",), "requirements/lock-gpu.txt"),
        (("install-gpu",), "requirements/lock-gpu.txt"),
    ],
)
def test_make_installs_the_gpu_lock_where_asked(tmp_path: Path, args, lock) -> None:
    """`make install` installs the CPU lock; `make install GPU=1` and `make install-gpu` the GPU
    lock, hash-checked, into a stamp of their own (a CPU venv is not taken for a GPU one)."""
    goal = [a for a in args if "=" not in a] or ["install"]
    variables = [a for a in args if "=" in a]
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", *goal, *variables, f"VENV={tmp_path}/venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in proc.stdout.splitlines() if "--require-hashes" in line]
    assert len(installs) == 1 and f"-r {lock}" in installs[0], proc.stdout
    stamp = ".rpb-installed-gpu" if lock.endswith("gpu.txt") else ".rpb-installed"
    assert f"touch {tmp_path}/venv/{stamp}" in proc.stdout, proc.stdout
