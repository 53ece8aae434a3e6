"""The prior-permutation control (rpb.pipeline.controls, `rpb pipeline permute-prior`): every
per-expert tensor of the base router prior is permuted consistently per layer, no expert keeps its
own row, the file round-trips and fits the model, and the permutation is fixed by its seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from rpb.pipeline.cli import main
from rpb.pipeline.config_check import ConfigError, check_config
from rpb.pipeline.controls import derangement, permute_prior
from rpb.prior import RouterPrior


def test_every_per_expert_tensor_is_permuted_consistently(tiny_prior: RouterPrior) -> None:
    permuted, perms = permute_prior(tiny_prior, seed=0)
    assert len(perms) == tiny_prior.num_layers
    for layer, perm in enumerate(perms):
        p = torch.tensor(perm)
        assert sorted(perm) == list(range(tiny_prior.num_experts))
        assert not (p == torch.arange(len(perm))).any()  # no expert keeps its own row
        torch.testing.assert_close(permuted.base_weights[layer], tiny_prior.base_weights[layer][p])
        torch.testing.assert_close(permuted.usage[layer], tiny_prior.usage[layer][p])
        torch.testing.assert_close(permuted.mean_probs[layer], tiny_prior.mean_probs[layer][p])
        coact = permuted.coactivation[layer]
        torch.testing.assert_close(coact, tiny_prior.coactivation[layer][p][:, p])
        torch.testing.assert_close(coact.diagonal(), permuted.usage[layer])
        if tiny_prior.correction_bias is not None:
            torch.testing.assert_close(
                permuted.correction_bias[layer], tiny_prior.correction_bias[layer][p]
            )
        # The same hidden state now scores expert i as the base scored expert perm[i].
        h = torch.randn(tiny_prior.hidden_size)
        torch.testing.assert_close(
            permuted.base_weights[layer] @ h, (tiny_prior.base_weights[layer] @ h)[p]
        )
    # Nothing but the expert order changed.
    assert permuted.meta == tiny_prior.meta
    assert not torch.equal(permuted.base_weights[0], tiny_prior.base_weights[0])


def test_cli_writes_a_loadable_prior_fixed_by_its_seed(tiny_prior, tiny_model, tmp_path) -> None:
    source = tiny_prior.save(tmp_path / "math.safetensors")
    out = tmp_path / "permuted" / "math.safetensors"
    assert main(["pipeline", "permute-prior", "--prior", str(source), "--out", str(out)]) == 0
    loaded = RouterPrior.load(out)
    loaded.check_compatible(tiny_model)
    expected, perms = permute_prior(tiny_prior, seed=0)
    torch.testing.assert_close(loaded.base_weights[0], expected.base_weights[0])
    record = json.loads((out.parent / "math.permutation.json").read_text())
    assert record["permutation_per_layer"] == perms and record["seed"] == 0
    _, other_perms = permute_prior(tiny_prior, seed=1)
    assert other_perms != perms


def test_derangement_needs_two_experts() -> None:
    with pytest.raises(ValueError, match="needs >= 2 experts"):
        derangement(1, torch.Generator().manual_seed(0))


# --- the controls' config keys ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _config() -> dict:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["claims"].update(placebo="placebo2"), r"claims\.placebo: 'placebo2' is not"),
        (
            lambda c: c["methods"]["rpb_permuted"].pop("prior"),
            r"claims\.permuted: methods\.rpb_permuted lacks 'prior: permuted'",
        ),
        (
            lambda c: c["methods"]["placebo"].update(prior="permuted"),
            r"methods\.placebo\.prior: method 'lbl' reads no router prior",
        ),
        (
            lambda c: c["methods"]["rpb_permuted"].update(kind="anchor_weight", options={}),
            r"claims\.permuted: methods\.rpb_permuted is a 'anchor_weight', not a variant",
        ),
        (
            # rpb keeps its bias at evaluation (the default since issue 58); this one drops it.
            lambda c: c["methods"]["rpb_permuted"].update(options={"keep_bias_at_eval": False}),
            r"claims\.permuted: methods\.rpb_permuted\.options differs from methods\.rpb",
        ),
        (
            lambda c: c["methods"]["rpb"].update(prior="shuffled"),
            r"methods\.rpb\.prior",
        ),
    ],
)
def test_control_keys_are_checked(mutate, message) -> None:
    config = _config()
    mutate(config)
    with pytest.raises(ConfigError, match=message):
        check_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")


def test_default_config_has_both_controls() -> None:
    config = _config()
    check_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    assert config["claims"]["placebo"] == "placebo" and config["claims"]["power"] == 0.8
    assert config["methods"]["placebo"] == {"kind": "lbl", "strength": 1e-7}
    assert config["methods"]["rpb_permuted"]["prior"] == "permuted"


@pytest.mark.workflow
@pytest.mark.parametrize(
    # A Snakemake process each (seconds): the unit tier plans the one-process path.
    "one_process",
    [True, pytest.param(False, marks=pytest.mark.slow)],
)
def test_only_the_permuted_label_trains_with_the_permuted_prior(
    tmp_path: Path, one_process: bool
) -> None:
    """A dry run of the smoke DAG, on both training paths (one process per run, or posttrain +
    evaluate + analyze): `rpb_permuted` trains with the permuted prior and is analysed against the
    base's own prior; every other label trains with the base prior."""
    import subprocess
    import sys

    results = tmp_path / "results"
    targets = [
        f"{results}/analysis/tinyA/math/{label}/base0/seed0.json"
        for label in ("rpb_permuted", "rpb")
    ]
    command = [sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "--configfile"]
    command += ["config/smoke.yaml", "--config", f"results_dir={results}"]
    command += [f"one_process_per_run={one_process}", "--", *targets]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    train_rule = "posttrain_run" if one_process else "posttrain"
    commands = {
        label: next(
            line
            for line in proc.stdout.splitlines()
            if f" --label {label} " in line
            and (" pipeline run " in line or " pipeline train " in line)
        )
        for label in ("rpb_permuted", "rpb")
    }
    assert f"rule {train_rule}:" in proc.stdout and "rule permute_prior:" in proc.stdout
    assert (
        "--prior " + f"{results}/priors/tinyA/base0/permuted/math.safetensors"
        in commands["rpb_permuted"]
    )
    assert "--prior " + f"{results}/priors/tinyA/base0/math.safetensors" in commands["rpb"]
    if one_process:
        base_prior = f"--analysis-prior {results}/priors/tinyA/base0/math.safetensors"
        assert base_prior in commands["rpb_permuted"] and base_prior in commands["rpb"]
    else:  # the analysis job reads the base's prior
        analyses = [line for line in proc.stdout.splitlines() if "rpb pipeline analyze" in line]
        assert len(analyses) == 2
        assert all(f"--prior {results}/priors/tinyA/base0/math.safetensors" in a for a in analyses)
