"""`rpb finetune` and `rpb prior`, the command line for people (rpb.user_cli): offline,
in-process, on a tiny random Qwen3-MoE checkpoint folder saved with the testbed tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import new_store

from rpb.architectures import random_model
from rpb.cli import main
from rpb.pipeline.tokenizer import build_tokenizer
from rpb.prior import RouterPrior
from rpb.trainable import parameter_parts
from rpb.user_cli import build_parser

PAIRS = [(f"SumOf{a}And{a + 1}?", str(2 * a + 1)) for a in range(10, 26)]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # a trailing blank line
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("people_cli")
    tok = build_tokenizer()
    model = random_model(
        "qwen3_moe",
        seed=0,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    base = root / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    dense = root / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return {
        "root": root,
        "base": base,
        "dense": dense,
        "text": _write_jsonl(root / "text.jsonl", [{"text": p + c} for p, c in PAIRS]),
        "pairs": _write_jsonl(
            root / "pairs.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS]
        ),
    }


def _finetune(world: dict[str, Path], out: Path, *flags: str, data: str = "text") -> int:
    return main(
        [
            "finetune",
            *("--model", str(world["base"]), "--data", str(world[data]), "--out", str(out)),
            *("--steps", "3", "--batch-size", "4", "--lr", "1e-2", "--log-every", "1"),
            *flags,
        ]
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """The loaded model's tensors (transformers fuses the saved per-expert tensors); a steered
    folder's (keep_bias_at_eval) too."""
    from rpb.eval_routing import load_model

    return load_model(folder, steer=False).state_dict()


@pytest.mark.parametrize("configfile", ["config.yaml", "paper.yaml"])
def test_the_cli_s_and_the_library_s_rpb_is_table_1s_rpb(configfile: str) -> None:
    """`rpb finetune --method rpb`, `make_method("rpb")` and `MethodConfig("rpb")` are the method
    table 1 measures (the config's `methods.rpb`, as the planner reads it): the same value, its
    bias kept at evaluation, and the same options built."""
    import yaml

    from rpb.method_config import MethodConfig
    from rpb.methods import make_method
    from rpb.user_cli import method_choice

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / configfile).open())
    assert "rpb" in config.get("table1", {"methods": ["rpb"]})["methods"]
    table1 = MethodConfig.from_entry("rpb", config["methods"]["rpb"])
    args = build_parser().parse_args(["finetune", "--model", "m", "--data", "d", "--out", "o"])
    cli = method_choice(args)
    assert args.method == "rpb" and cli == table1 == MethodConfig("rpb")
    assert cli.keeps_routing_at_eval and table1.options.keep_bias_at_eval is True
    assert MethodConfig.of(make_method("rpb")) == table1
    assert make_method("rpb").options == table1.build().options
    # The selection-only reading is spelled out: rpb_select drops the bias at evaluation.
    select = MethodConfig.from_entry("rpb_select", config["methods"]["rpb_select"])
    assert not select.keeps_routing_at_eval


_REQUIRED = ("finetune", "--model", "m", "--data", "d", "--out", "o")


def test_finetune_s_training_flags_are_train_spec_s_fields(capsys: pytest.CaptureFixture) -> None:
    """Issue 60: `rpb finetune`'s training flags are generated from TrainSpec's field metadata
    (rpb.train_spec): each sets its field, with the field's bounds and choices, one epoch where
    --steps is not given, and the warm-up as the steps given."""
    from rpb.user_cli import finetune_spec, train_flag_fields

    flags = ("--steps", "5", "--warmup-steps", "2", "--trunk-lr-scale", "0.5")
    flags += ("--trainable", "moe", "--save-steps", "2", "--gradient-checkpointing")
    args = build_parser().parse_args([*_REQUIRED, *flags])
    spec = finetune_spec(args, examples=100, processes=1, evaluate=False)
    assert (spec.steps, spec.warmup, spec.trunk_lr_scale, spec.trainable) == (5, 2, 0.5, "moe")
    assert spec.save_every == 2 and spec.gradient_checkpointing
    assert (spec.lr, spec.batch_size, spec.max_length, spec.eval_every) == (1e-5, 8, 1024, 0)
    args = build_parser().parse_args([*_REQUIRED, "--batch-size", "8", "--grad-accum", "2"])
    assert finetune_spec(args, examples=100, processes=1, evaluate=False).steps == 7  # 13 / 2
    names = {f.name for f in train_flag_fields()}
    assert {"steps", "lr", "warmup_steps", "trunk_lr_scale", "eval_every", "report_to"} <= names
    assert not names & {"base", "threads", "warmup_ratio", "scheduler"}  # the command's own
    for bad, says in (
        (("--lr", "0"), "argument --lr: must be > 0, got 0.0"),
        (("--trunk-lr-scale", "2"), "argument --trunk-lr-scale: must be <= 1, got 2.0"),
        (("--steps", "0"), "argument --steps: must be >= 1, got 0"),
        (("--max-length", "x"), "argument --max-length: not an integer: 'x'"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*_REQUIRED, *bad])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert says in line, line


