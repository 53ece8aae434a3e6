"""rpb.pipeline.analysis: batching of whole texts, the corpus and probe readers, the routing pass
(counts and drift) and the whole-model analysis, on tiny hand-made inputs with known answers."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from conftest import make_batch, make_model, perturb_routers
from safetensors.torch import load_file

from rpb.architectures import random_model
from rpb.pipeline.analysis import (
    analyze_model,
    corpus_texts,
    extract_prior_from_corpus,
    load_for_inference,
    probe_texts,
    routing_pass,
    text_batches,
)
from rpb.pipeline.tokenizer import build_tokenizer, encode
from rpb.prior import RouterPrior, extract_prior


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ---------------------------------------------------------------- text batches and readers


def test_text_batches_right_pads_each_text_and_appends_eos(tok):
    # The tokenizer pads on the left (for generation); training text is right-padded regardless.
    assert tok.padding_side == "left"
    eos, pad = tok.eos_token_id, tok.pad_token_id
    one, two, three, five, plus, eq, red = tok.convert_tokens_to_ids(
        ["1", "2", "3", "5", "+", "=", "Red"]
    )
    batches = text_batches(tok, ["12+3=15", "1+1=2", "Red"], batch_size=2)
    assert len(batches) == 2
    assert batches[0]["input_ids"].tolist() == [
        [one, two, plus, three, eq, one, five, eos],
        [one, plus, one, eq, two, eos, pad, pad],
    ]
    assert batches[0]["attention_mask"].tolist() == [[1] * 8, [1] * 6 + [0, 0]]
    assert batches[1]["input_ids"].tolist() == [[red, eos]]
    assert batches[1]["attention_mask"].tolist() == [[1, 1]]
    assert all(b[k].dtype == torch.long for b in batches for k in b)


def test_text_batches_names_the_untokenizable_item_across_batches(tok):
    texts = ["1+1=2", "2+2=4", "3+3=6", "three plus three"]  # spaces are not in the vocabulary
    with pytest.raises(ValueError, match=r"^probe\.jsonl:4: cannot tokenize 'three plus three'"):
        text_batches(tok, texts, batch_size=2, source="probe.jsonl")


def test_corpus_texts_joins_prompt_and_completion_in_order(tmp_path):
    corpus = _jsonl(
        tmp_path / "post.jsonl",
        [
            {"prompt": "1+1=", "completion": "2", "extra": 1},
            {"prompt": "Sum Of 2 And 3?", "completion": "5"},
        ],
    )
    assert corpus_texts(corpus) == ["1+1=2", "Sum Of 2 And 3?5"]
    _jsonl(corpus, [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2="}])
    with pytest.raises(ValueError, match=r"post\.jsonl:2: missing key\(s\) \['completion'\]"):
        corpus_texts(corpus)


def test_probe_texts_takes_the_first_items_of_each_task_in_task_order(tmp_path):
    for task in ("add", "words"):
        rows = [{"prompt": f"{task}{i}:", "target": str(i), "id": i} for i in range(3)]
        _jsonl(tmp_path / f"{task}.jsonl", rows)
    assert probe_texts(tmp_path, ["words", "add"], 2) == [
        "words0:0",
        "words1:1",
        "add0:0",
        "add1:1",
    ]
    assert probe_texts(tmp_path, ["add"], 10) == ["add0:0", "add1:1", "add2:2"]
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        probe_texts(tmp_path, ["add", "nope"], 1)


# ---------------------------------------------------------------- routing pass


def _batches():
    return [make_batch(seed=s) for s in range(2)]


def _tokens(batches):
    return sum(int(b["attention_mask"].sum()) for b in batches)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_routing_pass_counts_every_unpadded_token_once_per_layer(arch):
    model = make_model(arch)
    batches = _batches()
    out = routing_pass(model, batches)
    counter, tokens = out["counter"], out["tokens"]
    assert out["drift"] is None
    assert tokens == _tokens(batches) == 2 * (2 * 8) - 2 * 3
    k = model.config.num_experts_per_tok
    assert counter.n_tokens.tolist() == [tokens] * counter.n_layers
    for layer in counter.counts:
        assert torch.equal(layer, layer.T)
        assert int(layer.trace()) == tokens * k
    # Same counts as the prior extraction over the same batches (an independent loop).
    prior = extract_prior(
        model, batches, model_id="t", revision="r", corpus_hash="0", progress=False
    )
    assert torch.equal(counter.counts, prior.coactivation)
    # Padded positions do not count: changing their ids changes nothing.
    noisy = [dict(b) for b in batches]
    for b in noisy:
        b["input_ids"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, 7)
    assert torch.equal(routing_pass(model, noisy)["counter"].counts, counter.counts)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_routing_pass_drift_is_zero_against_its_own_prior_and_positive_after_moving(arch):
    model = make_model(arch)
    batches = _batches()
    prior = extract_prior(
        model, batches, model_id="t", revision="r", corpus_hash="0", progress=False
    )
    x = make_batch(seed=9)
    with torch.no_grad():
        before = model(**x).logits
    same = routing_pass(model, batches, prior)["drift"]
    n_layers = prior.num_layers
    assert same["topk_overlap_with_base"] == [1.0] * n_layers
    assert same["kl_to_base"] == pytest.approx([0.0] * n_layers, abs=1e-6)
    with torch.no_grad():  # the pass leaves no hook or steering behind
        assert torch.equal(model(**x).logits, before)

    perturb_routers(model, scale=2.0)
    moved = routing_pass(model, batches, prior)["drift"]
    assert all(0.0 <= o < 1.0 for o in moved["topk_overlap_with_base"])
    assert all(kl > 1e-3 for kl in moved["kl_to_base"])


# ---------------------------------------------------------------- saved models


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tok):
    """A tiny qwen3_moe with the testbed tokenizer's vocabulary, saved with it, and its prior on a
    corpus."""
    root = tmp_path_factory.mktemp("analysis")
    model = random_model("qwen3_moe", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(1, 9) for b in (2, 7)]
    corpus = _jsonl(root / "math.jsonl", rows)
    eval_dir = root / "eval"
    eval_dir.mkdir()
    _jsonl(eval_dir / "add.jsonl", [{"prompt": f"{a}+1=", "target": str(a + 1)} for a in range(5)])
    _jsonl(eval_dir / "words.jsonl", [{"prompt": "TheRedDogBarks", "target": "."}] * 2)
    return {"root": root, "model_dir": model_dir, "corpus": corpus, "eval_dir": eval_dir}


def test_load_for_inference_returns_the_saved_model_in_eval_mode(saved, tok):
    tokenizer, model = load_for_inference(saved["model_dir"])
    assert tokenizer.get_vocab() == tok.get_vocab()
    assert not model.training
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert {p.dtype for p in model.parameters()} == {expected}
    reference = random_model("qwen3_moe", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    if not torch.cuda.is_available():
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                model.state_dict().values(), reference.state_dict().values(), strict=True
            )
        )


def test_extract_prior_from_corpus_records_the_corpus_it_read(saved, tok):
    out = saved["root"] / "priors" / "math.safetensors"
    prior = extract_prior_from_corpus(
        saved["model_dir"], saved["corpus"], out, model_id="tiny", batch_size=5
    )
    texts = corpus_texts(saved["corpus"])
    assert prior.n_tokens == sum(len(encode(tok, t, "t")) + 1 for t in texts)  # + EOS each
    assert prior.corpus_hash == hashlib.sha256(saved["corpus"].read_bytes()).hexdigest()
    assert (prior.model_id, prior.revision) == ("tiny", str(saved["model_dir"]))
    again = RouterPrior.load(out)
    assert torch.equal(again.coactivation, prior.coactivation)
    assert again.corpus_hash == prior.corpus_hash


def test_analyze_model_against_itself_retains_everything(saved, tok):
    prior_path = saved["root"] / "self_prior.safetensors"
    extract_prior_from_corpus(saved["model_dir"], saved["corpus"], prior_path, model_id="tiny")
    out = saved["root"] / "self" / "analysis.json"
    summary = analyze_model(
        model_dir=saved["model_dir"],
        base_dir=saved["model_dir"],
        prior_path=prior_path,
        eval_dir=saved["eval_dir"],
        tasks=["add", "words"],
        limit=3,
        out_json=out,
    )
    probe = probe_texts(saved["eval_dir"], ["add", "words"], 3)
    tokens = sum(len(encode(tok, t, "t")) + 1 for t in probe)
    assert summary["probe"] == {"tasks": ["add", "words"], "limit": 3, "tokens": tokens}
    assert summary["eval_routing"] is None
    assert [row["layer"] for row in summary["layers"]] == [0, 1]
    for row in [*summary["layers"], summary["mean"]]:
        assert row["topk_overlap_with_base"] == 1.0
        assert row["kl_to_base"] == pytest.approx(0.0, abs=1e-6)
        assert row["coact_cosine"] == pytest.approx(1.0)
        assert row["ref_partition_modularity"] == pytest.approx(row["modularity"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary, default=float))
    counts = load_file(str(out.with_suffix(".safetensors")))
    assert torch.equal(counts["counts"], counts["base_counts"])
    k = 2
    assert [int(c.trace()) for c in counts["counts"]] == [tokens * k] * 2


def test_analyze_model_names_a_prior_of_another_shape(saved, tok):
    other = random_model("qwen3_moe", vocab_size=len(tok), num_experts=4)
    prior = extract_prior(
        other, [make_batch(seed=0)], model_id="four", revision="r", corpus_hash="0", progress=False
    )
    prior_path = saved["root"] / "four.safetensors"
    prior.save(prior_path)
    out = saved["root"] / "bad" / "analysis.json"
    with pytest.raises(ValueError, match=r"four\.safetensors of four .*experts 4 \(prior\) vs 8"):
        analyze_model(
            model_dir=saved["model_dir"],
            base_dir=saved["model_dir"],
            prior_path=prior_path,
            eval_dir=saved["eval_dir"],
            tasks=["add"],
            limit=1,
            out_json=out,
        )
    assert not out.exists()
