"""The regime rule's gates and its walk over candidates (regime.py), and the walk's figure
(plot_walk.py), on known answers. Archived with the walk: these test its pure parts, which need
no pipeline."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from matplotlib.image import imread

from rpb.report.stats import mde

sys.path.insert(0, str(Path(__file__).parent))
import plot_walk
import regime
from regime import (
    AllWorkload,
    Candidate,
    RegimeRule,
    RegimeWalk,
    all_seconds,
    dev_accuracy,
    dev_outcomes,
    moving_share,
    plateaued,
    seeds_for_margin,
    table1_seconds,
    task_name,
)


def test_plateaued_compares_s_with_2s_steps() -> None:
    # Doubling the steps moves nothing: past the transition.
    assert plateaued([0.6, 0.62, 0.58], [0.61, 0.62, 0.59], 0.02, 0.05) == [True, True, True]
    # A stalled climb (the schedule froze it) shows as a mean gain at 2S: every seed fails.
    assert plateaued([0.05, 0.1, 0.08], [0.3, 0.4, 0.35], 0.02, 0.05) == [False] * 3
    # The mean holds, but one seed clicks later and another falls back: those two fail.
    assert plateaued([0.5, 0.9, 0.6], [0.58, 0.84, 0.6], 0.02, 0.05) == [False, False, True]
    with pytest.raises(ValueError, match="same seeds"):
        plateaued([0.5], [0.5, 0.6], 0.02, 0.05)


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


def test_all_seconds_scales_the_configured_runs_to_the_regimes_seed_count() -> None:
    work = AllWorkload(posttrain_runs=60, runs_per_method=6, bases=4)
    # 4 bases, 2 at a time: 2 rounds of pretraining; 60 runs at 6 per method -> 120 at 12.
    assert all_seconds(10.0, 12, work, pretrain_seconds=100.0, cores=2) == 200.0 + 120 * 10 / 2


def test_r3_rejects_a_regime_whose_all_is_over_budget_though_table1_fits(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1,), all_budget_s=100.0)
    same = {(m, 1, s): [0.5, 0.6] for m in ("A", "B") for s in (200, 400)}
    work = AllWorkload(posttrain_runs=1000, runs_per_method=6, bases=4)
    decision = _fake_walk(tmp_path, same, rule).walk(3, pretrain_seconds=10, workload=work)
    assert decision["chosen"] is None
    rejected = decision["rejected"][0]
    assert rejected["table1_seconds_estimate"] <= rule.table1_budget_s
    assert rejected["why"].startswith("R3 fails: `all` estimate")
    fits = _fake_walk(tmp_path, same, rule).walk(3, pretrain_seconds=10, workload=None)
    assert fits["chosen"] is not None  # table 1 alone fits: only `all` rejected it


def _tasks(rule: RegimeRule) -> list[tuple[int, int | None, str | None]]:
    return [
        (lvl, n, h)
        for lvl in rule.levels
        for n in rule.post_pairs or (None,)
        for h in rule.post_holdouts or (None,)
    ]


def _write_inputs(root: Path, rule: RegimeRule) -> None:
    """Stand-in bases (A, B) and corpora (one folder per task) for the inputs' fingerprint."""
    for model in ("A", "B"):
        (root / model).mkdir(parents=True, exist_ok=True)
        (root / model / "model.safetensors").write_bytes(model.encode())
    for task in _tasks(rule):
        for split in ("post", "dev"):
            (root / task_name(*task) / split).mkdir(parents=True, exist_ok=True)
            (root / task_name(*task) / split / "math.jsonl").write_text(f"{split} {task}\n")
        # Four dev items; with rule 3's corner50, items 1 and 3 lie in the hold-out's region.
        dev = [(10, 10), (60, 60), (20, 70), (80, 90)]
        (root / task_name(*task) / "dev" / "math.jsonl").write_text(
            "".join(
                json.dumps({"prompt": f"SumOf{a}And{b}?", "target": str(a + b)[::-1]}) + "\n"
                for a, b in dev
            )
        )


