"""Evaluation-time routing travels with a saved model: `hard` and `keep_bias_at_eval` are scored
and analysed with the routing they were trained for, not with the saved router alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_batch, make_model, perturb_routers
from test_evaluation import _target_ll, setup  # noqa: F401  (setup: a saved model + eval sets)
from transformers import AutoModelForCausalLM, AutoTokenizer

from rpb.eval_routing import (
    EVAL_ROUTING_DIR,
    STEERED_MODEL_TYPE,
    STEERED_MODULE_FILE,
    STEERED_MODULE_TEXT,
    attach_eval_routing,
    base_config_dict,
    eval_routing_spec,
    load_model,
    register_steered_type,
    save_eval_routing,
)
from rpb.method_config import MethodConfig
from rpb.methods import make_method
from rpb.pipeline.analysis import analyze_model
from rpb.pipeline.evaluation import evaluate_model
from rpb.prior import extract_prior
from rpb.routing import find_routers


def _prior(model):
    batches = [make_batch(seed=s) for s in range(2)]
    return extract_prior(
        model, batches, model_id="t", revision="r", corpus_hash="0" * 64, progress=False
    )


def _write_earlier_method_file(folder: Path, method) -> None:
    """`folder`'s eval_routing/method.json as rpb wrote it before MethodConfig: the family under
    `method`, RouterMethod's strength (0.0 for hard), every option."""
    spec = {"method": method.name, "strength": method.strength, "options": method.options}
    text = json.dumps(spec, indent=2, sort_keys=True) + "\n"
    (folder / EVAL_ROUTING_DIR / "method.json").write_text(text)


def _trained_copy(arch: str):
    """A base, its prior, and a 'post-trained' copy whose routers moved away from the base."""
    base = make_model(arch)
    prior = _prior(base)
    trained = make_model(arch)
    perturb_routers(trained, scale=2.0)
    return prior, trained


@pytest.mark.parametrize(
    ("name", "strength", "options"),
    [
        ("hard", None, {}),
        ("rpb", 2.0, {"keep_bias_at_eval": True}),
        ("rpb", 1.0, {"keep_bias_at_eval": True, "bias_on": "logits"}),
        ("rpb_marginal", 1.0, {"keep_bias_at_eval": True}),
        ("rpb_interp", 0.5, {"keep_bias_at_eval": True}),
        ("rpb_coact", 3.0, {"keep_bias_at_eval": True}),
    ],
)
def test_reloaded_model_routes_as_the_trained_method(tmp_path, name, strength, options):
    prior, trained = _trained_copy("qwen3_moe")
    batch = make_batch(seed=5)
    method = make_method(name, strength=strength, **options).attach(trained, prior)
    trained.eval()
    with torch.no_grad():
        steered = trained(**batch).logits
    method.detach()
    with torch.no_grad():
        native = trained(**batch).logits
    assert not torch.allclose(steered, native), "the fixture must make the steering matter"
    trained.save_pretrained(tmp_path)
    assert save_eval_routing(tmp_path, method, prior) == tmp_path / EVAL_ROUTING_DIR

    # The folder's own class (registered by rpb.eval_routing: no trust_remote_code) attaches the
    # routing as it loads; attaching again returns that method, so the model is not steered
    # twice (the logits below would show it: rpb's bias added twice moves them).
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    again = attach_eval_routing(reloaded, tmp_path)
    assert again is reloaded.rpb_eval_routing
    assert again is not None and again.name == name
    assert again.strength == method.strength and again.options == method.options
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, steered)
    again.detach()
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, native)
    # The file spells the method as every part does; one written before, as its MethodConfig.
    saved = json.loads((tmp_path / EVAL_ROUTING_DIR / "method.json").read_text())
    assert saved == MethodConfig.of(method).to_dict() and saved["kind"] == name
    _write_earlier_method_file(tmp_path, method)
    assert eval_routing_spec(tmp_path) == MethodConfig.of(method)
    earlier = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(earlier(**batch).logits, steered)