@pytest.mark.slow  # a fresh interpreter that extracts a prior and trains a step
@pytest.mark.parametrize("logged", [False, True], ids=["plain", "mlflow"])
def test_the_people_s_commands_load_no_module_of_the_pipeline(
    world: dict[str, Path], tmp_path: Path, empty_store: Path, logged: bool
) -> None:
    """Issue 60: `rpb prior` and `rpb finetune` (rpb.cli's people's verbs) run with the library
    alone, also with `--mlflow` (their runs are rpb.tracking's): a fresh interpreter running both
    has no module of rpb.pipeline or rpb.report loaded (what tests/test_import_graph.py's static
    graph cannot see: an import by name)."""
    import os
    import subprocess
    import sys

    data = ("--model", str(world["base"]), "--data", str(world["pairs"]))
    uri = new_store(empty_store, tmp_path / "m.db") if logged else ""
    store = ("--mlflow", "--tracking-uri", uri, "--experiment", "people") if logged else ()
    prior = ["prior", *data, "--out", "p.safetensors", *store]
    finetune = ["finetune", *data, "--out", "ft", "--prior", "p.safetensors", "--steps", "1"]
    finetune += store
    code = f"""
import json, sys
from rpb.cli import main
codes = [main({prior!r}), main({finetune!r})]
wings = sorted(m for m in sys.modules if m.startswith(("rpb.pipeline", "rpb.report")))
print(json.dumps({{"codes": codes, "wings": wings}}))
"""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"codes": [0, 0], "wings": []}
    assert (tmp_path / "ft" / "train_history.json").is_file()
    if logged:  # both runs were logged, and ended well
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=uri)
        runs = client.search_runs([client.get_experiment_by_name("people").experiment_id])
        ended = sorted((r.data.tags["stage"], r.info.status) for r in runs)
        assert ended == [("finetune", "FINISHED"), ("prior", "FINISHED")]


def test_prior_help_shows_every_default() -> None:
    """`rpb prior --help` says what each optional flag is when not given: the batch of texts per
    forward and the tokens per text above all (a big batch on a big model)."""
    verbs = build_parser()._subparsers._group_actions[0].choices
    parser = verbs["prior"]
    text = " ".join(parser.format_help().split())
    assert "texts per forward (default: 128)" in text
    assert "tokens per text (default: 1024)" in text
    assert "(default: text)" in text and "(default: rpb)" in text
    for action in parser._actions:
        if action.required or action.nargs == 0:
            continue
        assert "default" in (action.help or "") or f"(default: {action.default})" in text, (
            action.option_strings
        )


