"""`pip install .` is the library alone (pyproject.toml's `dependencies`; the pipeline is the
`pipeline` extra): importing the library loads none of the pipeline's packages, the library works
where they are not installed, and a clean venv with the core alone, installed offline, runs the
README's library snippet and the `rpb prior` / `rpb finetune` commands (without mlflow)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_base
from offline_guard import guarded_env, unshare_prefix
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
BUILD_REQUIRES = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]

# The library: what `pip install rpb` is for, every module at the top of the package and in
# rpb/router/ (the pipeline's and the report's are in rpb/pipeline/ and rpb/report/; rpb.cli and
# __main__ are the command's entry points). rpb.trl needs the `trl` extra.
LIBRARY = [
    "rpb",
    *sorted(
        f"rpb.{path.stem}"
        for path in (ROOT / "rpb").glob("*.py")
        if path.stem not in {"__init__", "__main__", "cli", "trl"}
    ),
    "rpb.router",
    *sorted(f"rpb.router.{path.stem}" for path in (ROOT / "rpb" / "router").glob("[!_]*.py")),
]
# Import names of the pipeline's packages (the `pipeline` and `analysis` extras, and datasets).
PIPELINE = [
    "snakemake",
    "lm_eval",
    "mlflow",
    "matplotlib",
    "scipy",
    "sklearn",
    "networkx",
    "pandas",
    "datasets",
    "jsonschema",
]
# What the library takes from transformers: with scipy / datasets / pandas installed (as in the
# dev venv), transformers' own modules import them (its loss utilities import scipy, its Trainer
# datasets), so those are measured first and only what rpb adds on top is held against it.
TRANSFORMERS_PARTS = """
import transformers.models.deepseek_v3.modeling_deepseek_v3
import transformers.models.mixtral.modeling_mixtral
import transformers.models.olmoe.modeling_olmoe
import transformers.models.qwen2_moe.modeling_qwen2_moe
import transformers.models.qwen3_moe.modeling_qwen3_moe
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Trainer
"""


def _run_python(code: str, python: str = sys.executable, **kwargs) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last, returned parsed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(kwargs.pop("env", {}))
    proc = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=env, timeout=600, **kwargs
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_message_names_a_package_no_index_has():
    """No package index has rpb: no message, help or docstring in rpb/ tells a user to
    `pip install rpb` (or an extra of it); they name the install from a checkout
    (rpb.specs.install_hint). The one left is the note every steered model folder's config.json
    carries (rpb.eval_routing._NOTE): a results file, whose bytes table 1's outputs keep."""
    from rpb.eval_routing import _NOTE

    wrong = re.compile(r"pip install ['\"]?rpb\b")
    hits = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "rpb").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if wrong.search(line) and line.strip().strip('"') not in _NOTE
    ]
    assert hits == []
    assert wrong.search(_NOTE)  # the exception above is still needed


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_importing_the_library_loads_no_pipeline_package(tmp_path):
    """A fresh interpreter imports every library module: none of the pipeline's packages is
    imported beyond what transformers' own modules import when they happen to be installed."""
    code = f"""
import json, sys
PIPELINE = {PIPELINE!r}
{TRANSFORMERS_PARTS}
by_transformers = sorted(p for p in PIPELINE if p in sys.modules)
for name in {LIBRARY!r}:
    __import__(name)
added = sorted(p for p in PIPELINE if p in sys.modules and p not in by_transformers)
print(json.dumps({{"by_transformers": by_transformers, "added": added}}))
"""
    got = _run_python(code, cwd=tmp_path)
    assert got["added"] == [], f"importing the library loads {got['added']}"