def test_adaptive_bias_state_is_restored(tmp_path):
    prior, trained = _trained_copy("deepseek_v3")
    method = make_method("rpb_adaptive", keep_bias_at_eval=True).attach(trained, prior)
    method.bias.copy_(torch.linspace(-1, 1, method.bias.numel()).reshape(method.bias.shape))
    trained.save_pretrained(tmp_path)
    save_eval_routing(tmp_path, method, prior)
    reloaded = load_model(tmp_path, dtype=torch.float32)
    assert torch.equal(reloaded.rpb_eval_routing.bias, method.bias)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("none", {}),
        ("rpb", {"keep_bias_at_eval": False}),  # rpb_select
        ("anchor_kl", {}),
        ("rpb_interp", {}),
        ("rpb_anneal", {}),
        ("hard", {"keep_bias_at_eval": False}),  # rpb_linf: rpb's protocol at lambda -> inf
    ],
)
def test_methods_that_route_natively_at_eval_save_nothing(tmp_path, name, options):
    prior, trained = _trained_copy("qwen3_moe")
    method = make_method(name, **options).attach(trained, prior)
    assert save_eval_routing(tmp_path, method, prior) is None
    assert not (tmp_path / EVAL_ROUTING_DIR).exists()
    assert attach_eval_routing(trained, tmp_path) is None


def test_adaptive_correction_bias_travels_in_the_checkpoint_itself(tmp_path):
    """On DeepSeek-V3, rpb_adaptive's bias is the router's own correction bias: the saved model
    routes with it natively (nothing to re-attach), as DeepSeek-V3 keeps its own."""
    prior, trained = _trained_copy("deepseek_v3")
    trained.train()
    batch = make_batch(seed=5)
    method = make_method("rpb_adaptive", update_rate=0.05).attach(trained, prior)
    for _ in range(3):
        trained(**batch)
        method.router_loss(batch["attention_mask"])
        method.on_step_end()
    trained.eval()
    with torch.no_grad():
        steered = trained(**batch).logits
    method.detach()
    assert save_eval_routing(tmp_path, method, prior) is None
    trained.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert attach_eval_routing(reloaded, tmp_path) is None
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, steered)
    # The fixture has teeth: with the base's correction bias the same weights route otherwise.
    with torch.no_grad():
        for handle, b0 in zip(find_routers(reloaded), prior.correction_bias, strict=True):
            handle.correction_bias.copy_(b0)
        assert not torch.equal(reloaded(**batch).logits, steered)


def test_broken_spec_is_named(tmp_path):
    folder = tmp_path / EVAL_ROUTING_DIR
    folder.mkdir()
    (folder / "method.json").write_text('{"kind": "hard", "strenght": 1.0}')
    with pytest.raises(ValueError, match=r"method\.json: unknown key\(s\) strenght"):
        eval_routing_spec(tmp_path)
    (folder / "method.json").write_text('{"kind": "rpb", "strength": -1.0}')
    with pytest.raises(ValueError, match=r"method\.json: strength of method 'rpb': -1\.0 is not"):
        eval_routing_spec(tmp_path)
    (folder / "method.json").write_text('{"method": "nope", "strength": 0, "options": {}}')
    with pytest.raises(ValueError, match="unknown router method 'nope'"):
        attach_eval_routing(make_model("qwen3_moe"), tmp_path)


@pytest.fixture(scope="module")
def hard_model(setup, tmp_path_factory):  # noqa: F811
    """The evaluation fixture's model "post-trained" with `hard`: routers moved, prior saved."""
    root = tmp_path_factory.mktemp("hard")
    base = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(setup["model_dir"])
    texts = [x["prompt"] + x["target"] for items in setup["sets"].values() for x in items]
    batches = [
        {"input_ids": torch.tensor([tok(t).input_ids]), "attention_mask": None} for t in texts
    ]
    prior = extract_prior(
        base, batches, model_id="t", revision="r", corpus_hash="0" * 64, progress=False
    )
    perturb_routers(base, scale=3.0)
    model_dir = root / "model"
    base.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    native_dir = root / "native"
    shutil.copytree(model_dir, native_dir)
    save_eval_routing(model_dir, make_method("hard"), prior)
    prior_path = root / "prior.safetensors"
    prior.save(prior_path)
    return {"dir": model_dir, "native": native_dir, "prior": prior, "prior_path": prior_path}


