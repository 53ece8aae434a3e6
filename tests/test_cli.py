"""Bad job inputs end the `rpb pipeline` jobs with exit code 2, one stderr line naming the file
(and line), and a FAILED MLflow run, instead of a traceback; and the command line's shape: the
people's commands at the top level, the pipeline's jobs under `rpb pipeline`, every rule's
command one that parses.

Everything runs in-process on two tiny random qwen3_moe bases (8 and 4 experts) saved with the
testbed tokenizer; one MLflow sqlite store is shared by the module (creating one costs seconds)
and each test logs to its own experiment, so its run is the only one there.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import new_store, save_tiny_base
from smoke_pipeline import snakemake_in_repo

from rpb.pipeline.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]

CORPUS_LINES = [{"prompt": f"SumOf{a}And{a + 1}?", "completion": str(2 * a + 1)} for a in (10, 20)]
SPEC = json.dumps({"steps": 1, "batch_size": 2, "lr": 1e-3, "max_length": 16})


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, empty_store: Path) -> Iterator[dict[str, Any]]:
    """Two saved bases, a valid corpus, a tracking store and a real prior of the 4-expert base."""
    import mlflow
    from transformers.utils import logging as hf_logging

    root = tmp_path_factory.mktemp("cli_errors")
    bases = {
        name: save_tiny_base(root / "models" / name / "base" / "model", experts)
        for name, experts in (("tiny8", 8), ("tiny4", 4))
    }
    # Progress bars would be extra stderr lines; the pipeline's logs keep them, this test doesn't.
    hf_logging.disable_progress_bar()
    previous_uri = mlflow.get_tracking_uri()
    world = {
        "root": root,
        "bases": bases,
        "corpus": _write_jsonl(root / "math.jsonl", CORPUS_LINES),
        "uri": new_store(empty_store, root / "m.db"),
    }
    world["prior4"] = root / "priors" / "tiny4" / "math.safetensors"
    world["prior_rc"] = main(
        [
            *("pipeline", "prior"),
            *("--tracking-uri", world["uri"], "--experiment", "valid_prior"),
            *("--name", "tiny4", "--model", str(bases["tiny4"])),
            *("--corpus", str(world["corpus"]), "--out", str(world["prior4"])),
        ]
    )
    yield world
    hf_logging.enable_progress_bar()
    mlflow.set_tracking_uri(previous_uri)


def _new_experiment(world: dict, name: str) -> None:
    """Create the job's experiment first, as `rpb pipeline init-tracking` does before the
    pipeline's jobs (else MLflow's own logger reports creating it on stderr)."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=world["uri"]).create_experiment(name)


def _prior(world: dict, corpus: Path, experiment: str) -> int:
    _new_experiment(world, experiment)
    out = world["root"] / "priors" / experiment / "math.safetensors"
    return main(
        [
            *("pipeline", "prior"),
            *("--tracking-uri", world["uri"], "--experiment", experiment),
            *("--name", "tiny8", "--model", str(world["bases"]["tiny8"])),
            *("--corpus", str(corpus), "--out", str(out)),
        ]
    )


def _train(
    world: dict, corpus: Path, experiment: str, prior: Path | None = None, method: str = "none"
) -> int:
    _new_experiment(world, experiment)
    args = [
        *("pipeline", "train"),
        *("--tracking-uri", world["uri"], "--experiment", experiment),
        *("--name", "tiny8", "--label", method, "--base", str(world["bases"]["tiny8"])),
        *("--corpus", str(corpus), "--corpus-name", "math"),
        *("--method", json.dumps({"kind": method}), "--spec", SPEC),
        *("--out", str(world["root"] / "runs" / experiment)),
    ]
    if prior is not None:
        args += ["--prior", str(prior)]
    return main(args)


def _run_status(world: dict, experiment: str) -> str:
    """Status of the only run in `experiment`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=world["uri"])
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0].info.status


def _one_error_line(capsys: pytest.CaptureFixture[str], job: str) -> str:
    """The one stderr line of a failed `rpb pipeline <job>`."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"rpb pipeline {job}: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