@pytest.mark.slow  # a fresh interpreter that trains a step
def test_the_library_works_without_the_pipeline_packages(tmp_path):
    """With every pipeline package made unimportable (as if not installed), the library modules
    import, a method trains a step on a tiny model with a prior, the drift statistics (usage
    entropy without scipy) come out, and the community metrics fail in one line naming the
    extra that provides them."""
    code = f"""
import json, sys
for name in {PIPELINE!r}:
    sys.modules[name] = None  # what `import` sees for a package that is not installed
for name in {LIBRARY!r}:
    __import__(name)
import torch
from rpb.architectures import random_model
from rpb.coactivation import communities, partition_nmi, usage_entropy
from rpb.methods import make_method
from rpb.prior import extract_prior

model = random_model("qwen3_moe", seed=0)
batch = {{"input_ids": torch.randint(3, 60, (2, 8)), "attention_mask": torch.ones(2, 8)}}
prior = extract_prior(model, [batch], model_id="m", revision="r", corpus_hash="h", progress=False)
model.train()
with make_method("rpb", strength=1.0).attach(model, prior) as method:
    out = model(**batch, labels=batch["input_ids"])
    (out.loss + method.router_loss(batch["attention_mask"])).backward()
    stats = method.routing_stats()
with make_method("lbl", strength="family").attach(model) as lbl:
    model(**batch)
    lbl_term = float(lbl.router_loss(batch["attention_mask"]))
errors = []
for fn, args in ((communities, ([[0, 1], [1, 0]],)), (partition_nmi, ([0, 1], [0, 1]))):
    try:
        fn(*args)
    except ImportError as err:
        errors.append(str(err))
loaded = sorted(p for p in {PIPELINE!r} if sys.modules.get(p) is not None)
print(json.dumps({{"stats": stats, "lbl": lbl_term, "errors": errors, "loaded": loaded,
                   "entropy": usage_entropy([1, 1, 2, 0])}}))
"""
    got = _run_python(code, cwd=tmp_path)
    assert got["loaded"] == []
    assert 0 < got["stats"]["mean/usage_entropy"] <= 1
    assert got["stats"]["mean/kl_to_base"] >= 0
    assert got["lbl"] > 0
    assert got["entropy"] == pytest.approx(0.75, abs=1e-12)  # (ln 4 + ln 2) / 2 / ln 4
    assert got["errors"] == [
        "rpb.coactivation's community metrics need networkx: "
        "pip install '.[analysis]' in a checkout of the rpb repository",
        "rpb.coactivation's community metrics need sklearn: "
        "pip install '.[analysis]' in a checkout of the rpb repository",
    ]


# ---------------------------------------------------------------- a clean venv with the core alone


