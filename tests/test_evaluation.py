"""rpb.pipeline.evaluation: lm-eval task YAMLs and real in-process lm-eval runs on a tiny random
qwen3_moe.

The reference computations (direct log-softmax sums, unpadded single-prompt greedy decoding) are
independent of lm-eval, so they catch padding, tokenisation-boundary and stop-sequence bugs.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from rpb.pipeline.evaluation import (
    GEN_MARGIN,
    evaluate_model,
    run_lm_eval,
    save_results,
    task_names,
    write_tasks,
)

CHARS = "0123456789+=?abcdefghijklmnopqrstuvwxyz "
MAX_NEW = 6  # longest answer the fixture lets the model give
N_CAND = 60  # candidate prompts per eval set
N_ITEMS = 24  # items per eval set


def _char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def _greedy(model, tok, prompt: str, max_new: int) -> tuple[str, bool]:
    """Unpadded single-prompt greedy decode cut at the first eos, and whether eos came."""
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )[0, ids.shape[1] :].tolist()
    stopped = tok.eos_token_id in out
    if stopped:
        out = out[: out.index(tok.eos_token_id)]
    # lm-eval decodes with skip_special_tokens=True; a random model may emit <pad> mid-answer.
    return tok.decode(out, skip_special_tokens=True), stopped


def _target_ll(model, tok, prompt: str, target: str) -> tuple[float, int]:
    """Sum of log-softmax of the target tokens and the end token given the prompt, and their
    count."""
    ctx, tgt = tok(prompt).input_ids, [*tok(target).input_ids, tok.eos_token_id]
    ids = torch.tensor([ctx + tgt])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    pos = torch.arange(len(ctx) - 1, ids.shape[1] - 1)
    return float(logp[pos, ids[0, len(ctx) :]].sum()), len(tgt)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny random qwen3_moe + char tokenizer and two eval sets with mixed outcomes."""
    root = tmp_path_factory.mktemp("eval")
    tok = _char_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    fmts = {"add": "{a}+{b}=", "words": "sum of {a} and {b} ?"}
    prompts = {
        name: [fmt.format(a=(7 * i + 3) % 97 + 1, b=(13 * i + 5) % 89 + 1) for i in range(N_CAND)]
        for name, fmt in fmts.items()
    }
    # A random model almost never emits eos. Make eos a scaled copy of the output row of the
    # token the model most often emits second or third, so eos wins wherever that token would
    # and greedy answers end at varied, non-zero lengths.
    counts: Counter[int] = Counter()
    for p in (p for ps in prompts.values() for p in ps):
        ids = torch.tensor([tok(p).input_ids])
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        counts.update(out[0, ids.shape[1] + 1 :].tolist())
    with torch.no_grad():
        head = model.lm_head.weight
        head[tok.eos_token_id] = 1.5 * head[counts.most_common(1)[0][0]]
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    eval_dir = root / "evals"
    eval_dir.mkdir()
    sets = {}
    for name, cands in prompts.items():
        done, rest = [], []
        for p in cands:
            pred, stopped = _greedy(model, tok, p, MAX_NEW)
            (done if stopped and pred else rest).append((p, pred))
        assert len(done) >= N_ITEMS // 3, f"fixture: only {len(done)} {name} answers end in eos"
        items = []
        for i in range(N_ITEMS):
            # Cycle through: the model's own answer (match), answer + one char (near miss) and
            # an unrelated answer, so batches mix outcomes and prompt lengths.
            if i % 3 == 0:
                p, pred = done.pop(0)
                target = pred
            else:
                p, pred = rest.pop(0) if rest else done.pop()
                target = pred + "1" if i % 3 == 1 else "42"
            items.append({"prompt": p, "target": target})
        (eval_dir / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
        sets[name] = items
    return {"root": root, "model_dir": model_dir, "eval_dir": eval_dir, "sets": sets}


@pytest.fixture(scope="module")
def result(setup):
    out = setup["root"] / "out" / "eval.json"
    res = evaluate_model(
        setup["model_dir"],
        setup["eval_dir"],
        ["add", "words"],
        out,
        setup["root"] / "work",
        batch_size=8,  # several batches with different left-padding
    )
    return res, out


def test_yamls_load_through_taskmanager(setup, tmp_path):
    from lm_eval.tasks import TaskManager

    tasks = write_tasks(setup["eval_dir"], tmp_path / "tasks", ["add", "words"], limit=5)
    assert tasks == [*task_names("add"), *task_names("words")]
    loaded = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False).load(tasks)
    objs = loaded["tasks"]
    assert sorted(objs) == sorted(tasks)
    gen, ll = objs["rpb_add"], objs["rpb_add_ll"]
    assert gen.OUTPUT_TYPE == "generate_until" and ll.OUTPUT_TYPE == "loglikelihood"
    longest = max(len(x["target"]) for x in setup["sets"]["add"][:5])
    kw = gen.config.generation_kwargs
    assert kw["until"] == ["<eos>"] and kw["do_sample"] is False
    assert kw["max_gen_toks"] == longest + GEN_MARGIN
    docs = list(ll.test_docs())
    assert len(docs) == 5  # limit copies the first 5 items
    assert ll.doc_to_text(docs[0]) == setup["sets"]["add"][0]["prompt"]
    assert ll.doc_to_target(docs[0]) == setup["sets"]["add"][0]["target"] + "<eos>"
    # The datasets cache stays inside the task dir.
    assert (tmp_path / "tasks" / "hf_datasets_cache").is_dir()