def test_lm_eval_scores_the_hard_routed_model(setup, hard_model, tmp_path):  # noqa: F811
    result = evaluate_model(
        hard_model["dir"], setup["eval_dir"], ["add"], tmp_path / "e.json", tmp_path / "w"
    )
    assert result["eval_routing"]["kind"] == "hard"
    model = load_model(hard_model["dir"], steer=False, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hard_model["dir"])
    items = setup["sets"]["add"]
    native = [_target_ll(model, tok, x["prompt"], x["target"])[0] for x in items]
    with make_method("hard").attach(model, hard_model["prior"]):
        steered = [_target_ll(model, tok, x["prompt"], x["target"])[0] for x in items]
    assert native != pytest.approx(steered, abs=1e-3), "fixture: hard routing must matter"
    assert result["tasks"]["rpb_add_ll"]["ll_sum"] == pytest.approx(steered, abs=1e-4)
    saved = json.loads((tmp_path / "e.json").read_text())
    assert saved["eval_routing"] == {
        "kind": "hard",
        "strength": None,
        "options": {"gate_from": "live", "keep_bias_at_eval": True},
    }
    # Recorded as for any folder (and before steered folders had a type of their own): the
    # type is registered in this process, so lm-eval loads it without trust_remote_code.
    assert saved["lm_eval"]["config"]["model_args"] == {
        "pretrained": str(hard_model["dir"].resolve()),
        "dtype": "float32",
    }


def _analyse(world, hard_model, model_dir, out_json):
    """The co-activation analysis of `model_dir` against the fixture's base (`world`: the setup
    fixture) and hard's prior."""
    return analyze_model(
        model_dir=model_dir,
        base_dir=world["model_dir"],
        prior_path=hard_model["prior_path"],
        eval_dir=world["eval_dir"],
        tasks=["add", "words"],
        limit=24,
        out_json=out_json,
    )


def test_analysis_counts_the_experts_hard_routing_uses(setup, hard_model, tmp_path):  # noqa: F811
    def analyse(model_dir, name):
        return _analyse(setup, hard_model, model_dir, tmp_path / f"{name}.json")

    steered, native = analyse(hard_model["dir"], "hard"), analyse(hard_model["native"], "native")
    assert steered["eval_routing"]["kind"] == "hard" and native["eval_routing"] is None
    # Base selection on the model's own hidden states: overlap with the base router is exact.
    assert all(row["topk_overlap_with_base"] == 1.0 for row in steered["layers"])
    assert native["mean"]["topk_overlap_with_base"] < 0.9


def _steered_folder(folder, arch, name="hard", strength=None, options=None):
    """A 'post-trained' model saved in `folder` (its routing not yet): the method that steers it
    at evaluation, its prior, a batch, and the steered and native logits on it."""
    prior, trained = _trained_copy(arch)
    batch = make_batch(seed=5)
    method = make_method(name, strength=strength, **(options or {})).attach(trained, prior)
    trained.eval()
    with torch.no_grad():
        steered = trained(**batch).logits
    method.detach()
    with torch.no_grad():
        native = trained(**batch).logits
    assert not torch.equal(steered, native), "the fixture must make the steering matter"
    trained.save_pretrained(folder)
    return method, prior, batch, steered, native


ROOT = Path(__file__).resolve().parents[1]