def _fake_walk(tmp_path: Path, outcomes: dict, rule: RegimeRule) -> RegimeWalk:
    """A walk whose calibration runs return `outcomes[(model, level, steps)]` (one final dev
    accuracy per seed; with rule 2's sizes the key's task is the folder name, "L1-N300", and a
    value may be (finals, per-seed item outcomes)) without training anything; a missing key is
    a test failure."""
    calls: list[tuple[str, int, int, int]] = []

    def runner(jobs):
        out = []
        for job in jobs:
            task = job["data_dir"].name
            if not rule.post_pairs and not rule.post_holdouts:
                task = int(task.removeprefix("L"))
            key = (job["base_dir"].name, task, job["steps"])
            calls.append((*key, job["seed"]))
            value = outcomes[key]
            finals, items = value if isinstance(value, tuple) else (value, None)
            i = rule.seeds.index(job["seed"])
            record = {
                "curve": [(job["steps"], finals[i])],
                "final": finals[i],
                "train_s": 0.05 * job["steps"],
            }
            if items is not None:
                record["final_correct"] = items[i]
            out.append(record)
        return out

    _write_inputs(tmp_path, rule)
    walk = RegimeWalk(
        rule=rule,
        models={m: {"base_dir": tmp_path / m, "pretrain_lr": 3e-3} for m in ("A", "B")},
        data_dirs={task: tmp_path / task_name(*task) for task in _tasks(rule)},
        corpus="math",
        posttrain={"batch_size": 8, "max_length": 16},
        runs_root=tmp_path / "runs",
        runner=runner,
    )
    walk.calls = calls
    return walk


def test_walk_takes_the_first_candidate_through_every_gate(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1, 2), steps=(200, 400), levels=(1, 2, 3))
    outcomes = {
        ("A", 1, 200): [0.99, 0.98, 0.99],  # plateau at the ceiling: R2 fails
        ("A", 1, 400): [0.99, 0.99, 0.99],
        ("A", 2, 200): [0.30, 0.35, 0.20],  # still climbing at 200 steps: R1 fails
        ("A", 2, 400): [0.60, 0.62, 0.58],  # level 2 at 400 steps ...
        ("A", 2, 800): [0.61, 0.62, 0.59],  # ... no better at 800: passes
        ("B", 1, 200): [0.70, 0.72, 0.71],  # family B passes at 200 ...
        ("B", 1, 400): [0.71, 0.72, 0.71],
        ("B", 1, 800): [0.72, 0.72, 0.71],  # ... and again at the common 400
    }
    walk = _fake_walk(tmp_path, outcomes, rule)
    decision = walk.walk(table1_methods=3, pretrain_seconds=0)
    chosen = decision["chosen"]
    assert chosen["steps"] == 400
    assert chosen["levels"] == {"A": 2, "B": 1}
    assert chosen["lr"] == {"A": pytest.approx(3e-4), "B": pytest.approx(3e-4)}
    assert len(walk.calls) == len(set(walk.calls))  # no setting is trained twice
    gates = {(t["model"], t["level"], t["steps"]): t["gate"] for t in decision["tried"]}
    assert gates[("A", 1, 200)].startswith("R1 passes; R2 fails: ceiling")
    assert gates[("A", 2, 200)].startswith("R1 fails")
    assert gates[("A", 2, 400)] == gates[("B", 1, 400)] == "R1, R2 pass"
    sigma = 100 * 0.02  # A's sd at level 2, 400 steps (B's is smaller)
    assert chosen["runs_needed"] == seeds_for_margin(sigma, rule)


def test_walk_stops_climbing_at_a_floor_and_moves_to_the_next_lr(tmp_path: Path) -> None:
    """A floors at every lr: A is not testable and the regime is B's at the first lr."""
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1, 2), lr_fractions=(0.1, 0.05))
    outcomes = {
        ("A", 1, 200): [0.10, 0.12],  # floor at level 1: level 2 is never tried
        ("A", 1, 400): [0.10, 0.12],
        ("B", 1, 200): [0.5, 0.52],
        ("B", 1, 400): [0.5, 0.52],
    }
    decision = _fake_walk(tmp_path, outcomes, rule).walk(table1_methods=3, pretrain_seconds=0)
    assert [r["lr_fraction"] for r in decision["rejected"]] == [0.1, 0.05]
    assert all(t["level"] == 1 for t in decision["tried"])
    chosen = decision["chosen"]
    assert chosen["lr_fraction"] == 0.1 and chosen["levels"] == {"B": 1}
    assert chosen["not_testable"] == ["A"]
    # At 0.05 A fails first; B there could not change the decision, so it is not trained.
    assert [(t["model"], t["lr_fraction"]) for t in decision["tried"] if t["model"] == "B"] == [
        ("B", 0.1),
        ("B", 0.1),
    ]


def test_walk_rejects_a_candidate_over_the_cost_budget(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1,), table1_budget_s=1.0)
    same = {(m, 1, s): [0.5, 0.6] for m in ("A", "B") for s in (200, 400)}
    decision = _fake_walk(tmp_path, same, rule).walk(table1_methods=3, pretrain_seconds=10)
    assert decision["chosen"] is None
    assert decision["rejected"][0]["why"].startswith("R3 fails")