def test_write_tasks_rejects_bad_input(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "target": "2"}\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*'target'"):
        write_tasks(tmp_path, tmp_path / "t", ["bad"])
    with pytest.raises(ValueError, match="eval set name"):
        write_tasks(tmp_path, tmp_path / "t", ["../bad"])
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        write_tasks(tmp_path, tmp_path / "t", ["missing"])


def test_scores_shapes_and_saved_json(setup, result):
    res, out = result
    assert list(res["tasks"]) == ["rpb_add", "rpb_add_ll", "rpb_words", "rpb_words_ll"]
    for name, r in res["tasks"].items():
        assert r["n"] == len(r["items"]) == N_ITEMS
        assert r["score"] == pytest.approx(sum(r["items"]) / N_ITEMS)
        if name.endswith("_ll"):
            assert r["metric"] == "ll_per_token" and all(x < 0 for x in r["items"])
            # lm-eval's own aggregate is exp(-mean total ll): tie the raw and compact views.
            ppl = res["lm_eval"]["results"][name]["perplexity,none"]
            assert ppl == pytest.approx(math.exp(-sum(r["ll_sum"]) / N_ITEMS))
        else:
            assert r["metric"] == "exact_match" and set(r["items"]) <= {0.0, 1.0}
            # The fixture plants matches on every third item, so a dead scorer fails here.
            assert 0 < r["score"] < 1
    assert res["provenance"]["lm_eval_version"] == "0.4.13"
    assert res["lm_eval"]["config"]["model_args"]["dtype"] == "float32"
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))


def test_loglikelihood_matches_direct_computation(setup, result):
    res, _ = result
    model = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(setup["model_dir"])
    for name, items in setup["sets"].items():
        r = res["tasks"][f"rpb_{name}_ll"]
        direct = [_target_ll(model, tok, x["prompt"], x["target"]) for x in items]
        assert r["n_tokens"] == [n for _, n in direct]
        assert r["ll_sum"] == pytest.approx([ll for ll, _ in direct], abs=1e-4)
        assert r["items"] == pytest.approx([ll / n for ll, n in direct], abs=1e-4)
        p = [math.exp(ll) for ll, _ in direct]
        assert r["p_target"] == pytest.approx(p, rel=1e-3, abs=1e-9)
        assert r["p_target_mean"] == pytest.approx(sum(p) / len(p), rel=1e-3)


def test_exact_match_matches_direct_greedy_decode(setup, result):
    res, _ = result
    model = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(setup["model_dir"])
    for name, items in setup["sets"].items():
        r = res["tasks"][f"rpb_{name}"]
        max_new = max(len(x["target"]) for x in items) + GEN_MARGIN
        preds = [_greedy(model, tok, x["prompt"], max_new)[0] for x in items]
        assert r["outputs"] == preds
        assert r["items"] == [float(p == x["target"]) for p, x in zip(preds, items, strict=True)]


def test_save_results_is_atomic_json(tmp_path):
    path = tmp_path / "sub" / "r.json"
    save_results({"tasks": {"t": {"score": 0.5}}}, path)
    assert json.loads(path.read_text()) == {"tasks": {"t": {"score": 0.5}}}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left behind


def test_unknown_task_is_named(setup, tmp_path):
    write_tasks(setup["eval_dir"], tmp_path, ["add"])
    with pytest.raises(ValueError, match="rpb_nope"):
        run_lm_eval(setup["model_dir"], tmp_path, ["rpb_nope"], include_defaults=False)