# A process with transformers alone (rpb not imported, so rpb_steered not registered), as
# lm-eval's CLI or a user's script loads a folder: transformers' default (no trust_remote_code,
# no terminal to ask on), trust_remote_code=False, then trust_remote_code=True, whose model's
# logits on the saved batch it saves. With --rpb it imports rpb.eval_routing first, as rpb's own
# processes do. It prints what it saw as JSON.
_LOADER = textwrap.dedent(
    """
    import json, sys
    import torch
    if "--rpb" in sys.argv:
        import rpb.eval_routing
    from transformers import AutoModelForCausalLM

    folder, batch, out = sys.argv[1:4]
    seen = {"rpb_at_start": "rpb.eval_routing" in sys.modules, "refused": {}}
    for name, kw in (("default", {}), ("false", {"trust_remote_code": False})):
        try:
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
        except ValueError as err:
            seen["refused"][name] = str(err)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=True
    ).eval()
    seen["rpb_at_end"] = "rpb.eval_routing" in sys.modules
    seen["class"] = type(model).__name__
    seen["method"] = model.rpb_eval_routing.name
    with torch.no_grad():
        torch.save(model(**torch.load(batch)).logits, out)
    print()  # after transformers' prompt, if any
    print("SEEN", json.dumps(seen))
    """
)


def _fresh_process(code: str, args, home: Path) -> dict:
    """Run `code` in a new Python with `args`, its Hugging Face home (and so transformers'
    modules cache) `home`, stdin closed; what it saw (its line `SEEN <json>`)."""
    env = {k: v for k, v in os.environ.items() if k != "HF_MODULES_CACHE"}
    env["HF_HOME"] = str(home)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"  # as here (conftest): the same sums
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = (x for x in done.stdout.splitlines() if x.startswith("SEEN "))
    return json.loads(line.removeprefix("SEEN "))


def _cached_modules(home: Path) -> list[str]:
    """The rpb_steered modules transformers copied into its modules cache under `home`."""
    return sorted(str(p.relative_to(home)) for p in home.rglob("rpb_steered*"))


def test_a_stock_load_of_a_steered_folder_steers_or_says_so(tmp_path) -> None:
    """The acceptance test of issue 46's item 6: `from_pretrained` without rpb's help, as
    lm-eval's CLI loads a folder, either routes as the method does at evaluation or says that it
    does not. "Without rpb's help" is a fresh process that imports transformers alone (this one
    has imported rpb, which registers the folder's type).

    It refuses, loudly: the folder's model type is rpb's own (`rpb_steered`), so transformers
    loads nothing without trust_remote_code=True (lm-eval's default is False; transformers' own,
    None, asks on a terminal and raises the same error elsewhere). A raised error is the better
    behaviour than a line on stderr beside an unsteered model, so the test asserts it in place of
    the line. The error is transformers' own (no code of the folder runs before it is trusted):
    a few lines naming the folder and trust_remote_code, not why; the why is in the folder it
    sends one to: config.json's `rpb_note` and the module rpb_steered.py name eval_routing, rpb
    and trust_remote_code. With trust_remote_code=True it loads (rpb_steered.py imports rpb) and
    steers; that path, and only it, copies the module into transformers' modules cache."""
    folder, home = tmp_path / "model", tmp_path / "hf_home"
    method, prior, batch, steered, _ = _steered_folder(folder, "qwen3_moe")
    save_eval_routing(folder, method, prior)
    torch.save(batch, tmp_path / "batch.pt")
    seen = _fresh_process(_LOADER, [folder, tmp_path / "batch.pt", tmp_path / "out.pt"], home)
    assert not seen["rpb_at_start"] and seen["rpb_at_end"]  # stock, then rpb by the folder's module
    assert set(seen["refused"]) == {"default", "false"}
    for error in seen["refused"].values():
        assert str(folder) in error and "trust_remote_code=True" in error
    config = json.loads((folder / "config.json").read_text())
    for text in (config["rpb_note"], (folder / STEERED_MODULE_FILE).read_text()):
        assert EVAL_ROUTING_DIR in text and "rpb" in text and "trust_remote_code=True" in text
    assert seen["class"] == "Qwen3MoeForCausalLM" and seen["method"] == "hard"
    assert torch.equal(torch.load(tmp_path / "out.pt"), steered)
    assert _cached_modules(home), "the stock path loads the folder's module from the cache"