def test_candidate_paths_are_distinct_per_setting(tmp_path: Path) -> None:
    paths = {
        Candidate("A", lvl, frac, steps, pairs).path(tmp_path, seed)
        for lvl in (1, 2)
        for frac in (0.1, 1 / 30)
        for steps in (200, 400)
        for seed in (0, 1)
        for pairs in (None, 750)
    }
    assert len(paths) == 32
    # The preset's size (None) keeps rule 1's paths, so its cached runs are rule 2's first task.
    assert Candidate("A", 1, 0.1, 200).path(tmp_path, 0) == tmp_path / "A/L1/lr0p1/S200/seed0.json"


def test_moving_share_counts_items_some_but_not_all_seeds_solve() -> None:
    outcomes = [[1, 1, 0, 0, 1], [1, 0, 0, 0, 1], [1, 1, 0, 1, 0]]
    # item 0 always, item 2 never; items 1, 3 and 4 vary: 3 of 5
    assert moving_share(outcomes) == pytest.approx(0.6)
    assert moving_share([[1, 0], [1, 0]]) == 0.0  # seeds agree on every item
    with pytest.raises(ValueError, match="same items"):
        moving_share([[1, 0], [1]])
    with pytest.raises(ValueError, match="2\\+ seeds"):
        moving_share([[1, 0]])


def test_rule2_walks_post_training_sizes_and_gates_on_room_to_move(tmp_path: Path) -> None:
    """Mid-range mean from a solved-plus-unsolvable mixture fails R2b; the next size, whose
    items vary between seeds, passes."""
    rule = RegimeRule(
        seeds=(0, 1),
        steps=(200,),
        levels=(1,),
        post_pairs=(None, 300, 100),
        min_moving_share=0.25,
    )
    fixed = ([0.5, 0.5], [[1, 1, 0, 0], [1, 1, 0, 0]])  # same half solved by both seeds
    varying = ([0.5, 0.5], [[1, 0, 1, 0], [1, 1, 0, 0]])  # items 1 and 2 vary: 0.5
    outcomes = {
        ("A", "L1", 200): ([0.99, 0.99], [[1, 1, 1, 1]] * 2),  # ceiling
        ("A", "L1", 400): [0.99, 0.99],
        ("A", "L1-N300", 200): fixed,
        ("A", "L1-N300", 400): fixed,
        ("A", "L1-N100", 200): varying,
        ("A", "L1-N100", 400): varying,
        ("B", "L1", 200): varying,
        ("B", "L1", 400): varying,
    }
    walk = _fake_walk(tmp_path, outcomes, rule)
    decision = walk.walk(table1_methods=3, pretrain_seconds=0)
    gates = {(t["model"], t["post_pairs"], t["steps"]): t["gate"] for t in decision["tried"]}
    assert gates[("A", None, 200)].startswith("R1 passes; R2 fails: ceiling")
    assert gates[("A", 300, 200)].startswith("R1, R2 pass; R2b fails: room to move (0.000")
    assert gates[("A", 100, 200)] == gates[("B", None, 200)] == "R1, R2 pass"
    assert decision["chosen"]["post_pairs"] == {"A": 100, "B": None}
    moving = {
        (t["model"], t["post_pairs"], t["steps"]): t["moving_share"] for t in decision["tried"]
    }
    assert moving[("A", 100, 200)] == 0.5
    assert moving[("A", 100, 400)] == 0.5  # a 2S run's share is reported, though not gated


