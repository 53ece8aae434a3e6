"""`rpb inspect` (rpb.inspection) on tiny checkpoints of two families (Qwen3-MoE: softmax routing;
DeepSeek-V3: sigmoid routing with a correction bias and a shared expert in the trunk), saved with
the testbed tokenizer: a model against itself, a tuned model whose last MoE layer's router and
whose routed experts moved, the factorial's bookkeeping, the outputs and the one-line refusals."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rpb import inspection
from rpb.architectures import random_model
from rpb.artifacts import html_problem, sha256_of
from rpb.eval_routing import EVAL_ROUTING_DIR
from rpb.method_config import MethodConfig
from rpb.pipeline.cli import main
from rpb.pipeline.tokenizer import build_tokenizer
from rpb.router_swap import PARTS, cells, factors
from rpb.routing import find_routers

FAMILIES = ["qwen3_moe", "deepseek_v3"]
SUMS = [(f"SumOf{a}And{a + 1}?", str(2 * a + 1)) for a in range(10, 22)]
ANIMALS = [("TheDog", "Barks"), ("TheCat", "Meows"), ("TheCow", "Moos"), ("TheLion", "Roars")]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _save(model, tok, folder: Path) -> Path:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=FAMILIES)
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A base, a tuned copy (the last MoE layer's router and every routed expert moved; the
    trunk and the other routers bitwise the base's), --data and two --eval domains."""
    root = tmp_path_factory.mktemp(f"inspect_{request.param}")
    tok = build_tokenizer()
    model = random_model(
        request.param,
        seed=0,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    base = _save(model, tok, root / "base")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router = find_routers(model)[-1].module.weight
        router.add_(0.5 * router.std() * torch.randn(router.shape, generator=g))
        for name, tensor in model.named_parameters():
            if ".mlp.experts." in name:
                tensor.add_(0.02 * torch.randn(tensor.shape, generator=g))
    return {
        "family": request.param,
        "root": root,
        "base": base,
        "tuned": _save(model, tok, root / "tuned"),
        "data": _jsonl(root / "data.jsonl", [{"text": p + c} for p, c in SUMS]),
        "evals": [
            _jsonl(root / "sums.jsonl", [{"prompt": p, "completion": c} for p, c in SUMS[:6]]),
            _jsonl(root / "animals.jsonl", [{"prompt": p, "completion": c} for p, c in ANIMALS]),
        ],
    }


def _inspect(world: dict, tuned: str, out: str, **kwargs: Any) -> dict:
    return inspection.inspect_models(
        world["base"],
        world[tuned],
        world["data"],
        world["root"] / out,
        evals=world["evals"],
        device="cpu",
        batch_size=4,
        progress=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def itself(world: dict) -> dict:
    return _inspect(world, "base", "itself")


@pytest.fixture(scope="module")
def tuned(world: dict) -> dict:
    return _inspect(world, "tuned", "tuned")


def test_a_model_against_itself_has_no_drift_and_no_change(itself: dict) -> None:
    for row in itself["drift"]["layers"]:
        assert row["topk_overlap"] == 1.0 and row["kl_to_base"] == 0.0
        assert row["router_weight_change"] == 0.0
        assert row["base_entropy"] == row["tuned_entropy"] and row["base_dead"] == row["tuned_dead"]
        # Identical counts give the same communities (NaN only where the base has one community).
        assert row["community_nmi"] is None or row["community_nmi"] == pytest.approx(1.0)
        assert row["coact_cosine"] == pytest.approx(1.0)
    assert itself["usage"]["base"] == itself["usage"]["tuned"]
    dec = itself["decomposition"]
    for domain, per_metric in dec["effects"].items():
        first = dec["scores"]["base"][domain]
        assert all(dec["scores"][c][domain] == first for c in dec["cells"])
        for effects in per_metric.values():
            values = {k: v for k, v in effects.items() if "share" not in k}
            assert values and all(v == 0.0 for v in values.values()), values
            # No change: no share of it (NaN, written as null).
            assert all(math.isnan(v) for k, v in effects.items() if "share" in k)


def test_drift_shows_where_the_router_moved_and_nowhere_else(tuned: dict) -> None:
    first, last = tuned["drift"]["layers"]
    assert first["topk_overlap"] == 1.0 and first["kl_to_base"] == 0.0
    assert first["router_weight_change"] == 0.0
    assert last["topk_overlap"] < 1.0 and last["kl_to_base"] > 1e-4
    assert last["router_weight_change"] == pytest.approx(0.5, rel=0.3)
    mean = tuned["drift"]["mean"]
    assert mean["topk_overlap"] == pytest.approx((1.0 + last["topk_overlap"]) / 2)


def test_swapping_identical_parts_changes_nothing(tuned: dict) -> None:
    """The tuned model's trunk is the base's: the cells that differ only in the trunk score the
    same, bit for bit, and the trunk's effects are zero; the routers and experts moved it."""
    scores = tuned["decomposition"]["scores"]
    assert scores["base_with_trained_trunk"] == scores["base"]
    assert scores["trained_with_base_trunk"] == scores["trained"]
    assert scores["trained"] != scores["base"]
    for per_metric in tuned["decomposition"]["effects"].values():
        effects = per_metric["ll_per_token"]
        assert effects["main_trunk"] == 0.0 and effects["put_back_trunk"] == 0.0
        assert abs(effects["shapley_trunk"]) < 1e-12
        assert effects["main_routers"] != 0.0 and effects["main_routed_experts"] != 0.0


def test_the_shares_add_up_to_the_total(tuned: dict) -> None:
    names = list(factors(PARTS))
    for per_metric in tuned["decomposition"]["effects"].values():
        for metric in ("ll_per_token", "p_target"):
            e = per_metric[metric]
            assert sum(e[f"shapley_{f}"] for f in names) == pytest.approx(e["total"], abs=1e-12)
            assert sum(e[f"shapley_share_{f}"] for f in names) == pytest.approx(1.0)
            effects = [v for k, v in e.items() if k.startswith(("main_", "interaction_"))]
            assert len(effects) == 7 and sum(effects) == pytest.approx(e["total"], abs=1e-12)


def test_the_cells_are_the_base_and_tuned_models_scores(world: dict, tuned: dict) -> None:
    """The base cell is the base's own score, computed here by transformers' loss on the
    completion + EOS of each item (one at a time, so padding can not hide an offset)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world["base"])
    model = inspection.load_checkpoint(world["base"], "float32")
    per_token = []
    for prompt, completion in SUMS[:6]:
        p = tok(prompt)["input_ids"]
        c = [*tok(completion, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        labels = torch.tensor([[-100] * len(p) + c])
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([p + c]), labels=labels).loss
        per_token.append(-float(loss))
    base = tuned["decomposition"]["scores"]["base"]["sums"]
    assert base["ll_per_token"] == pytest.approx(sum(per_token) / len(per_token), abs=1e-5)
    assert 0.0 < base["p_target"] < 100.0


@pytest.fixture(scope="module")
def routers_only(world: dict) -> dict:
    return _inspect(world, "tuned", "routers_only", parts=("routers",))


def test_routers_against_the_rest(routers_only: dict, tuned: dict) -> None:
    """--parts routers: the 2x2 of routers and the rest, whose corner cells are the 2x2x2's."""
    two = routers_only
    dec = two["decomposition"]
    assert dec["factors"] == {"routers": ["routers"], "rest": ["routed_experts", "trunk"]}
    assert list(dec["cells"]) == list(cells(["routers"]))
    full = tuned["decomposition"]["scores"]
    for cell in ("base", "trained", "base_with_trained_routers", "trained_with_base_routers"):
        assert dec["scores"][cell] == full[cell]
    e = dec["effects"]["animals"]["ll_per_token"]
    assert e["shapley_routers"] + e["shapley_rest"] == pytest.approx(e["total"], abs=1e-12)


def test_the_command_writes_three_files_within_a_minute(world: dict, capsys) -> None:
    if world["family"] != "qwen3_moe":
        pytest.skip("one family suffices for the command's files")
    out = world["root"] / "cli"
    evals = [a for path in world["evals"] for a in ("--eval", str(path))]
    start = time.monotonic()
    code = main(
        ["inspect", "--base", str(world["base"]), "--tuned", str(world["tuned"]),
         "--data", str(world["data"]), *evals, "--out", str(out), "--device", "cpu"]
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert code == 0 and elapsed < 60
    result = json.loads((out / "inspect.json").read_text())  # strict JSON: no NaN
    assert result["format"] == inspection.FORMAT and result["rpb_version"]
    assert result["inputs"]["data"]["sha256"] == sha256_of(world["data"])
    assert set(result["inputs"]["base"]["sha256"]) >= {"config.json", "model.safetensors"}
    md = (out / "inspect.md").read_text()
    assert "## Routing drift per MoE layer" in md and "### animals" in md
    page = out / "inspect.html"
    assert html_problem(page) is None
    text = page.read_text()
    # Drift, co-activation, two usage heatmaps, Shapley bars and put-back bars.
    assert text.count("<svg") == 6
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium:  # the page opens in a browser, with its plots
        dom = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
             page.resolve().as_uri()],
            capture_output=True, text=True, timeout=120, check=False,
        ).stdout  # fmt: skip
        assert dom.count("<svg") == 6 and "</html>" in dom


def _refusal(capsys, *argv: str) -> str:
    code = main(["inspect", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err


def test_bad_inputs_are_refused_in_one_line(world: dict, tmp_path: Path, capsys) -> None:
    if world["family"] != "qwen3_moe":
        pytest.skip("the refusals do not depend on the family")
    base, data = str(world["base"]), str(world["data"])
    common = ["--data", data, "--out", str(tmp_path / "out")]
    err = _refusal(capsys, "--base", str(tmp_path / "nowhere"), "--tuned", base, *common)
    assert f"--base {tmp_path / 'nowhere'}: no such folder" in err
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    err = _refusal(capsys, "--base", base, "--tuned", str(dense), *common)
    assert "'llama' is not a MoE family rpb routes" in err
    (dense / "config.json").write_text(json.dumps({"model_type": "phimoe"}))
    assert "'phimoe' is refused" in _refusal(capsys, "--base", str(dense), "--tuned", base, *common)
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "TheDog", "completion": "Barks"},
                                          {"prompt": "TheCat"}])  # fmt: skip
    err = _refusal(capsys, "--base", base, "--tuned", base, "--eval", str(bad), *common)
    assert f"{bad}:2: expected 'prompt' and 'completion' fields" in err
    # Text the tokenizer cannot encode (the testbed's has no [UNK]): named by file:line.
    odd = _jsonl(tmp_path / "odd.jsonl", [{"prompt": "TheDog", "completion": "Barks"},
                                          {"prompt": "TheDog", "completion": "Ouaf"}])  # fmt: skip
    err = _refusal(capsys, "--base", base, "--tuned", base, "--eval", str(odd), *common)
    assert f"{odd}:2: cannot tokenize the record" in err
    # A base that keeps a method's routing at evaluation is no base.
    steered = tmp_path / "steered"
    shutil.copytree(world["tuned"], steered)
    (steered / EVAL_ROUTING_DIR).mkdir()
    (steered / EVAL_ROUTING_DIR / "method.json").write_text(
        json.dumps(MethodConfig("rpb").to_dict())
    )
    err = _refusal(capsys, "--base", str(steered), "--tuned", base, *common)
    assert f"--base {steered}: keeps a method's routing at evaluation" in err
    with pytest.raises(SystemExit) as usage:  # a usage error: argparse's exit, one line too
        main(["inspect", "--base", base, "--tuned", base, "--parts", "gates", *common])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and err.count("\n") == 1 and "--parts: 'gates'" in err
    assert not (tmp_path / "out").exists()