def test_a_process_that_imported_rpb_loads_a_steered_folder_without_remote_code(tmp_path) -> None:
    """rpb's own processes (the pipeline's jobs, lm-eval run from rpb): importing rpb.eval_routing
    registers rpb_steered with transformers, which then prefers it to the folder's auto_map: a
    plain from_pretrained loads the folder steered, trust_remote_code or not, and nothing is
    written into transformers' modules cache (a fresh process, its HF_HOME a new folder)."""
    folder, home = tmp_path / "model", tmp_path / "hf_home"
    method, prior, batch, steered, _ = _steered_folder(
        folder, "qwen3_moe", "rpb", 2.0, {"keep_bias_at_eval": True}
    )
    save_eval_routing(folder, method, prior)
    torch.save(batch, tmp_path / "batch.pt")
    args = [folder, tmp_path / "batch.pt", tmp_path / "out.pt", "--rpb"]
    seen = _fresh_process(_LOADER, args, home)
    assert seen["rpb_at_start"] and seen["refused"] == {}
    assert seen["class"] == "Qwen3MoeForCausalLM" and seen["method"] == "rpb"
    assert torch.equal(torch.load(tmp_path / "out.pt"), steered)  # steered, and once
    assert _cached_modules(home) == []


def test_in_this_process_a_steered_folder_loads_with_rpb_s_classes(tmp_path, monkeypatch) -> None:
    """Here too (rpb imported): no remote code is looked up for a steered folder, whatever
    trust_remote_code says; the model is steered once (rpb's bias twice would move the logits),
    `attach_eval_routing` returning the method it carries."""
    import transformers.dynamic_module_utils as dynamic
    import transformers.models.auto.auto_factory as auto_factory
    import transformers.models.auto.configuration_auto as configuration_auto

    def no_remote_code(*args, **kwargs):
        raise AssertionError(f"remote code looked up: {args}")

    cache = tmp_path / "modules"
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(cache))
    for module in (auto_factory, configuration_auto):
        monkeypatch.setattr(module, "get_class_from_dynamic_module", no_remote_code)
    folder = tmp_path / "model"
    method, prior, batch, steered, native = _steered_folder(
        folder, "qwen3_moe", "rpb", 2.0, {"keep_bias_at_eval": True}
    )
    save_eval_routing(folder, method, prior)
    for kw in ({}, {"trust_remote_code": False}, {"trust_remote_code": True}):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
        assert attach_eval_routing(model, folder) is model.rpb_eval_routing
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, steered), kw
        model.rpb_eval_routing.detach()
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, native), kw
    assert not cache.exists()