def test_rule3_walks_holdouts_in_order_and_a_family_may_take_another(tmp_path: Path) -> None:
    """Rule 3's graded axis: each family takes its first hold-out through every gate, runs and
    corpora are kept per hold-out, and the decision names each family's hold-out."""
    rule = RegimeRule(
        seeds=(0, 1),
        steps=(200,),
        levels=(1,),
        post_holdouts=("corner50", "corner30", "below50"),
        min_moving_share=0.25,
    )
    varying = ([0.5, 0.5], [[1, 0, 1, 0], [1, 1, 0, 0]])
    ceiling = ([0.99, 0.99], [[1, 1, 1, 1]] * 2)
    outcomes = {
        ("A", "L1-corner50", 200): varying,
        ("A", "L1-corner50", 400): varying,
        ("B", "L1-corner50", 200): ceiling,
        ("B", "L1-corner50", 400): ceiling,
        ("B", "L1-corner30", 200): ceiling,
        ("B", "L1-corner30", 400): ceiling,
        ("B", "L1-below50", 200): varying,
        ("B", "L1-below50", 400): varying,
    }
    walk = _fake_walk(tmp_path, outcomes, rule)
    decision = walk.walk(table1_methods=3, pretrain_seconds=0)
    assert decision["chosen"]["post_holdout"] == {"A": "corner50", "B": "below50"}
    inside = {
        (t["model"], t["post_holdout"], t["steps"]): t["inside_region"] for t in decision["tried"]
    }
    assert inside[("A", "corner50", 200)] == 0.25  # items 1 and 3: solved once in 4 tries
    assert inside[("B", "below50", 200)] == round(2 / 6, 3)  # items 1-3 lie in below50's
    tried = [(t["model"], t["post_holdout"], t["steps"]) for t in decision["tried"]]
    assert tried[:2] == [("A", "corner50", 200), ("A", "corner50", 400)]  # A stops at its first
    assert ("A", "corner30", 200) not in tried
    # Each hold-out trains on its own corpora (the runner sees the task's folder).
    assert {c[:3] for c in walk.calls if c[0] == "B"} >= {("B", "L1-below50", 200)}
    assert Candidate("B", 1, 0.1, 200, None, "below50").path(tmp_path, 0) != Candidate(
        "B", 1, 0.1, 200, None, "corner30"
    ).path(tmp_path, 0)


def test_r2b_refuses_cached_runs_without_per_item_outcomes(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1,), min_moving_share=0.1)
    same = {(m, 1, s): [0.5, 0.6] for m in ("A", "B") for s in (200, 400)}
    with pytest.raises(ValueError, match="predates them"):
        _fake_walk(tmp_path, same, rule).walk(table1_methods=3, pretrain_seconds=0)


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
    from rpb.pipeline.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    items = [{"prompt": "SumOf35And47?", "target": "28"}, {"prompt": "SumOf1And2?", "target": "3"}]
    answer = tok("28", add_special_tokens=False)["input_ids"]
    model = _EchoModel([*answer, tok.eos_token_id, tok.eos_token_id])
    assert dev_accuracy(model, tok, items) == 0.5  # only the first item's answer
    assert dev_outcomes(model, tok, items) == [True, False]  # per item, in the items' order
    flipped = [items[1], items[0]]  # grouped by prompt length inside: the order must survive
    assert dev_outcomes(model, tok, flipped) == [False, True]
    no_eos = _EchoModel([*answer, answer[0], answer[0]])
    assert dev_accuracy(no_eos, tok, items) == 0.0  # "28" then more digits is not "28"
    assert model.training  # the model's mode is restored


def test_a_flat_start_below_the_range_is_not_a_floor_before_the_largest_steps(
    tmp_path: Path,
) -> None:
    rule = RegimeRule(seeds=(0, 1), steps=(200, 400), levels=(1,))
    outcomes = {
        ("A", 1, 200): [0.0, 0.01],  # nothing learnt yet, and nothing at 400 either ...
        ("A", 1, 400): [0.0, 0.0],
        ("A", 1, 800): [0.6, 0.62],  # ... but 400 is no plateau: 800 moves it
        ("B", 1, 200): [0.5, 0.52],
        ("B", 1, 400): [0.5, 0.52],
        ("B", 1, 800): [0.5, 0.52],
    }
    decision = _fake_walk(tmp_path, outcomes, rule).walk(table1_methods=3, pretrain_seconds=0)
    gates = {(t["model"], t["steps"]): t["gate"] for t in decision["tried"]}
    assert gates[("A", 200)].startswith("R1: flat below the range")
    assert gates[("A", 400)].startswith("R1 fails")
    assert "no level passes R1+R2 on A" in decision["rejected"][0]["why"]
    # A passes at no S of the rule: the regime is B's alone, A not testable.
    assert decision["chosen"]["not_testable"] == ["A"]
    assert decision["chosen"]["levels"] == {"B": 1}


def test_a_cached_only_walk_trains_nothing_and_stops_at_the_first_missing_run(
    tmp_path: Path,
) -> None:
    walk = _fake_walk(tmp_path, {}, RegimeRule(seeds=(0, 1)))
    walk.runner, walk.cached_only = None, True
    with pytest.raises(regime.MissingRuns, match="2 run"):
        walk.walk(table1_methods=3, pretrain_seconds=0)


