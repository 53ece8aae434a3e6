"""rpb.pipeline.testbed: the calibration report of a tiny base, on a hand-made results folder whose
routing structure, scores and job times are known."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import new_store

from rpb.architectures import random_model
from rpb.pipeline import testbed  # not its names: pytest would collect `testbed_report` as a test
from rpb.pipeline.analysis import extract_prior_from_corpus
from rpb.pipeline.tokenizer import build_tokenizer
from rpb.prior import RouterPrior

E = 8
# Layer 0: two disjoint cliques of four experts, equal usage: 2 communities, modularity 1/2,
# usage entropy 1. Layer 1: four disjoint pairs, expert 0 used three times as much: 4
# communities, modularity 3/4.
LAYER1_USAGE = [30, 10, 10, 10, 10, 10, 10, 10]


def _blocks(groups: list[list[int]], usage: list[int]) -> torch.Tensor:
    c = torch.zeros(E, E, dtype=torch.int64)
    for group in groups:
        for i in group:
            for j in group:
                if i != j:
                    c[i, j] = 5
    c[range(E), range(E)] = torch.tensor(usage)
    return c


def _entropy(usage: list[int]) -> float:
    p = [u / sum(usage) for u in usage]
    return -sum(x * math.log(x) for x in p) / math.log(len(p))


def _scores(**scores: float) -> str:
    return json.dumps({"tasks": {f"rpb_{k}": {"score": v} for k, v in scores.items()}})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results folder with one pretrained base `tiny`: its model, a corpus whose lines come in
    identical pairs (so the two interleaved halves are the same text), a prior whose co-activation
    counts are replaced by the hand-made blocks, eval scores and a pretraining history."""
    results = tmp_path_factory.mktemp("testbed") / "results"
    tok = build_tokenizer()
    model_dir = results / "models" / "tiny" / "base0" / "model"
    random_model("qwen3_moe", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    (model_dir.parent / "train_history.json").write_text(json.dumps({"final": {"loss": 1.25}}))
    corpus = results / "data" / "post" / "math.jsonl"
    corpus.parent.mkdir(parents=True)
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(1, 10) for b in (3, 8)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows for _ in range(2)))
    prior_path = results / "priors" / "tiny" / "base0" / "math.safetensors"
    prior = extract_prior_from_corpus(model_dir, corpus, prior_path, model_id="tiny")
    crafted = torch.stack(
        [
            _blocks([[0, 1, 2, 3], [4, 5, 6, 7]], [10] * E),
            _blocks([[0, 1], [2, 3], [4, 5], [6, 7]], LAYER1_USAGE),
        ]
    )
    dataclasses.replace(prior, coactivation=crafted).save(prior_path)
    evals = results / "eval" / "tiny" / "math"
    for name, scores in {
        "base/base0/seed0": _scores(add=0.1, add_ll=-2.5, words=0.0, other=0.9),
        "none/base0/seed0": _scores(add=0.2, add_ll=-2.0, other=0.5),
        "none/base0/seed1": _scores(add=0.4, add_ll=-1.0, other=0.5),
    }.items():
        (evals / f"{name}.json").parent.mkdir(parents=True, exist_ok=True)
        (evals / f"{name}.json").write_text(scores)
    return results


def test_base_structure_reads_the_prior_and_splits_the_corpus_by_alternate_lines(results):
    structure = testbed.base_structure(
        results / "models" / "tiny" / "base0" / "model",
        results / "data" / "post" / "math.jsonl",
        results / "priors" / "tiny" / "base0" / "math.safetensors",
    )
    prior = RouterPrior.load(results / "priors" / "tiny" / "base0" / "math.safetensors")
    assert structure["tokens"] == prior.n_tokens
    first, second = structure["layers"]
    assert (first["layer"], first["n_communities"]) == (0, 2)
    assert first["modularity"] == pytest.approx(0.5)
    assert first["usage_entropy"] == pytest.approx(1.0)
    assert (second["layer"], second["n_communities"]) == (1, 4)
    assert second["modularity"] == pytest.approx(0.75)
    assert second["usage_entropy"] == pytest.approx(_entropy(LAYER1_USAGE))
    # Alternate lines: every line is followed by its twin, so the halves route identically.
    assert [row["split_half_nmi"] for row in structure["layers"]] == [1.0, 1.0]
    uniform = structure["uniform"]
    assert set(uniform) == {"usage_entropy", "modularity", "split_half_nmi"}
    assert 0.99 < uniform["usage_entropy"] <= 1.0  # uniform routing uses every expert alike