def test_an_rpb_finetune_output_is_inspected_as_it_is_evaluated(world: dict, capsys) -> None:
    """A base and its `rpb finetune --method rpb` output (which keeps rpb's bias at evaluation):
    drift wherever training moved the routers, the tuned cell scored with its saved routing (as
    rpb.eval_routing.load_model evaluates it), and the cells with the tuned routers routing with
    it."""
    if world["family"] != "qwen3_moe":
        pytest.skip("one family suffices for the fine-tune")
    from rpb.eval_routing import load_model

    out = world["root"] / "rpb_finetune"
    code = main(
        ["finetune", "--model", str(world["base"]), "--data", str(world["data"]),
         "--out", str(out), "--method", "rpb", "--steps", "3", "--batch-size", "4",
         "--lr", "1e-2"]
    )  # fmt: skip
    assert code == 0 and (out / EVAL_ROUTING_DIR).is_dir()
    world = world | {"rpb": out}
    result = _inspect(world, "rpb", "rpb_inspect", parts=("routers",))
    assert result["settings"]["tuned_eval_routing"]["kind"] == "rpb"
    assert all(row["router_weight_change"] > 0 for row in result["drift"]["layers"])
    scores = result["decomposition"]["scores"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world["base"])
    records = inspection.read_jsonl(world["evals"][1], "--eval", pairs_only=True)
    batches = inspection.batches_of(inspection.tokenize(records, tok, 1024, "x"), 4, 0)
    evaluated = inspection.score_examples(load_model(out).eval(), batches, "rpb", progress=False)
    assert scores["trained"]["animals"] == pytest.approx(evaluated, abs=1e-9)
    unsteered = load_model(out, steer=False).eval()
    plain = inspection.score_examples(unsteered, batches, "rpb", progress=False)
    assert plain != evaluated  # the saved routing matters, so the check above has teeth
    e = result["decomposition"]["effects"]["animals"]["ll_per_token"]
    assert e["shapley_routers"] + e["shapley_rest"] == pytest.approx(e["total"], abs=1e-12)