def _run(world: dict, job: str, corpus: Path, experiment: str) -> int:
    """`rpb pipeline prior` or `rpb pipeline train` (the pipeline's jobs, with --name)."""
    if job == "prior":
        return _prior(world, corpus, experiment)
    return _train(world, corpus, experiment)


def test_valid_prior_run_finishes(world: dict) -> None:
    """The fixture's own `rpb pipeline prior` worked: the FAILED checks below are not vacuous."""
    assert world["prior_rc"] == 0
    assert world["prior4"].is_file()
    assert _run_status(world, "valid_prior") == "FINISHED"


BAD_LINES = {
    "malformed_json": ('{"prompt": "SumOf1And2?", "completion": ', ":2: malformed JSON line"),
    "not_an_object": ('["SumOf1And2?", "3"]', ":2: expected a JSON object"),
    "missing_key": ({"prompt": "SumOf1And2?"}, ":2: missing key(s) ['completion']"),
}


@pytest.mark.parametrize("job", ["prior", "train"])
@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_corpus_line_names_file_and_line(
    world: dict, capsys: pytest.CaptureFixture[str], job: str, case: str
) -> None:
    bad_line, problem = BAD_LINES[case]
    corpus = _write_jsonl(world["root"] / f"{case}_{job}.jsonl", [CORPUS_LINES[0], bad_line])
    experiment = f"{case}_{job}"
    assert _run(world, job, corpus, experiment) == 2
    assert f"{corpus}{problem}" in _one_error_line(capsys, job)
    assert _run_status(world, experiment) == "FAILED"


@pytest.mark.parametrize("job", ["prior", "train"])
def test_empty_corpus_names_file(world: dict, capsys: pytest.CaptureFixture[str], job: str) -> None:
    corpus = world["root"] / f"empty_{job}.jsonl"
    corpus.write_text("")
    assert _run(world, job, corpus, f"empty_{job}") == 2
    assert f"{corpus}: empty file" in _one_error_line(capsys, job)
    assert _run_status(world, f"empty_{job}") == "FAILED"