@pytest.mark.parametrize("verb", ["prior", "finetune"])
def test_a_hub_id_gets_a_download_hint(
    verb: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    argv = [verb, "--model", "moonshotai/Moonlight-16B-A3B", "--data", str(data)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rpb {verb}: error: --model moonshotai/Moonlight-16B-A3B: no such")
    assert "hf download moonshotai/Moonlight-16B-A3B --local-dir DIR" in line
    # A folder name that is no hub id gets no hint.
    assert main([verb, "--model", "nope", "--data", str(data), "--out", "o"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("--model nope: no such folder (a local checkpoint folder)")


def test_every_verb_s_help_has_an_example() -> None:
    verbs = build_parser()._subparsers._group_actions[0].choices
    for verb in ("finetune", "prior"):
        text = verbs[verb].format_help()
        assert "example:" in text and f"rpb {verb} --model" in text, verb


def test_finetune_rpb_extracts_the_prior_and_trains_only_the_moe_part(
    world: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from rpb.eval_routing import is_steered_folder, load_model

    out = tmp_path / "ft"
    caplog.set_level("INFO", logger="rpb")
    rc = _finetune(world, out, "--method", "rpb", "--strength", "1", "--trainable", "moe")
    assert rc == 0
    # No --prior: extracted from the model on the data first, said in a log line, kept in OUT.
    assert any("no --prior was given: extracting it" in r.getMessage() for r in caplog.records)
    prior = RouterPrior.load(out / "router_prior.safetensors")
    tok = build_tokenizer()
    assert prior.n_tokens == sum(len(tok(p + c)["input_ids"]) + 1 for p, c in PAIRS)  # + EOS
    assert prior.model_type == "qwen3_moe" and prior.corpus_hash
    # `--method rpb` is table 1's rpb, its bias kept at evaluation: the saved folder steers
    # (rpb.eval_routing) and loads with its routing, tokenizer beside it.
    model = load_model(out)
    prior.check_compatible(model)
    assert (out / "tokenizer.json").is_file() and is_steered_folder(out)
    # The prior was used: drift from the base router is measured at every log.
    history = json.loads((out / "train_history.json").read_text())["history"]
    assert [e["step"] for e in history] == [1, 2, 3]
    assert all("mean/kl_to_base" in e and e["router_loss"] == 0.0 for e in history)
    # Every expert's share is kept (docs/library.md), not only the per-layer summaries.
    assert all("layer0/load/expert0" in e and "layer1/max_load_ratio" in e for e in history)
    # --trainable moe: routers and routed experts moved; the trunk did not, embedding and output
    # rows included: a checkpoint's tokens have no pretraining record, so none is a new token
    # (rpb.posttraining.posttrain_model's new_token_ids, which only the pipeline's tiny bases
    # have; before issue 60, rpb finetune took the testbed's own for a tiny base's tokenizer).
    before, after = _weights(world["base"]), _weights(out)
    parts = parameter_parts(model)
    changed = {part: [] for part in ("routers", "routed_experts", "trunk")}
    for name, tensor in before.items():
        if not torch.equal(tensor, after[name]):
            changed[parts[name]].append(name)
    assert len(changed["routers"]) == prior.num_layers
    assert changed["routed_experts"]
    assert changed["trunk"] == []


def test_prior_verb_writes_a_prior_that_finetune_uses(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rpb.tracking

    def no_mlflow(**_: Any) -> None:
        raise AssertionError("the people form opens no MLflow run without --mlflow")

    monkeypatch.setattr(rpb.tracking, "tracked_run", no_mlflow)
    prior_path = tmp_path / "priors" / "prior.safetensors"
    argv = ["prior", "--model", str(world["base"]), "--data", str(world["pairs"])]
    assert main([*argv, "--out", str(prior_path)]) == 0
    prior = RouterPrior.load(prior_path)
    assert prior.model_type == "qwen3_moe" and prior.n_tokens > len(PAIRS)
    assert json.loads(prior_path.with_suffix(".json").read_text())["summary"]["usage_entropy"]
    # The same data as text lines gives the same prior (prompt + completion are the text).
    text_prior = tmp_path / "text.safetensors"
    argv = ["prior", "--model", str(world["base"]), "--data", str(world["text"])]
    assert main([*argv, "--out", str(text_prior)]) == 0
    assert torch.equal(RouterPrior.load(text_prior).usage, prior.usage)

    out = tmp_path / "ft"
    flags = ("--method", "anchor_kl", "--prior", str(prior_path), "--trainable", "all")
    assert _finetune(world, out, *flags, data="pairs") == 0
    assert not (out / "router_prior.safetensors").exists()  # given, not extracted
    history = json.loads((out / "train_history.json").read_text())
    assert history["params"]["form"] == "prompt_completion"
    # anchor_kl's term is KL(base router || live router): zero at the start, then it grows.
    assert all("mean/kl_to_base" in e for e in history["history"])
    assert history["history"][-1]["router_loss"] > 0
    before, after = _weights(world["base"]), _weights(out)
    assert all(not torch.equal(t, after[n]) for n, t in before.items() if "norm" not in n)


def test_finetune_logs_to_mlflow_only_when_asked(
    world: dict[str, Path], tmp_path: Path, empty_store: Path
) -> None:
    import mlflow

    uri = new_store(empty_store, tmp_path / "m.db")
    previous = mlflow.get_tracking_uri()
    try:
        flags = ("--method", "lbl", "--mlflow", "--tracking-uri", uri, "--experiment", "people")
        assert _finetune(world, tmp_path / "ft", *flags) == 0
        runs = mlflow.MlflowClient(tracking_uri=uri).search_runs(
            [mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name("people").experiment_id]
        )
    finally:
        mlflow.set_tracking_uri(previous)
    (run,) = runs
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.runName"] == "finetune/base/text/lbl/seed0"
    assert run.data.metrics["router_loss"] > 0 and "mean/usage_entropy" in run.data.metrics
    assert "layer1/load/expert7" in run.data.metrics  # every share, as train_history.json


def test_a_bad_method_is_one_line_naming_it(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as stop:
        _finetune(world, tmp_path / "ft", "--method", "rbp")
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rpb finetune: error: argument --method: unknown router method 'rbp'")


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (("--data", "missing.jsonl"), "--data missing.jsonl: no such file"),
        (("--model", "dense"), "model type 'llama' is not a MoE family rpb routes"),
        (("--prior", "missing.safetensors"), "--prior missing.safetensors: no such file"),
        (("--method", "none", "--strength", "2"), "strength of method 'none': 'none' takes no"),
        (("--strength", "-1"), "strength of method 'rpb': -1.0 is not a finite number >= 0"),
        (("--option", "bias_on=both"), "option bias_on of method 'rpb': 'both' is not one of"),
    ],
)
def test_bad_input_is_one_line_naming_the_culprit(
    world: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...],
    culprit: str,
) -> None:
    monkeypatch.chdir(world["root"])
    rc = _finetune(world, tmp_path / "ft", *flags)
    assert rc == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rpb finetune: error: ") and culprit in line, line
    assert not (tmp_path / "ft").exists()


def test_a_failed_finetune_leaves_no_empty_out_folder(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Issue 47: a finetune that failed after creating --out (here on an all-NaN prior) left
    it empty; a folder that was there before is kept."""
    prior = RouterPrior.load(_prior_of_base(world, tmp_path))
    nan = RouterPrior(**{**vars(prior), "mean_probs": torch.full_like(prior.mean_probs, math.nan)})
    nan_path = nan.save(tmp_path / "nan.safetensors")
    out = tmp_path / "new" / "ft"
    assert _finetune(world, out, "--method", "anchor_kl", "--prior", str(nan_path)) == 2
    assert "non-finite value(s)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)
    assert _finetune(world, out, "--method", "anchor_kl", "--prior", str(nan_path)) == 2
    assert out.is_dir()  # not of this run's making


def _prior_of_base(world: dict[str, Path], tmp_path: Path) -> Path:
    path = tmp_path / "prior.safetensors"
    argv = ["prior", "--model", str(world["base"]), "--data", str(world["pairs"])]
    assert main([*argv, "--out", str(path)]) == 0
    return path


def test_bad_data_lines_are_named(world: dict[str, Path], tmp_path: Path, capsys) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "SumOf1And2?3"}\n{"prompt": "SumOf1And2?"}\n')
    rc = main(
        ["prior", "--model", str(world["base"]), "--data", str(data), "--out", str(tmp_path / "p")]
    )
    assert rc == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"rpb prior: error: {data}:2: missing field(s) ['text']"


def test_the_checkpoint_s_own_load_balancing_loss_stays_off(
    world: dict[str, Path], tmp_path: Path
) -> None:
    """A config asking for router logits would add the model's own aux loss to the task loss (a
    second router term): it is off while training, and the saved config keeps the flag."""
    import shutil

    flagged = tmp_path / "flagged"
    shutil.copytree(world["base"], flagged)
    config = json.loads((flagged / "config.json").read_text())
    (flagged / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    losses = []
    for name, model in (("plain", world["base"]), ("flagged", flagged)):
        out = tmp_path / f"{name}-none"
        assert _finetune({**world, "base": model}, out, "--method", "none", "--steps", "1") == 0
        history = json.loads((out / "train_history.json").read_text())["history"]
        losses.append(history[0]["task_loss"])
    assert losses[0] == losses[1]
    saved = json.loads((tmp_path / "flagged-none" / "config.json").read_text())
    assert saved["output_router_logits"] is True


def test_finetune_refuses_a_non_empty_out_in_one_line(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Issue 46: an rpb model was silently replaced by an anchor_kl run in the same --out."""
    out = tmp_path / "ft"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier run's weights")
    assert _finetune(world, out, "--method", "anchor_kl") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty (holds model.safetensors" in err[0], err
    assert (out / "model.safetensors").read_bytes() == b"an earlier run's weights"


class _Interrupted(Exception):
    """The job's end in the middle of training (a preemption), right after a checkpoint."""


def test_an_interrupted_finetune_resumes_to_the_uninterrupted_weights(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: `rpb finetune --resume` continues from the last complete checkpoint to the
    weights, history and eval losses of a run that was never stopped. rpb_adaptive keeps state
    outside the model (its bias) and extracts its prior itself, which the resume reuses."""
    from safetensors.torch import load_file

    import rpb.posttraining as training

    flags = (
        *("--method", "rpb_adaptive", "--option", "update_rate=0.05"),
        *("--steps", "6", "--save-steps", "2", "--eval-every", "2"),
        *("--eval-file", str(world["pairs"])),
    )
    ref = tmp_path / "ref"
    assert _finetune(world, ref, *flags, data="pairs") == 0

    out = tmp_path / "ft"
    on_save = training.CheckpointStateCallback.on_save

    def stop_after_checkpoint_4(self, args, state, control, **kwargs):
        on_save(self, args, state, control, **kwargs)
        if state.global_step == 4:
            raise _Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(training.CheckpointStateCallback, "on_save", stop_after_checkpoint_4)
        with pytest.raises(_Interrupted):
            _finetune(world, out, *flags, data="pairs")
    held = sorted(p.name for p in out.iterdir())
    assert held == [
        "checkpoints",
        "router_prior.json",
        "router_prior.safetensors",
        "rpb_finetune.json",
    ]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-4"]
    # Without --resume the interrupted run's folder is refused like any other.
    assert _finetune(world, out, *flags, data="pairs") == 2

    assert _finetune(world, out, *flags, "--resume", data="pairs") == 0
    # Finished: the model folder took --out's place, with the prior, without the checkpoints.
    assert not (out / "checkpoints").exists() and not (out / "rpb_finetune.json").exists()
    assert (out / "router_prior.safetensors").is_file()
    want, got = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert want.keys() == got.keys()
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run: {differ[:5]}"
    history = json.loads((out / "train_history.json").read_text())
    assert history == json.loads((ref / "train_history.json").read_text())
    assert [e["step"] for e in history["history"]] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in history["eval"]] == [2, 4, 6]
    assert all(math.isfinite(e["eval_loss"]) for e in history["eval"])


def _rpb_lines(capsys: pytest.CaptureFixture) -> list[str]:
    """stderr's lines but transformers' progress bars (loading the base), which is all else."""
    err = capsys.readouterr().err.replace("\r", "\n").splitlines()
    return [line for line in err if line.strip() and "it/s]" not in line]


def test_a_damaged_checkpoint_names_itself_and_the_previous_one_takes_over(
    world: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 59, item 3: `optimizer.pt` cut to 1000 bytes or a missing `trainer_state.json` in
    the last complete checkpoint gave 36 lines of torch or a bare `[Errno 2]` at every resume. Now
    one line naming the checkpoint, its file and the command that discards it (nothing deleted);
    with an earlier complete checkpoint beside it, the resume falls back to that one and ends
    with the uninterrupted weights."""
    import shutil

    from safetensors.torch import load_file

    import rpb.posttraining as training

    flags = ("--method", "none", "--steps", "6", "--save-steps", "2")
    ref = tmp_path / "ref"
    assert _finetune(world, ref, *flags) == 0

    out, kept = tmp_path / "ft", tmp_path / "checkpoint-2"
    on_save = training.CheckpointStateCallback.on_save

    def stop_after_checkpoint_4(self, args, state, control, **kwargs):
        on_save(self, args, state, control, **kwargs)
        if state.global_step == 2:  # what rotation removes once checkpoint-4 is complete
            shutil.copytree(out / "checkpoints" / "checkpoint-2", kept)
        if state.global_step == 4:
            raise _Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(training.CheckpointStateCallback, "on_save", stop_after_checkpoint_4)
        with pytest.raises(_Interrupted):
            _finetune(world, out, *flags)
    last = out / "checkpoints" / "checkpoint-4"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-4"]
    capsys.readouterr()

    state = (last / "trainer_state.json").read_bytes()
    (last / "trainer_state.json").unlink()
    assert _finetune(world, out, *flags, "--resume") == 2
    (line,) = _rpb_lines(capsys)
    assert line == (
        f"rpb finetune: error: {last}: trainer_state.json: missing; the checkpoint is damaged "
        f"and no earlier complete one is left: discard it (rm -rf {last}) and rerun, which "
        "trains this run from step 0"
    )
    (last / "trainer_state.json").write_bytes(state)
    with open(last / "optimizer.pt", "r+b") as f:
        f.truncate(1000)
    assert _finetune(world, out, *flags, "--resume") == 2
    (line,) = _rpb_lines(capsys)
    assert line.startswith(f"rpb finetune: error: {last}: optimizer.pt: 1000 bytes, not a whole ")
    assert line.endswith(f"discard it (rm -rf {last}) and rerun, which trains this run from step 0")
    assert (last / "optimizer.pt").stat().st_size == 1000  # refused, not deleted

    # The previous complete checkpoint beside it (a job killed before the rotation): used.
    shutil.copytree(kept, out / "checkpoints" / "checkpoint-2")
    assert _finetune(world, out, *flags, "--resume") == 0
    err = caplog.text
    assert f"checkpoint {last} is damaged (optimizer.pt: 1000 bytes" in err
    assert f"the previous complete checkpoint {out / 'checkpoints' / 'checkpoint-2'}" in err
    want, got = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert (out / "train_history.json").read_text() == (ref / "train_history.json").read_text()


def test_resume_refuses_other_settings_and_a_finished_model(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--resume continues only the run its folder holds, with the flags that run started with."""
    out = tmp_path / "ft"
    out.mkdir()
    params = {"train": {"lr": 0.01, "steps": 3}, "data": str(world["text"])}
    (out / "rpb_finetune.json").write_text(json.dumps(params))
    assert _finetune(world, out, "--method", "none", "--resume") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rpb finetune: error: --resume {out}: the run started with other")
    assert "train.batch_size" in line and "model_dir" in line, line

    # Two loggers writing the same metrics to MLflow: refused before anything loads.
    both = ("--method", "none", "--report-to", "tensorboard,mlflow", "--mlflow")
    assert _finetune(world, tmp_path / "both", *both) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--report-to mlflow and --mlflow both log to MLflow" in line

    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "config.json").write_text("{}")
    assert _finetune(world, finished, "--method", "none", "--resume") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no interrupted rpb finetune to resume (no rpb_finetune.json; holds config.json)" in line


FSDP_CONFIG = Path(__file__).resolve().parents[1] / "config" / "accelerate" / "fsdp.yaml"


def _launch(world: dict[str, Path], out: Path, prior: Path, processes: int) -> str:
    """`accelerate launch` of `rpb finetune` with the paper's FSDP2 config; its output."""
    import os
    import subprocess
    import sys

    accelerate = str(Path(sys.executable).parent / "accelerate")
    argv = [
        *(accelerate, "launch", "--config_file", str(FSDP_CONFIG)),
        *("--num_processes", str(processes), "-m", "rpb.cli", "finetune"),
        *("--model", str(world["base"]), "--data", str(world["pairs"]), "--out", str(out)),
        *("--method", "rpb", "--option", "keep_bias_at_eval=true", "--prior", str(prior)),
        *("--steps", "3", "--batch-size", "4", "--lr", "1e-2", "--log-every", "1"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.slow
def test_accelerate_launch_with_the_fsdp_config_on_two_cpu_processes(
    world: dict[str, Path], tmp_path: Path
) -> None:
    """`accelerate launch --config_file config/accelerate/fsdp.yaml --num_processes 2 -m rpb.cli
    finetune` on the CPU: two gloo processes train as one run of their global batch (the first
    step's loss is one process's on the same 8 examples), and one of them writes the model, its
    evaluation-time routing and the history.

    On CPU processes accelerate 1.16 keeps the launch's FSDP settings out of the state (it sets
    `DistributedType.FSDP` only for GPU-like devices), so the Trainer runs them as DDP over gloo:
    the FSDP2 sharding and its gathered save are the GPU test's below."""
    prior = _prior_of_base(world, tmp_path)
    out = tmp_path / "launched"
    stderr = _launch(world, out, prior, processes=2)
    assert "training on 2 process(es): MULTI_CPU" in stderr
    assert stderr.count("model and tokenizer saved to") == 1  # the main process's line only
    ref = tmp_path / "one"
    flags = ("--method", "rpb", "--option", "keep_bias_at_eval=true", "--prior", str(prior))
    assert _finetune({**world, "text": world["pairs"]}, ref, *flags, "--batch-size", "8") == 0
    launched = json.loads((out / "train_history.json").read_text())["history"]
    one = json.loads((ref / "train_history.json").read_text())["history"]
    assert [e["step"] for e in launched] == [1, 2, 3]
    # Step 1 routes the same 8 examples (each process's 4) with the base's weights on both
    # processes: the same routing (a rank with other weights would change the global entropy
    # and drift from the base), and the same loss but for the float sums' order and padding.
    assert launched[0]["mean/usage_entropy"] == pytest.approx(one[0]["mean/usage_entropy"])
    assert launched[0]["mean/kl_to_base"] == pytest.approx(0.0, abs=1e-6)
    assert launched[0]["task_loss"] == pytest.approx(one[0]["task_loss"], abs=1e-3)
    assert launched[-1]["task_loss"] == pytest.approx(one[-1]["task_loss"], rel=1e-2)
    assert json.loads((out / "eval_routing" / "method.json").read_text())["kind"] == "rpb"
    assert not any(
        torch.equal(t, _weights(out)[n])
        for n, t in _weights(world["base"]).items()
        if "mlp.gate" in n
    )


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="FSDP2 shards a model over GPUs (two or more needed)"
)
def test_accelerate_launch_with_the_fsdp_config_on_two_gpus(
    world: dict[str, Path], tmp_path: Path
) -> None:
    """The same launch on two GPUs: the Trainer shards the model with FSDP2 and the saved model
    is the gathered full state dict, loadable by from_pretrained."""
    prior = _prior_of_base(world, tmp_path)
    out = tmp_path / "launched"
    stderr = _launch(world, out, prior, processes=2)
    assert "training on 2 process(es): FSDP" in stderr
    after = _weights(out)
    assert after.keys() == _weights(world["base"]).keys()
    assert json.loads((out / "train_history.json").read_text())["history"][-1]["step"] == 3


def test_a_multi_process_launch_needs_the_prior_given(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    """Each rank would extract its own prior (and under FSDP's low-memory loading only rank 0
    holds weights): refused in one line before any process group starts."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _finetune(world, tmp_path / "ft", "--method", "anchor_kl") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "under a multi-process launch give --prior" in line
    assert not (tmp_path / "ft").exists()