def test_the_folder_module_and_rpb_register_the_same_classes(tmp_path) -> None:
    """rpb_steered.py (what a stock, trusted load runs) re-exports the classes that importing
    rpb.eval_routing registers: one implementation. Registering again changes nothing."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from rpb.eval_routing import RpbSteeredConfig, RpbSteeredForCausalLM

    register_steered_type()
    register_steered_type()
    assert CONFIG_MAPPING[STEERED_MODEL_TYPE] is RpbSteeredConfig
    assert MODEL_FOR_CAUSAL_LM_MAPPING[RpbSteeredConfig] is RpbSteeredForCausalLM
    namespace: dict = {}
    exec(compile(STEERED_MODULE_TEXT, STEERED_MODULE_FILE, "exec"), namespace)
    assert namespace["RpbSteeredConfig"] is RpbSteeredConfig
    assert namespace["RpbSteeredForCausalLM"] is RpbSteeredForCausalLM
    method, prior, *_ = _steered_folder(tmp_path, "qwen3_moe")
    save_eval_routing(tmp_path, method, prior)
    assert type(AutoConfig.from_pretrained(tmp_path)) is RpbSteeredConfig


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral", "olmoe"])
def test_a_steered_folder_loads_steered_in_every_family(tmp_path, arch) -> None:
    """Through the folder's own class (a plain from_pretrained in a process that imported rpb, or
    rpb's `load_model`) the family's own transformers model loads with its routing attached;
    rpb's unsteered load is transformers' load of the same folder before it was made a steered
    one: its config, class and logits."""
    from rpb.user_cli import check_model_dir

    steered_dir, plain_dir = tmp_path / "steered", tmp_path / "plain"
    method, prior, batch, steered, native = _steered_folder(steered_dir, arch)
    shutil.copytree(steered_dir, plain_dir)
    save_eval_routing(steered_dir, method, prior)
    plain_config = json.loads((plain_dir / "config.json").read_text())
    config = json.loads((steered_dir / "config.json").read_text())
    assert config["model_type"] == STEERED_MODEL_TYPE
    assert config["rpb_base_model_type"] == plain_config["model_type"]
    assert base_config_dict(config) == plain_config
    check_model_dir(steered_dir)  # `rpb finetune --model` names the family, not rpb_steered
    for model in (
        AutoModelForCausalLM.from_pretrained(steered_dir, dtype=torch.float32),
        load_model(steered_dir, dtype=torch.float32),
    ):
        assert model.config.model_type == plain_config["model_type"]
        assert model.rpb_eval_routing.name == "hard"
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, steered)
    unsteered = load_model(steered_dir, steer=False, dtype=torch.float32)
    stock = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32)
    assert type(unsteered) is type(stock) and not hasattr(unsteered, "rpb_eval_routing")
    mine, theirs = unsteered.config.to_dict(), stock.config.to_dict()
    assert mine.pop("_name_or_path") == str(steered_dir)
    assert theirs.pop("_name_or_path") == str(plain_dir)
    assert mine == theirs
    with torch.no_grad():
        assert torch.equal(unsteered(**batch).logits, native)
        assert torch.equal(stock(**batch).logits, native)


def test_loading_keywords_reach_the_family_config_as_for_any_folder(tmp_path) -> None:
    """Keywords transformers absorbs into the config (experts_implementation, a config override)
    do so for a steered folder as for a plain one."""
    steered_dir, plain_dir = tmp_path / "steered", tmp_path / "plain"
    method, prior, *_ = _steered_folder(steered_dir, "qwen3_moe")
    shutil.copytree(steered_dir, plain_dir)
    save_eval_routing(steered_dir, method, prior)
    kw = {"dtype": torch.float32, "experts_implementation": "eager", "output_router_logits": True}
    mine = load_model(steered_dir, steer=False, **kw).config
    theirs = AutoModelForCausalLM.from_pretrained(plain_dir, **kw).config
    assert mine._experts_implementation == theirs._experts_implementation == "eager"
    assert mine.output_router_logits is theirs.output_router_logits is True


def test_a_folder_saved_before_steered_folders_had_a_type_loads_as_before(tmp_path) -> None:
    """A steered folder written before (the family's model type, an eval_routing/ folder): rpb
    loads and steers it as it did; a stock load gives its saved routers alone, as always."""
    method, prior, batch, steered, native = _steered_folder(
        tmp_path, "qwen3_moe", "rpb", 2.0, {"keep_bias_at_eval": True}
    )
    plain = (tmp_path / "config.json").read_text()
    save_eval_routing(tmp_path, method, prior)
    (tmp_path / "config.json").write_text(plain)
    (tmp_path / STEERED_MODULE_FILE).unlink()
    model = load_model(tmp_path, dtype=torch.float32)
    assert attach_eval_routing(model, tmp_path) is model.rpb_eval_routing
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, steered)
        for unsteered in (
            load_model(tmp_path, steer=False, dtype=torch.float32),
            AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32),
        ):
            assert torch.equal(unsteered(**batch).logits, native)


def test_the_folder_module_is_written_alike_and_names_a_missing_rpb(tmp_path, monkeypatch):
    """rpb_steered.py is the same bytes in every folder, a second save changes no file, and
    without rpb the module says to install it."""
    method, prior, *_ = _steered_folder(tmp_path, "qwen3_moe")
    save_eval_routing(tmp_path, method, prior)
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    save_eval_routing(tmp_path, method, prior)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == first
    assert first[STEERED_MODULE_FILE] == STEERED_MODULE_TEXT.encode()
    monkeypatch.setitem(sys.modules, "rpb.eval_routing", None)
    with pytest.raises(
        ImportError, match=r"eval_routing/ folder\): install rpb .*pip install \. in a checkout"
    ):
        exec(compile(STEERED_MODULE_TEXT, STEERED_MODULE_FILE, "exec"), {})


# lm-eval's hf model as its CLI builds it from --model_args, in a process without rpb: without
# trust_remote_code, then with it; the logits of its model on the saved ids are saved.
_LM_EVAL_LOADER = textwrap.dedent(
    """
    import json, sys
    import torch
    import lm_eval.api.registry

    folder, ids, out = sys.argv[1:4]
    hflm = lm_eval.api.registry.get_model("hf")
    run = {"batch_size": 1, "device": "cpu"}
    args = {"pretrained": folder, "dtype": "float32"}
    seen = {"rpb_at_start": "rpb.eval_routing" in sys.modules}
    try:
        hflm.create_from_arg_obj(args, run)
    except ValueError as err:
        seen["refused"] = str(err)
    lm = hflm.create_from_arg_obj({**args, "trust_remote_code": True}, run)
    seen["method"] = lm.model.rpb_eval_routing.name
    with torch.no_grad():
        torch.save(lm.model(torch.load(ids)).logits, out)
    print()  # after transformers' prompt, if any
    print("SEEN", json.dumps(seen))
    """
)


def test_lm_eval_loads_a_steered_folder_steered_or_refuses_it(setup, hard_model, tmp_path):  # noqa: F811
    """lm-eval's hf model, built as its CLI builds it from --model_args: in a process without rpb
    it fails loudly without trust_remote_code and with it scores the model steered; in a process
    that imported rpb (this one) it needs no trust_remote_code. Steered once, either way."""
    import lm_eval.api.registry

    hflm = lm_eval.api.registry.get_model("hf")
    run = {"batch_size": 1, "device": "cpu"}
    lm = hflm.create_from_arg_obj({"pretrained": str(hard_model["dir"]), "dtype": "float32"}, run)
    assert lm.model.rpb_eval_routing.name == "hard"
    assert attach_eval_routing(lm.model, hard_model["dir"]) is lm.model.rpb_eval_routing
    tok = AutoTokenizer.from_pretrained(hard_model["dir"])
    native = AutoModelForCausalLM.from_pretrained(hard_model["native"], dtype=torch.float32)
    items = setup["sets"]["add"][:4]
    with make_method("hard").attach(native.eval(), hard_model["prior"]):
        steered = [_target_ll(native, tok, x["prompt"], x["target"]) for x in items]
        ids = torch.tensor([tok(items[0]["prompt"] + items[0]["target"]).input_ids])
        with torch.no_grad():
            steered_logits = native(ids).logits
    assert [_target_ll(lm.model, tok, x["prompt"], x["target"]) for x in items] == steered
    lm.model.rpb_eval_routing.detach()

    torch.save(ids, tmp_path / "ids.pt")
    args = [hard_model["dir"], tmp_path / "ids.pt", tmp_path / "out.pt"]
    seen = _fresh_process(_LM_EVAL_LOADER, args, tmp_path / "hf_home")
    assert not seen["rpb_at_start"]
    assert str(hard_model["dir"]) in seen["refused"]
    assert "trust_remote_code=True" in seen["refused"]
    assert seen["method"] == "hard"
    assert torch.equal(torch.load(tmp_path / "out.pt"), steered_logits)


def test_an_older_steered_folder_is_scored_and_analysed_alike(setup, hard_model, tmp_path):  # noqa: F811
    """The pipeline's evaluation and analysis of a steered folder written before (the family's
    model type, its method file naming the family `method`) give the numbers of the same model
    saved as a steered folder now, to the bit, and record its method alike."""
    old = tmp_path / "old"
    shutil.copytree(hard_model["dir"], old, ignore=shutil.ignore_patterns(STEERED_MODULE_FILE))
    shutil.copy(hard_model["native"] / "config.json", old / "config.json")
    _write_earlier_method_file(old, make_method("hard"))
    new, before = (
        evaluate_model(d, setup["eval_dir"], ["add"], tmp_path / f"{n}.json", tmp_path / n)
        for d, n in ((hard_model["dir"], "new"), (old, "old"))
    )
    assert new["tasks"] == before["tasks"]
    assert before["eval_routing"] == new["eval_routing"]
    # The model_args recorded for a steered folder are those of the older form, which loads as
    # any folder did before steered folders had a type of their own (no trust_remote_code).
    args_new, args_before = (r["lm_eval"]["config"]["model_args"] for r in (new, before))
    assert args_new.pop("pretrained") == str(hard_model["dir"].resolve())
    assert args_before.pop("pretrained") == str(old.resolve())
    assert args_new == args_before == {"dtype": "float32"}
    new, before = (
        _analyse(setup, hard_model, d, tmp_path / f"{n}.analysis.json")
        for d, n in ((hard_model["dir"], "new"), (old, "old"))
    )
    for key in ("layers", "mean"):  # json: NaN (one community, no NMI) equals NaN there
        assert json.dumps(new[key]) == json.dumps(before[key])
    assert new["eval_routing"] == before["eval_routing"] == MethodConfig("hard").to_dict()


def test_a_family_s_own_auto_map_is_kept_for_its_config() -> None:
    """A checkpoint that ships remote modelling code (Moonlight's auto_map) keeps it under
    rpb_base_auto_map; the family's config is rebuilt with it, as transformers read it."""
    from rpb.eval_routing import steered_config_dict

    family = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "hidden_size": 8,
    }
    steered = steered_config_dict(family)
    assert steered["auto_map"]["AutoModelForCausalLM"] == "rpb_steered.RpbSteeredForCausalLM"
    assert steered["rpb_base_auto_map"] == family["auto_map"]
    assert steered_config_dict(steered) == steered
    assert base_config_dict(steered) == family
    plain = {k: v for k, v in family.items() if k != "auto_map"}
    assert base_config_dict(steered_config_dict(plain)) == plain


