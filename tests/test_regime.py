"""The regime rule's gates and its walk over candidates (rpb/regime.py), on known answers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rpb.regime import (
    Candidate,
    RegimeRule,
    RegimeWalk,
    dev_accuracy,
    plateaued,
    seeds_for_margin,
    table1_seconds,
)
from rpb.stats import mde


def test_plateaued_known_curves() -> None:
    flat = [(s, 0.6) for s in range(20, 201, 20)]
    assert plateaued(flat, 200, 0.02, 0.3)
    rising = [(s, s / 250) for s in range(20, 201, 20)]  # +0.08 per reading
    assert not plateaued(rising, 200, 0.02, 0.3)
    # Last two agree but the final is 5 points under the late maximum: a collapse, not a plateau.
    dropped = [*flat[:-3], (160, 0.65), (180, 0.60), (200, 0.60)]
    assert not plateaued(dropped, 200, 0.02, 0.3)
    assert not plateaued([(200, 0.6)], 200, 0.02, 0.3)  # one reading cannot show a plateau


def test_seeds_for_margin_is_the_smallest_n_whose_paired_mde_fits() -> None:
    rule = RegimeRule(margin=5.0)
    for sigma in (1.0, 3.0, 6.0):
        n = seeds_for_margin(sigma, rule)
        sd = math.sqrt(2) * sigma
        assert mde(sd, n) <= 5.0
        assert n == 2 or mde(sd, n - 1) > 5.0
    assert seeds_for_margin(1.0, rule) < seeds_for_margin(6.0, rule)


def test_table1_seconds_counts_every_run_once_per_core() -> None:
    assert table1_seconds(10.0, n_runs=4, n_methods=3, pretrain_seconds=100.0, cores=2) == 160.0


def _fake_walk(tmp_path: Path, outcomes: dict, rule: RegimeRule) -> RegimeWalk:
    """A walk whose calibration runs return `outcomes[(model, level, steps)]` = (finals,
    plateaued) without training anything."""

    def runner(jobs):
        out = []
        for job in jobs:
            model = job["base_dir"].name
            level = int(job["data_dir"].name.removeprefix("L"))
            finals, flat = outcomes[(model, level, job["steps"])]
            final = finals[rule.seeds.index(job["seed"])]
            step = job["steps"] // rule.readings
            if flat:
                curve = [(step * i, final) for i in range(1, rule.readings + 1)]
            else:
                curve = [(step * i, final * i / rule.readings) for i in range(1, 11)]
            out.append({"curve": curve, "final": final, "train_s": 0.05 * job["steps"]})
        return out

    return RegimeWalk(
        rule=rule,
        models={m: {"base_dir": tmp_path / m, "pretrain_lr": 3e-3} for m in ("A", "B")},
        data_dirs={lvl: tmp_path / f"L{lvl}" for lvl in rule.levels},
        corpus="math",
        posttrain={"batch_size": 8, "max_length": 16},
        runs_root=tmp_path / "runs",
        runner=runner,
    )


def test_walk_takes_the_first_candidate_through_every_gate(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1, 2), steps=(200, 400), levels=(1, 2, 3))
    mid = [0.60, 0.62, 0.58]
    outcomes = {
        ("A", 1, 200): ([0.99, 0.98, 0.99], True),  # plateau at the ceiling: R2 fails
        ("A", 2, 200): (mid, False),  # still learning at 200 steps: R1 fails
        ("A", 2, 400): (mid, True),  # level 2 at 400 steps: passes
        ("B", 1, 200): ([0.70, 0.72, 0.71], True),  # family B passes at 200 ...
        ("B", 1, 400): ([0.75, 0.76, 0.74], True),  # ... and again at the common 400
    }
    decision = _fake_walk(tmp_path, outcomes, rule).walk(table1_methods=3, pretrain_seconds=0)
    chosen = decision["chosen"]
    assert chosen["steps"] == 400
    assert chosen["levels"] == {"A": 2, "B": 1}
    assert chosen["lr"] == {"A": pytest.approx(3e-4), "B": pytest.approx(3e-4)}
    tried = [(t["model"], t["level"], t["steps"]) for t in decision["tried"]]
    assert tried == [("A", 1, 200), ("A", 2, 200), ("A", 2, 400), ("B", 1, 200), ("B", 1, 400)]
    sigma = max(100 * 0.02, 100 * 0.01)
    assert chosen["runs_needed"] == seeds_for_margin(sigma, rule)


def test_walk_stops_climbing_at_a_floor_and_moves_to_the_next_lr(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1, 2), lr_fractions=(0.1, 0.05))
    outcomes = {
        ("A", 1, 200): ([0.10, 0.12], True),  # floor at level 1: level 2 is never tried
        ("B", 1, 200): ([0.5, 0.52], True),
    }
    decision = _fake_walk(tmp_path, outcomes, rule).walk(table1_methods=3, pretrain_seconds=0)
    assert decision["chosen"] is None
    assert [r["lr_fraction"] for r in decision["rejected"]] == [0.1, 0.05]
    assert all(t["level"] == 1 for t in decision["tried"])


def test_walk_rejects_a_candidate_over_the_cost_budget(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1,), table1_budget_s=1.0)
    outcomes = {("A", 1, 200): ([0.5, 0.6], True), ("B", 1, 200): ([0.5, 0.6], True)}
    decision = _fake_walk(tmp_path, outcomes, rule).walk(table1_methods=3, pretrain_seconds=10)
    assert decision["chosen"] is None
    assert decision["rejected"][0]["why"].startswith("R3 fails")


def test_candidate_paths_are_distinct_per_setting(tmp_path: Path) -> None:
    paths = {
        Candidate("A", lvl, frac, steps).path(tmp_path, seed)
        for lvl in (1, 2)
        for frac in (0.1, 1 / 30)
        for steps in (200, 400)
        for seed in (0, 1)
    }
    assert len(paths) == 16


class _EchoModel:
    """generate() appends the given continuation to every row."""

    def __init__(self, continuation: list[int]):
        self.continuation, self.training = continuation, True

    def eval(self):
        self.training = False

    def train(self, mode: bool = True):
        self.training = mode

    def generate(self, input_ids, max_new_tokens, **kwargs):
        tail = torch.tensor([self.continuation[:max_new_tokens]] * input_ids.shape[0])
        return torch.cat([input_ids, tail], dim=1)


def test_dev_accuracy_is_exact_match_with_eos(tmp_path: Path) -> None:
    from rpb.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    items = [{"prompt": "SumOf35And47?", "target": "28"}, {"prompt": "SumOf1And2?", "target": "3"}]
    answer = tok("28", add_special_tokens=False)["input_ids"]
    model = _EchoModel([*answer, tok.eos_token_id, tok.eos_token_id])
    assert dev_accuracy(model, tok, items) == 0.5  # only the first item's answer
    no_eos = _EchoModel([*answer, answer[0], answer[0]])
    assert dev_accuracy(no_eos, tok, items) == 0.0  # "28" then more digits is not "28"
    assert model.training  # the model's mode is restored