def test_an_unknown_cost_fails_the_cost_gate(tmp_path: Path) -> None:
    """No pretraining time in the tracking store (NaN) must not pass R3 by default."""
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1,))
    same = {(m, 1, s): [0.5, 0.6] for m in ("A", "B") for s in (200, 400)}
    walk = _fake_walk(tmp_path, same, rule)
    decision = walk.walk(table1_methods=3, pretrain_seconds=float("nan"))
    assert decision["chosen"] is None
    assert decision["rejected"][0]["why"].startswith("R3 fails")


def test_a_cached_run_of_another_base_is_stale_and_kept_aside(tmp_path: Path) -> None:
    """A calibration run cached for one base must not be read as a run of a retrained base."""
    rule = RegimeRule(seeds=(0,), steps=(200,), levels=(1,))
    walk = _fake_walk(tmp_path, {}, rule)
    trained: list[Path] = []

    def fake_calibration_job(kwargs):
        trained.append(kwargs["out"])
        kwargs["out"].parent.mkdir(parents=True, exist_ok=True)
        record = {"final": 0.5, "train_s": 1.0, "curve": [], "inputs": kwargs["inputs"]}
        kwargs["out"].write_text(json.dumps(record))

    walk.runner = None
    candidate = Candidate("A", 1, 0.1, 200)
    out = candidate.path(walk.runs_root, 0)
    with (
        mock.patch.object(regime, "ProcessPoolExecutor", _InlinePool),
        mock.patch.object(regime, "_calibration_job", fake_calibration_job),
    ):
        walk.evaluate(candidate)
        assert trained == [out]
        walk.evaluate(candidate)  # cached and current: nothing trained
        assert trained == [out]
        (tmp_path / "A" / "model.safetensors").write_bytes(b"retrained")
        old = out.read_text()
        walk.evaluate(candidate)  # another base: trained again, the old run kept beside it
        assert trained == [out, out]
    stale = out.with_suffix(f".stale-{json.loads(old)['inputs']}.json")
    assert stale.read_text() == old  # named by its own inputs: a later stale run keeps it
    assert json.loads(out.read_text())["inputs"] != json.loads(old)["inputs"]


class _InlinePool:
    """ProcessPoolExecutor's context-manager and map, run in this process."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self) -> _InlinePool:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def map(self, fn, items):
        return [fn(item) for item in items]


def test_no_family_passing_anywhere_chooses_nothing(tmp_path: Path) -> None:
    rule = RegimeRule(seeds=(0, 1), steps=(200,), levels=(1,), lr_fractions=(0.1, 0.05))
    ceiling = {(m, 1, s): [0.99, 0.99] for m in ("A", "B") for s in (200, 400)}
    decision = _fake_walk(tmp_path, ceiling, rule).walk(table1_methods=3, pretrain_seconds=0)
    assert decision["chosen"] is None
    assert [r["lr_fraction"] for r in decision["rejected"]] == [0.1, 0.05]


def _check_outputs(paths, stem):
    assert [p.name for p in paths] == [stem.name + ".png", stem.name + ".pdf"]
    png, pdf = paths
    assert pdf.read_bytes().startswith(b"%PDF") and pdf.stat().st_size > 1000
    pixels = imread(png)
    assert pixels.shape[0] > 100 and pixels.std() > 0.01  # something was drawn


def test_regime_walk_has_a_panel_per_model_and_lr_and_a_line_per_level(tmp_path, monkeypatch):
    tried = [
        {"model": m, "lr_fraction": f, "level": lvl, "steps": s, "finals": [0.1 * lvl, 0.2]}
        for m in ("tinyA", "tinyB")
        for f in (0.1, 1 / 30)
        for lvl in (1, 2)
        for s in (200, 400)
    ][:-1]  # tinyB at 1/30 stopped after one step count of level 2
    figures = []
    monkeypatch.setattr(plot_walk, "_save", lambda fig, stem: figures.append(fig) or [])
    plot_walk.plot_regime_walk(tried, tmp_path / "walk")
    axes = figures[0].axes
    assert [ax.get_title().split(",")[0] for ax in axes] == ["tinyA", "tinyA", "tinyB", "tinyB"]
    assert [len(ax.get_lines()) for ax in axes] == [2, 2, 2, 2]
    assert (
        len(axes[3].get_lines()[1].get_xdata()) == 0
        or axes[3].get_lines()[1].get_xdata()[-1] == 200
    )
    monkeypatch.undo()
    stem = tmp_path / "walk"
    _check_outputs(plot_walk.plot_regime_walk(tried, stem), stem)
    with pytest.raises(ValueError, match="no calibration candidate"):
        plot_walk.plot_regime_walk([], stem)