def test_a_changed_folder_module_is_refused_by_rpb_s_loaders(tmp_path, capsys) -> None:
    """Issue 59, item 6: a line appended to a steered folder's rpb_steered.py loaded silently
    through rpb's loaders (and a stock trust_remote_code=True load runs it). rpb's loaders compare
    it with the text rpb writes and refuse a changed one in one line naming it: load_model, a
    plain from_pretrained in a process that imported rpb, and `rpb prior --model`."""
    from rpb.pipeline.cli import main
    from rpb.pipeline.tokenizer import build_tokenizer

    folder = tmp_path / "model"
    method, prior, *_ = _steered_folder(
        folder, "qwen3_moe", "rpb", 2.0, {"keep_bias_at_eval": True}
    )
    save_eval_routing(folder, method, prior)
    build_tokenizer().save_pretrained(folder)
    load_model(folder)  # as written: loads
    module = folder / STEERED_MODULE_FILE
    module.write_text(STEERED_MODULE_TEXT + "import os; os.system('date > MARKER')\n")
    refusal = (
        f"{module}: not the module rpb writes (changed since the folder was saved; a "
        "trust_remote_code=True load would run the change): replace it with "
        "rpb.eval_routing.STEERED_MODULE_TEXT or delete it (rpb loads the folder without it)"
    )
    for load in (
        lambda: load_model(folder),
        lambda: load_model(folder, steer=False),
        lambda: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True),
    ):
        with pytest.raises(ValueError) as refused:
            load()
        assert str(refused.value) == refusal
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "1 + 2 = 3"}) + "\n")
    capsys.readouterr()
    argv = ["prior", "--model", str(folder), "--data", str(data)]
    assert main([*argv, "--out", str(tmp_path / "prior.safetensors")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"rpb prior: error: {refusal}"
    assert not (tmp_path / "prior.safetensors").exists()
    module.unlink()  # rpb's classes need no module: the folder loads without it
    assert load_model(folder).rpb_eval_routing is not None