def test_the_uniform_baseline_has_as_many_tokens_per_half_as_the_split(results, monkeypatch):
    """The chance level is read against the base's split halves: uniform routing gets the same
    token count per half (uniform_baseline halves the count it is given)."""
    halves, given = [], []
    real_pass, real_baseline = testbed.routing_pass, testbed.uniform_baseline

    def uniform_baseline(n_experts, k, n_tokens, **kwargs):
        given.append(n_tokens)
        return real_baseline(n_experts, k, n_tokens, **kwargs)

    monkeypatch.setattr(testbed, "uniform_baseline", uniform_baseline)
    monkeypatch.setattr(testbed, "routing_pass", lambda *a, **k: _recorded(real_pass, halves, a, k))
    testbed.base_structure(
        results / "models" / "tiny" / "base0" / "model",
        results / "data" / "post" / "math.jsonl",
        results / "priors" / "tiny" / "base0" / "math.safetensors",
    )
    assert len(halves) == 2 and given == [sum(halves)]


def _recorded(real_pass, tokens: list, args, kwargs):
    result = real_pass(*args, **kwargs)
    tokens.append(result["tokens"])
    return result


@pytest.fixture(scope="module")
def tracking(tmp_path_factory, empty_store):
    """An MLflow store with runs of known duration: two finished `posttrain/tiny` jobs (10 s and
    30 s), a finished `pretrain/tiny` (4 s), and runs that must not count: a running one, a failed
    one, one in another experiment."""
    from mlflow.tracking import MlflowClient

    uri = new_store(empty_store, tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    client = MlflowClient(tracking_uri=uri)
    rpb, other = client.create_experiment("rpb"), client.create_experiment("other")
    t0 = 1_700_000_000_000
    for experiment, stage, seconds, status in [
        (rpb, "posttrain", 10, "FINISHED"),
        (rpb, "posttrain", 30, "FINISHED"),
        (rpb, "pretrain", 4.5, "FINISHED"),
        (rpb, "posttrain", 99, "FAILED"),
        (rpb, "posttrain", None, None),
        (other, "posttrain", 77, "FINISHED"),
    ]:
        run = client.create_run(experiment, start_time=t0, tags={"stage": stage, "model": "tiny"})
        if status:
            client.set_terminated(run.info.run_id, status=status, end_time=t0 + int(seconds * 1000))
    return uri


def test_stage_durations_keeps_finished_runs_of_the_experiment(tracking):
    durations = testbed.stage_durations(tracking)
    assert {k: sorted(v) for k, v in durations.items()} == {
        "posttrain/tiny": [10.0, 30.0],
        "pretrain/tiny": [4.5],
    }
    assert testbed.stage_durations(tracking, experiment="other") == {"posttrain/tiny": [77.0]}
    assert testbed.stage_durations(tracking, experiment="absent") == {}


def test_testbed_report_tabulates_what_the_run_measured(results, tracking, tmp_path):
    out = tmp_path / "testbed.md"
    report = testbed.testbed_report(
        results=results,
        models=["tiny"],
        corpus="math",
        seeds=[0, 1],
        tasks=["add", "words"],
        out=out,
        tracking_uri=tracking,
    )
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# Testbed calibration")
    assert "## tiny" in lines
    prior = RouterPrior.load(results / "priors" / "tiny" / "base0" / "math.safetensors")
    assert any(f"`math` corpus ({prior.n_tokens} tokens;" in line for line in lines)
    entropy = f"{_entropy(LAYER1_USAGE):.3f}"
    assert "| 0 | 1.000 | 0.500 | 2 | 1.000 |" in lines
    assert f"| 1 | {entropy} | 0.750 | 4 | 1.000 |" in lines
    # Scores: `rpb_` dropped, plain fine-tuning averaged over seeds, only the listed tasks, a
    # score missing after fine-tuning shown as nan.
    table = [line for line in lines if line.startswith(("| add", "| words", "| other"))]
    assert table == [
        "| add | 0.100 | 0.300 |",
        "| add_ll | -2.500 | -1.500 |",
        "| words | 0.000 | nan |",
    ]
    assert "| posttrain/tiny | 2 | 20.0 | 30.0 |" in lines
    assert "| pretrain/tiny | 1 | 4.5 | 4.5 |" in lines
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["tiny"]["base"] == {"add": 0.1, "add_ll": -2.5, "words": 0.0, "other": 0.9}
    assert saved["tiny"]["none"] == pytest.approx({"add": 0.3, "add_ll": -1.5, "other": 0.5})
    assert saved["tiny"]["pretrain_final"] == {"loss": 1.25}
    assert saved["tiny"]["structure"]["tokens"] == prior.n_tokens
    assert saved["durations_s"] == json.loads(json.dumps(report["durations_s"]))


def test_testbed_report_without_tracking_has_no_cost_section(results, tmp_path):
    out = tmp_path / "testbed.md"
    report = testbed.testbed_report(
        results=results, models=["tiny"], corpus="math", seeds=[0], tasks=["add"], out=out
    )
    assert "durations_s" not in report
    text = out.read_text()
    assert "Cost on this machine" not in text
    assert "| add | 0.100 | 0.200 |" in text.splitlines()