def test_without_the_analysis_extra_the_communities_are_left_out(
    tuned: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """networkx or scikit-learn missing: drift and usage still come out, the communities are
    left out with the reason naming the extra, and the page draws no community plot."""
    import rpb.coactivation

    def missing(name: str):
        raise ImportError(f"rpb.coactivation's community metrics need {name}: pip install ...")

    monkeypatch.setattr(rpb.coactivation, "_analysis_module", missing)
    counts = torch.ones(2, 8, 8)
    rows, note = inspection.community_rows(counts.numpy(), counts.numpy())
    assert rows is None and "community metrics need networkx" in note
    community = ("community_nmi", "community_ari", "coact_cosine", "tuned_communities")
    layers = [{k: v for k, v in r.items() if k not in community} for r in tuned["drift"]["layers"]]
    result = tuned | {"drift": tuned["drift"] | {"layers": layers, "communities": note}}
    result["drift"]["mean"] = inspection.mean_row(layers)
    inspection.write_outputs(result, tmp_path)
    assert (tmp_path / "inspect.html").read_text().count("<svg") == 5
    assert (
        "Communities: rpb.coactivation's community metrics need networkx"
        in (tmp_path / "inspect.md").read_text()
    )


def test_the_pipeline_s_router_swap_gives_the_same_numbers(
    world: dict, routers_only: dict, tmp_path: Path
) -> None:
    """The router-swap table's way: each swapped model saved by rpb.router_swap.swap_saved_parts,
    every cell evaluated by lm-eval (rpb.pipeline.evaluation), read by the table's task_scores
    and decomposed; rpb inspect's scores and effects are the same up to float noise (lm-eval's
    float32 log-probabilities, batched otherwise, differ by about 1e-7 nats)."""
    if world["family"] != "qwen3_moe":
        pytest.skip("one family suffices for the comparison")
    from rpb.pipeline.evaluation import evaluate_model
    from rpb.report.router_swap_table import task_scores
    from rpb.router_swap import decompose, swap_saved_parts

    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for name, pairs in (("sums", SUMS[:6]), ("animals", ANIMALS)):
        _jsonl(eval_dir / f"{name}.jsonl", [{"prompt": p, "target": c} for p, c in pairs])
    folders = {"base": world["base"], "trained": world["tuned"]}
    for cell, (target, source) in {
        "base_with_trained_routers": ("base", "tuned"),
        "trained_with_base_routers": ("tuned", "base"),
    }.items():
        folders[cell] = tmp_path / cell
        swap_saved_parts(world[target], world[source], ["routers"], folders[cell])
    pipeline = {}
    for cell, folder in folders.items():
        out = tmp_path / f"{cell}.json"
        result = evaluate_model(
            folder, eval_dir, ["sums", "animals"], out, tmp_path / "work" / cell, device="cpu"
        )
        pipeline[cell] = task_scores(result, ["sums", "animals"], out)
    dec = routers_only["decomposition"]
    taken = cells(["routers"])
    for task in ("sums", "animals"):
        for metric in ("ll_per_token", "p_target", "exact_match"):
            (key,) = [k for k in pipeline["base"] if k[:2] == (task, metric)]
            values = {taken[c]: pipeline[c][key] for c in taken}
            for cell in taken:
                assert dec["scores"][cell][task][metric] == pytest.approx(
                    values[taken[cell]], rel=1e-5, abs=5e-7
                ), (cell, task, metric)
            theirs = decompose(values, ["routers", "rest"])
            ours = dec["effects"][task][metric]
            if metric == "ll_per_token":  # a change to compare, well above the tolerance
                assert abs(theirs["total"]) > 1e-4 and abs(theirs["main_routers"]) > 1e-5
            for effect in ("total", "main_routers", "shapley_routers", "put_back_routers"):
                assert ours[effect] == pytest.approx(theirs[effect], rel=1e-4, abs=5e-7), (
                    task,
                    effect,
                )


def test_without_eval_files_only_the_drift_is_measured(world: dict, tuned: dict) -> None:
    """No --eval: drift and usage as with them (the same passes), no decomposition."""
    if world["family"] != "qwen3_moe":
        pytest.skip("one family suffices")
    out = world["root"] / "drift_only"
    result = inspection.inspect_models(
        world["base"], world["tuned"], world["data"], out, device="cpu", batch_size=4,
        progress=False,
    )  # fmt: skip
    assert result["decomposition"] is None and result["inputs"]["eval"] == []
    assert result["drift"] == tuned["drift"] and result["usage"] == tuned["usage"]
    assert "No --eval files" in (out / "inspect.md").read_text()
    assert (out / "inspect.html").read_text().count("<svg") == 4