def _readme_library_snippet() -> str:
    """The first Python block of the README's library section (the test breaks with it)."""
    readme = (ROOT / "README.md").read_text()
    head = "## Use the method in your own training\n"
    assert head in readme, "README.md has no library section"
    section = readme.split(head, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md's library section has no python block"
    return match.group(1)


def _pip_find_links() -> list[Path]:
    """The local folders pip is configured to find wheels in (config files and PIP_FIND_LINKS):
    where `make install`'s `pip install torch==...` takes the CPU wheel from."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    values = re.findall(r"^\S*find-links='(.*)'$", out, re.M)
    values.append(os.environ.get("PIP_FIND_LINKS", ""))
    folders = []
    for value in values:
        for item in value.split():
            path = Path(item.removeprefix("file://"))
            if path.is_dir() and path not in folders:
                folders.append(path)
    return folders


def _torch_wheel() -> Path | None:
    """The wheel of the torch this suite runs on (the Makefile's CPU build), among pip's
    configured local folders."""
    want = Version(torch.__version__)
    for folder in _pip_find_links():
        for wheel in folder.glob("torch-*.whl"):
            if parse_wheel_filename(wheel.name)[1] == want:
                return wheel
    return None


def _core_closure() -> dict[str, str]:
    """name -> version installed here of every distribution the core dependencies need,
    transitively (markers evaluated for this interpreter), plus setuptools to build rpb."""
    todo = [(Requirement(r), "") for r in PYPROJECT["dependencies"]]
    todo += [(Requirement(r), "") for r in BUILD_REQUIRES]
    found: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        for wanted in ["", *sorted(req.extras)]:
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            dist = metadata.distribution(name)
            found[name] = dist.version
            todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return found


def _wheelhouse(closure: dict[str, str]) -> Path:
    """A folder with a wheel of every distribution in `closure` but torch, at the versions the
    dev venv runs. Filled once from pip's configured package sources (the registry, like
    `make install`); the install itself then runs offline from it."""
    house = Path(os.environ.get("RPB_WHEELHOUSE", Path.home() / ".cache/rpb/light-install-wheels"))
    house.mkdir(parents=True, exist_ok=True)
    have = {
        (canonicalize_name(n), str(v))
        for n, v, *_ in (parse_wheel_filename(w.name) for w in house.glob("*.whl"))
    }
    missing = [
        f"{name}=={version}"
        for name, version in sorted(closure.items())
        if name != "torch" and (name, str(Version(version))) not in have
    ]
    if missing:
        download = ["download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest"]
        proc = subprocess.run(
            [sys.executable, "-m", "pip", *download, str(house), *missing],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.skip(
                f"could not fill the wheelhouse {house} for the offline install (the one step "
                f"that needs the package registry): {proc.stderr.strip()[-500:]}"
            )
    return house


@pytest.mark.slow
@pytest.mark.timeout(1800)  # torch's wheel alone unpacks for a minute on the 2-core machines
def test_the_core_alone_installs_offline_and_runs_the_readme_snippet(tmp_path):
    """A clean venv (no system site-packages), the CPU torch from pip's local folder, then
    `pip install <project>` without extras, all with `--no-index` from local wheels, in a network
    namespace where the machine allows one and with the socket guard: nothing of the pipeline is
    installed (mlflow neither), the README's library snippet runs as it is, and the installed
    `rpb` command runs `rpb prior` and `rpb finetune` on a tiny checkpoint folder."""
    wheel = _torch_wheel()
    if wheel is None:
        pytest.skip(f"no wheel of torch {torch.__version__} among pip's find-links folders")
    house = _wheelhouse(_core_closure())
    # The project's source alone: a build must not write into the working tree.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    shutil.copytree(ROOT / "rpb", src / "rpb", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # Only the sources named here: no pip config, no index.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env = guarded_env(env, tmp_path / "guard")
    # The snippet runs with the guard and nothing else on its path: the installed rpb, not ours.
    run_env = {**env, "PYTHONPATH": str(tmp_path / "guard")}
    offline = [*unshare_prefix()]
    sources = ["--no-index", "--find-links", str(house), "--find-links", str(wheel.parent)]
    for what in ([f"torch=={torch.__version__}"], [str(src)]):
        proc = subprocess.run(
            [*offline, python, "-m", "pip", "install", "--quiet", *sources, *what],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=1200,
        )
        assert proc.returncode == 0, f"pip install {what}: {proc.stderr[-3000:]}"
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, env=env
    )
    installed = {canonicalize_name(d["name"]) for d in json.loads(listed.stdout)}
    assert "rpb" in installed
    # networkx is torch's own dependency, so it is there; none of the others may be.
    pipeline = {"snakemake", "lm-eval", "mlflow", "matplotlib", "scipy", "scikit-learn"}
    pipeline |= {"pandas", "datasets", "jsonschema", "trl"}
    assert installed & pipeline == set()

    snippet = tmp_path / "snippet.py"
    snippet.write_text(_readme_library_snippet())
    driver = textwrap.dedent(
        f"""
        import json, runpy, sys
        from pathlib import Path
        import rpb, torch

        names = runpy.run_path({str(snippet)!r})  # the snippet defines every name it uses
        model, base = names["model"], names["base_model"]
        moved = any(
            not torch.equal(p, q)
            for p, q in zip(model.parameters(), base.parameters(), strict=True)
        )
        print(json.dumps({{
            "rpb_file": rpb.__file__, "moved": moved,
            "prior": Path("prior.safetensors").is_file(),
            "detached": names["method"].control is None,
            "loaded": sorted(p for p in {PIPELINE!r} if p in sys.modules),
        }}))
        """
    )
    got = _run_python(driver, python=python, cwd=tmp_path, env=run_env)
    assert got["rpb_file"].startswith(str(venv)), "ran the working tree's rpb, not the install"
    assert got["prior"] and got["moved"] and got["detached"]
    assert got["loaded"] == []

    # The commands: `rpb prior` and `rpb finetune` (no --mlflow) on a tiny checkpoint folder.
    base, data = save_tiny_base(tmp_path / "base"), tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+1=", "completion": f"{a + 1}"}) + "\n"
            for a in range(10, 26)
        )
    )
    rpb = str(venv / "bin" / "rpb")
    model = ("--model", str(base), "--data", str(data))
    steps = ("--steps", "2", "--log-every", "1", "--batch-size", "4")
    commands = {
        "prior": [rpb, "prior", *model, "--out", "p.safetensors"],
        "finetune": [rpb, "finetune", *model, "--out", "ft", "--method", "rpb", *steps],
    }
    commands["finetune"] += ["--prior", "p.safetensors"]
    for name, argv in commands.items():
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=600
        )
        assert proc.returncode == 0, f"rpb {name}: {proc.stderr[-3000:]}"
    assert (tmp_path / "p.safetensors").is_file()
    history = json.loads((tmp_path / "ft" / "train_history.json").read_text())["history"]
    assert [entry["step"] for entry in history] == [1, 2]
    assert (tmp_path / "ft" / "eval_routing").is_dir()  # table 1's rpb: kept at evaluation
