"""Tokenizer: vocabulary from the generator, exact round trips, offline save/load, chat template."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rpb.pipeline.data import (
    EVAL_TASKS,
    MATH2_MARK,
    MATH2_WORDS,
    MATH_MARK,
    MATH_WORDS,
    SIZE_PRESETS,
    load_jsonl,
    split_symbols,
    vocabulary,
    write_corpora,
)
from rpb.pipeline.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpora")
    write_corpora(out, seed=1, sizes=SIZE_PRESETS["smoke"])
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(saved: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(saved)


def _texts(root: Path) -> list[str]:
    texts = [r["text"] for r in load_jsonl(root / "pretrain.jsonl", ("domain", "text"))]
    for task in ("math", "math2"):
        texts += [
            r["prompt"] + r["completion"]
            for r in load_jsonl(root / f"post/{task}.jsonl", ("prompt", "completion"))
        ]
    for task in EVAL_TASKS:
        texts += [
            r["prompt"] + r["target"]
            for r in load_jsonl(root / f"eval/{task}.jsonl", ("prompt", "target"))
        ]
    return texts


def test_vocabulary_is_small_and_fixed(tok: PreTrainedTokenizerBase) -> None:
    vocab = vocabulary()
    assert len(vocab) == len(set(vocab)) == len(tok) < 128
    assert tok.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == (
        "<pad>", 0, "<eos>", 1,
    )  # fmt: skip
    assert tok.bos_token is None and tok.padding_side == "left"


def test_every_corpus_text_round_trips_symbol_by_symbol(
    corpora: Path, tok: PreTrainedTokenizerBase
) -> None:
    texts = _texts(corpora)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    for text, row in zip(texts, ids, strict=True):
        assert tok.convert_ids_to_tokens(row) == split_symbols(text)
        assert tok.decode(row) == text


def test_words_are_single_tokens_and_names_are_characters(tok: PreTrainedTokenizerBase) -> None:
    assert tok.tokenize("KOBA:Red") == ["K", "O", "B", "A", ":", "Red"]
    assert tok.tokenize("SumOf35And47?") == ["Sum", "Of", "3", "5", "And", "4", "7", "?"]
    assert tok.tokenize("TheseCowsMoo.") == ["These", "Cows", "Moo", "."]


def test_prompt_target_split_is_token_aligned(corpora: Path, tok: PreTrainedTokenizerBase) -> None:
    # lm-eval scores a continuation as encode(prompt + target) minus encode(prompt).
    for task in EVAL_TASKS:
        for r in load_jsonl(corpora / f"eval/{task}.jsonl", ("prompt", "target")):
            whole = tok(r["prompt"] + r["target"], add_special_tokens=False)["input_ids"]
            prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            assert whole[: len(prompt)] == prompt
            assert tok.decode(whole[len(prompt) :]) == r["target"]


def test_math_template_tokens_never_occur_in_pretraining(
    corpora: Path, tok: PreTrainedTokenizerBase
) -> None:
    texts = [r["text"] for r in load_jsonl(corpora / "pretrain.jsonl", ("domain", "text"))]
    seen = {i for row in tok(texts, add_special_tokens=False)["input_ids"] for i in row}
    for words, mark in ((MATH_WORDS, MATH_MARK), (MATH2_WORDS, MATH2_MARK)):
        template_ids = set(tok.convert_tokens_to_ids([*words, mark]))
        assert not template_ids & seen
        post = "math" if words == MATH_WORDS else "math2"
        prompts = [r["prompt"] for r in load_jsonl(corpora / f"post/{post}.jsonl", ("prompt",))]
        used = {i for row in tok(prompts, add_special_tokens=False)["input_ids"] for i in row}
        assert template_ids <= used  # the template really uses them


def test_left_padding_and_eos(tok: PreTrainedTokenizerBase) -> None:
    batch = tok(["3+4=", "SumOf3And4?"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0][:2] == [0, 0]
    assert tok.decode(batch["input_ids"][0], skip_special_tokens=True) == "3+4="
    assert tok("28", add_special_tokens=True)["input_ids"] == tok.convert_tokens_to_ids(["2", "8"])
    assert tok.decode([*tok("28")["input_ids"], tok.eos_token_id]) == "28<eos>"


def test_unknown_symbol_is_an_error(tok: PreTrainedTokenizerBase) -> None:
    with pytest.raises(Exception, match="WordLevel"):
        tok("35 +47=")
    with pytest.raises(ValueError, match=r"unknown symbol 'Xyz'"):
        split_symbols("35+Xyz")


def test_chat_template_is_user_then_assistant(tok: PreTrainedTokenizerBase) -> None:
    msgs = [{"role": "user", "content": "SumOf3And4?"}, {"role": "assistant", "content": "7"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "SumOf3And4?7<eos>"
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True) == (
        "SumOf3And4?"
    )
    out = tok.apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert out["assistant_masks"] == [0] * 6 + [1, 1]  # answer and EOS only


def test_build_without_dir_matches_saved(saved: Path, tok: PreTrainedTokenizerBase) -> None:
    fresh = build_tokenizer()
    text = "TheBigDogNearTheCatsBarks.abc~cba"
    assert fresh(text)["input_ids"] == tok(text)["input_ids"]
    assert sorted(p.name for p in saved.iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
