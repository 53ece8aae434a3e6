"""Safety: no remote code unless a model's config entry asks for it, the MLflow UI listens on
loopback only, and credentials never reach MLflow params or logs."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import new_store

from rpb.pipeline.tracking import init_store, redact_uri, scrub, tracked_run

ROOT = Path(__file__).resolve().parents[1]
PYTHON_SOURCES = [
    *sorted((ROOT / "rpb").rglob("*.py")),
    *sorted((ROOT / "workflow" / "scripts").glob("*.py")),
    *sorted((ROOT / "bench").glob("*.py")),
]
FAKE_TOKEN = "hf_" + "Zq7" * 12  # shaped like a Hugging Face token


def _trust_keywords(tree: ast.AST) -> list[tuple[ast.keyword, list[ast.AST]]]:
    """Every `trust_remote_code=` keyword argument with the chain of nodes enclosing it."""
    found = []

    def visit(node: ast.AST, chain: list[ast.AST]) -> None:
        if isinstance(node, ast.Call):
            found.extend((kw, chain) for kw in node.keywords if kw.arg == "trust_remote_code")
        for child in ast.iter_child_nodes(node):
            visit(child, [*chain, node])

    visit(tree, [])
    return found


def _guarded_by_flag(chain: list[ast.AST]) -> bool:
    """Inside the body of an `if` that tests a `trust_remote_code`/`trust` variable."""
    for node in chain:
        if isinstance(node, ast.If):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if names & {"trust_remote_code", "trust"}:
                return True
    return False


def test_no_unconditional_trust_remote_code() -> None:
    """`trust_remote_code=True` only where a config flag has already said so; everything else
    passes a variable (or nothing: transformers' default is False)."""
    offenders, seen = [], 0
    for path in PYTHON_SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for kw, chain in _trust_keywords(tree):
            seen += 1
            literal_true = isinstance(kw.value, ast.Constant) and kw.value.value is True
            if literal_true and not _guarded_by_flag(chain):
                offenders.append(f"{path.relative_to(ROOT)}:{kw.value.lineno}")
    assert not offenders, f"unconditional trust_remote_code=True at {offenders}"
    assert seen >= 2, "the scan found no trust_remote_code arguments at all: is it still working?"


def test_configs_trust_remote_code_only_for_named_hub_models() -> None:
    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    model_schema = schema["$defs"]["model"]["properties"]
    assert model_schema["trust_remote_code"] == {"type": "boolean", "default": False}
    for name in ("config.yaml", "smoke.yaml", "paper.yaml"):
        text = (ROOT / "config" / name).read_text()
        config = yaml.safe_load(text)
        # Set nowhere but under models.<name>, and true only for hub models.
        assert text.count("trust_remote_code") == sum(
            "trust_remote_code" in entry for entry in config.get("models", {}).values()
        ), name
        for model, entry in config.get("models", {}).items():
            if entry.get("trust_remote_code"):
                assert entry["source"] == "hub" and len(entry["revision"]) == 40, (name, model)


def _hub_script() -> Any:
    path = ROOT / "workflow" / "scripts" / "hub_download.py"
    spec = importlib.util.spec_from_file_location("hub_download_safety", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("trust", [False, True])
def test_download_takes_trust_remote_code_from_the_model_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trust: bool
) -> None:
    import transformers

    from rpb.architectures import random_model
    from rpb.pipeline.tokenizer import build_tokenizer

    stage = tmp_path / "stage"
    tok = build_tokenizer(stage)
    random_model("qwen3_moe", vocab_size=len(tok)).save_pretrained(stage)
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("trust_remote_code", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    entry = {"hf_id": "org/x", "revision": "0" * 40, "model_type": "qwen3_moe"}
    if trust:
        entry["trust_remote_code"] = True
    manifest = _hub_script().finalize_model_dir("x", entry, stage)
    assert calls == [trust] and manifest["trust_remote_code"] is trust


def _paper_dry_run_commands(results: Path) -> list[str]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = [
        *(sys.executable, "-m", "snakemake", "-n", "-p", "--configfile", "config/paper.yaml"),
        *("--config", f"results_dir={results}", "--", f"{results}/table1.csv"),
        f"{results}/eval/qwen3/math2/rpb/base0/seed0.json",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [line for line in proc.stdout.splitlines() if " --name " in line]


@pytest.mark.workflow
def test_jobs_take_trust_remote_code_from_the_model_entry(tmp_path: Path) -> None:
    """`--trust-remote-code` on exactly the moonlight jobs, of all four job kinds that load it."""
    commands = _paper_dry_run_commands(tmp_path / "results")
    kinds = set()
    for line in commands:
        name = re.search(r" --name (\S+)", line).group(1)
        kinds.add(re.search(r"\bpipeline (train|prior|eval|analyze) --name", line).group(1))
        assert ("--trust-remote-code" in line) == (name == "moonlight"), line
    assert kinds == {"train", "prior", "eval", "analyze"}, kinds


@pytest.mark.parametrize("command", ["train", "prior", "eval", "analyze"])
def test_cli_passes_trust_remote_code_through(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    """The flag reaches the function that loads the tokenizer, and is off unless given."""
    import rpb.pipeline.analysis
    import rpb.pipeline.evaluation
    import rpb.pipeline.tracking
    import rpb.pipeline.training
    from rpb.pipeline.cli import build_parser

    target = {
        "train": (rpb.pipeline.training, "posttrain"),
        "prior": (rpb.pipeline.analysis, "extract_prior_from_corpus"),
        "eval": (rpb.pipeline.evaluation, "evaluate_model"),
        "analyze": (rpb.pipeline.analysis, "analyze_model"),
    }[command]
    seen = []

    def stop(*args: Any, **kwargs: Any) -> None:
        seen.append(kwargs["trust_remote_code"])
        raise ValueError("stop here")  # before anything is loaded or written

    monkeypatch.setattr(*target, stop)
    p = str(tmp_path / "x")
    argv = {
        "train": [
            "--label",
            "m",
            "--base",
            p,
            "--corpus",
            p,
            "--corpus-name",
            "c",
            "--method",
            '{"name": "none"}',
            "--spec",
            '{"steps": 1, "batch_size": 1, "lr": 0.1}',
            "--out",
            p,
        ],
        "prior": ["--model", p, "--corpus", p, "--out", f"{p}.safetensors"],
        "eval": [
            "--label",
            "m",
            "--model",
            p,
            "--eval-dir",
            p,
            "--tasks",
            "t",
            "--work",
            p,
            "--out",
            f"{p}.json",
        ],
        "analyze": [
            "--label",
            "m",
            "--model",
            p,
            "--base",
            p,
            "--prior",
            p,
            "--eval-dir",
            p,
            "--tasks",
            "t",
            "--out",
            f"{p}.json",
        ],
    }[command]
    monkeypatch.setattr(rpb.pipeline.tracking, "tracked_run", lambda **_: contextlib.nullcontext())
    for flag in ([], ["--trust-remote-code"]):
        args = build_parser().parse_args(["pipeline", command, "--name", "x", *argv, *flag])
        with pytest.raises(ValueError, match="stop here"):
            args.func(args)
    assert seen == [False, True]


def test_mlflow_ui_binds_loopback_only() -> None:
    """Every documented `mlflow ui`/`mlflow server` command binds loopback, explicitly or by
    MLflow's default (MLflow has no auth by default: 0.0.0.0 would publish every run)."""
    from mlflow.cli import cli

    (default,) = [p.default for p in cli.commands["server"].params if p.name == "host"]
    commands = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        commands += re.findall(r"\bmlflow (?:ui|server) --[^`\n]*", text)
    assert any("mlflow ui" in c for c in commands), "README.md documents no mlflow ui command"
    readme = (ROOT / "README.md").read_text()
    assert "mlflow ui --backend-store-uri sqlite:///results/mlflow.db --host 127.0.0.1" in readme
    for command in commands:
        hosts = re.findall(r"(?:--host|-h)[ =](\S+)", command) or [default]
        assert all(h in {"127.0.0.1", "localhost", "::1"} for h in hosts), command


def test_scrub_drops_credentials_and_keeps_lookalikes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    params = {
        "lr": 0.001,
        "hf_token": "abc",
        "HUGGING_FACE_HUB_TOKEN": "abc",
        "hub": {"api_key": "k", "password": "p", "revision": "main"},
        "note": f"pulled with {FAKE_TOKEN}",  # the env's token under an innocent key
        "header": "Bearer xyz",
        "other": "hf_" + "a" * 30,  # any token-shaped value
        "tokenizer": "/models/tok",
        "n_tokens": 128,
        "pad_token_id": 0,
    }
    assert scrub(params) == {
        "lr": 0.001,
        "hub.revision": "main",
        "tokenizer": "/models/tok",
        "n_tokens": 128,
        "pad_token_id": 0,
    }


def test_redact_uri_hides_passwords_only() -> None:
    assert (
        redact_uri("postgresql://rpb:s3cret@db:5432/mlflow")
        == "postgresql://rpb:***@db:5432/mlflow"
    )
    for uri in ("sqlite:////tmp/mlflow.db", "http://127.0.0.1:5000", "https://user@host/x"):
        assert redact_uri(uri) == uri


def test_tracked_run_writes_no_secret_anywhere(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    empty_store: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    uri = new_store(empty_store, tmp_path / "m.db")
    caplog.set_level(logging.DEBUG)
    experiment_id = init_store(uri, "safety")
    params = {"hf_token": FAKE_TOKEN, "train": {"lr": 0.1, "hub_token": FAKE_TOKEN}}
    with tracked_run(
        stage="train", model="m", params=params, tracking_uri=uri, experiment="safety"
    ):
        pass
    (run,) = MlflowClient(tracking_uri=uri).search_runs([experiment_id])
    own = {k: v for k, v in run.data.params.items() if not k.startswith("numerics.")}
    assert own == {"train.lr": "0.1"}  # numerics.*: the CPU path (rpb.numerics)
    assert run.data.tags["model"] == "m"  # the schema's (rpb.pipeline.tracking.SCHEMA_TAGS)
    assert FAKE_TOKEN not in repr(run.data.tags) + caplog.text
    # Nor anywhere in the store's file.
    assert FAKE_TOKEN.encode() not in (tmp_path / "m.db").read_bytes()