def test_missing_corpus_names_file(world: dict, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = world["root"] / "no_such_corpus.jsonl"
    assert _train(world, corpus, "missing_corpus") == 2
    assert str(corpus) in _one_error_line(capsys, "train")
    assert _run_status(world, "missing_corpus") == "FAILED"


def _corrupt_prior(world: dict, how: str) -> Path:
    path = world["root"] / f"{how}.safetensors"
    if how == "garbage":
        path.write_bytes(b"\x00\x01 not a safetensors file " * 8)
    else:  # a real prior cut short, as a killed copy would leave it
        data = world["prior4"].read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_corrupt_prior_names_file(
    world: dict, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    prior = _corrupt_prior(world, how)
    assert _train(world, world["corpus"], f"corrupt_{how}", prior=prior, method="rpb") == 2
    line = _one_error_line(capsys, "train")
    assert str(prior) in line and "corrupt" in line
    assert _run_status(world, f"corrupt_{how}") == "FAILED"


def test_prior_of_another_model_is_rejected(
    world: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = _train(world, world["corpus"], "mismatch", prior=world["prior4"], method="rpb")
    assert rc == 2
    line = _one_error_line(capsys, "train")
    assert "experts 4 (prior) vs 8 (model)" in line
    assert _run_status(world, "mismatch") == "FAILED"


def test_prior_of_another_model_names_file(world: dict, capsys: pytest.CaptureFixture[str]) -> None:
    _train(world, world["corpus"], "mismatch_file", prior=world["prior4"], method="rpb")
    assert str(world["prior4"]) in _one_error_line(capsys, "train")


@pytest.mark.parametrize("job", ["prior", "train"])
def test_out_of_vocabulary_symbol_names_file_and_line(
    world: dict, capsys: pytest.CaptureFixture[str], job: str
) -> None:
    corpus = _write_jsonl(
        world["root"] / f"oov_{job}.jsonl",
        [CORPUS_LINES[0], {"prompt": "SumOf1And2\u20ac?", "completion": "3"}],
    )
    assert _run(world, job, corpus, f"oov_{job}") == 2
    assert f"{corpus}:2:" in _one_error_line(capsys, job)


@pytest.mark.parametrize(
    ("name", "ours"), [("mlflow", True), ("lm_eval.api", True), ("foo", False)]
)
def test_a_missing_pipeline_package_names_the_extra(capsys, monkeypatch, name, ours) -> None:
    """In a core-only install a pipeline subcommand fails in one line naming `.[pipeline]`;
    any other missing module stays an error with its traceback."""
    from types import SimpleNamespace

    import rpb.pipeline.cli as cli

    def missing(args) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    parsed = SimpleNamespace(command="pipeline", job="table1", verbose=False, func=missing)
    monkeypatch.setattr(cli, "build_parser", lambda: SimpleNamespace(parse_args=lambda a: parsed))
    if not ours:
        with pytest.raises(ModuleNotFoundError):
            cli.main([])
        return
    assert cli.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"rpb pipeline table1: error: needs {name}, which the pipeline extra installs: "
        "pip install '.[pipeline]' in a checkout of the rpb repository"
    ]


@pytest.mark.parametrize("command", ["finetune", "prior"])
def test_user_command_without_mlflow_names_the_mlflow_extra(capsys, monkeypatch, command) -> None:
    """`rpb finetune/prior --mlflow` on the light install needs MLflow alone: `.[mlflow]`, from
    the library's command line (rpb.user_cli) and the pipeline's alike."""
    from types import SimpleNamespace

    import rpb.pipeline.cli as cli
    import rpb.user_cli as user_cli

    def missing(args) -> None:
        raise ModuleNotFoundError("No module named 'mlflow'", name="mlflow")

    parsed = SimpleNamespace(command=command, verbose=False, func=missing)
    parser = SimpleNamespace(parse_args=lambda a: parsed)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(user_cli, "build_parser", lambda: parser)
    assert user_cli.main([]) == 2
    assert cli.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == 2 * [
        f"rpb {command}: error: needs mlflow, which the mlflow extra installs: "
        "pip install '.[mlflow]' in a checkout of the rpb repository"
    ]


# --- the command line's shape --------------------------------------------------------------------

# rpb.user_cli (and rpb.inspection's verb), the config check and the results folder's move to
# base<b>/seed<s> paths.
PEOPLE = {"finetune", "inspect", "prior", "check-config", "relayout"}


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """name -> parser of each subcommand of `parser`."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_the_top_level_is_the_people_s_commands_and_pipeline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rpb --help` lists finetune, inspect, prior, check-config, relayout and pipeline, nothing
    else; every job is under `rpb pipeline`, dash-spelled; an old top-level job (`rpb train`) is a
    usage error."""
    parser = build_parser()
    top = _commands(parser)
    assert set(top) == PEOPLE | {"pipeline"}
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out.split("positional arguments:", 1)[1].split("options:", 1)[0]
    assert set(re.findall(r"^    (\S+)", listed, flags=re.M)) == PEOPLE | {"pipeline"}, listed
    jobs = _commands(top["pipeline"])
    assert {"init-tracking", "prior", "train", "run", "table1", "router-swap-table"} <= set(jobs)
    for name in jobs:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), name
    for old in ("train", "init-tracking", "table1"):
        with pytest.raises(SystemExit) as exit_:
            main([old, "--help"])
        assert exit_.value.code == 2
        assert f"invalid choice: '{old}'" in capsys.readouterr().err


# The pipeline's job alone takes these (its config name, the base's place, its run group).
PIPELINE_PRIOR_FLAGS = ("--name", "--family", "--base-index", "--run-group", "--corpus")


def _flags(help_text: str) -> set[str]:
    """The flags listed in a --help's options section (not its epilog's examples)."""
    options = help_text.split("options:", 1)[1].split("example:", 1)[0]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", options))


def test_people_s_prior_help_lists_the_user_s_flags_only() -> None:
    """`rpb prior --help` shows the user's flags, not the pipeline job's; `rpb pipeline prior`
    keeps them; the two forms are two functions, and the pipeline's needs --name."""
    from rpb.user_cli import cmd_prior

    top = _commands(build_parser())
    people = _flags(top["prior"].format_help())
    user = {"--model", "--data", "--out", "--batch-size", "--text-field", "--max-length"}
    assert user | {"--mlflow", "--tracking-uri", "--experiment"} <= people
    assert not people & set(PIPELINE_PRIOR_FLAGS), sorted(people)
    job = _flags(_commands(top["pipeline"])["prior"].format_help())
    assert set(PIPELINE_PRIOR_FLAGS) | user <= job
    args = build_parser().parse_args(
        ["prior", "--model", "m", "--data", "d.jsonl", "--out", "p.safetensors", "--mlflow"]
    )
    assert args.func is cmd_prior and not hasattr(args, "name")
    with pytest.raises(SystemExit):  # the job's form without the job's --name
        build_parser().parse_args(
            ["pipeline", "prior", "--model", "m", "--corpus", "d", "--out", "p"]
        )
    assert (args.tracking_uri, args.experiment, args.mlflow) == (None, "rpb", True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["prior", "--model", "m", "--data", "d", "--out", "p", "--name", "x"]
        )


def test_every_report_job_is_under_pipeline_with_its_key() -> None:
    """Each REPORT_JOBS key is the job `rpb pipeline <key, dashes for underscores>`, whose
    `args.report` is the key itself (the stage and the config's `tables` key); the underscore
    spelling is not a second name for it."""
    from rpb.pipeline.cli import cmd_report
    from rpb.report.registry import REPORT_JOBS

    flags = ["--results", "r", "--spec", "{}", "--out", "o.csv"]
    for key in REPORT_JOBS:
        args = build_parser().parse_args(["pipeline", key.replace("_", "-"), *flags])
        assert (args.command, args.job, args.report) == ("pipeline", key.replace("_", "-"), key)
        assert args.func is cmd_report
        if "_" in key:
            with pytest.raises(SystemExit):
                build_parser().parse_args(["pipeline", key, *flags])


def _rpb_command(line: str) -> list[str] | None:
    """The `rpb` arguments of one command a dry run prints (`Shell command: rpb ...`), without
    the shell's redirections and what follows `&&`; None for any other line."""
    line = line.strip().removeprefix("Shell command:").strip()
    if not line.startswith("rpb "):
        return None
    words = shlex.split(line)
    end = next(
        (i for i, w in enumerate(words) if w in ("&&", "||", "|", ";") or re.match(r"\d*>", w)),
        len(words),
    )
    return words[1:end]


@pytest.mark.workflow
def test_every_rule_s_rpb_command_parses(tmp_path: Path) -> None:
    """`snakemake -n -p` of the smoke config's `all` prints every job's shell command: each
    `rpb ...` one parses with the CLI's parser, and together they use every pipeline job (with an
    eval-only set named, for `eval-set`)."""
    results = tmp_path / "results"
    eval_only = tmp_path / "eval_only.yaml"
    eval_only.write_text(
        "evaluation:\n  ood: [addition, facts, reverse, sort, grammar, addition3]\n"
    )
    proc = snakemake_in_repo(
        *("-n", "-p", "--cores", "1", "--configfile", "config/smoke.yaml", str(eval_only)),
        *("--config", f"results_dir={results}", "--", "all"),
        timeout=600,
    )
    commands = [argv for line in proc.stdout.splitlines() if (argv := _rpb_command(line))]
    assert len(commands) > 50, proc.stdout[-3000:]
    parser = build_parser()
    seen = set()
    for argv in commands:
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"a rule's command does not parse: rpb {shlex.join(argv)}")
        assert args.command == "pipeline", argv
        seen.add(args.job)
    # fix-bases is a maintainer's command (it writes bases/), never a rule's
    assert seen == set(_commands(_commands(parser)["pipeline"])) - {"fix-bases"}, seen
