"""An rpb router method with transformers' Trainer: `RouterMethodTrainer(..., router_method=m)`.

    python examples/trainer.py                          # tiny random Qwen3-MoE, rpb, 10 steps
    python examples/trainer.py --model PATH --method anchor_kl --steps 50

The trainer adds the method's term to the loss (weighted for gradient accumulation), steps the
method, and puts its metrics (router_loss, drift, expert load) in every log, so `report_to`
loggers get them; `trainer.router_history` keeps them too.
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from rpb.architectures import char_tokenizer, random_model
from rpb.methods import make_method
from rpb.prior import extract_prior
from rpb.trainer import RouterMethodTrainer

p = argparse.ArgumentParser()
p.add_argument("--model", help="a checkpoint directory (default: a tiny random Qwen3-MoE)")
p.add_argument("--method", default="rpb")
p.add_argument("--steps", type=int, default=10)
args = p.parse_args()

if args.model:
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
else:
    tok = char_tokenizer()
    model = random_model("qwen3_moe", vocab_size=len(tok), pad_token_id=tok.pad_token_id)
tok.pad_token = tok.pad_token or tok.eos_token
tok.padding_side = "right"

texts = [f"{a}+{b}={a + b}{tok.eos_token}" for a in range(0, 100, 7) for b in range(0, 100, 9)]
rows = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    enc = tok.pad(examples, return_tensors="pt")
    enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return dict(enc)


prior = extract_prior(
    model,
    [collate(rows[i : i + 16]) for i in range(0, len(rows), 16)],
    progress=False,
)  # its provenance (model folder, revision, a hash of the batches) is filled in
method = make_method(args.method).attach(model, prior)
print(f"{args.method} on {method.control.num_layers} routers of {type(model).__name__}")
training = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="rpb-example-"),
    max_steps=args.steps,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=not torch.cuda.is_available(),
    disable_tqdm=True,
)
trainer = RouterMethodTrainer(
    model=model, args=training, train_dataset=rows, data_collator=collate, router_method=method
)
with method:  # detaches the hooks afterwards: the model routes natively again
    trainer.train()
# rpb's router term is 0 by design: its bias acts on which experts are selected, not on the
# loss. What moves under it is the drift from the base router (mean/kl_to_base up,
# mean/topk_overlap_with_base down), printed first.
for entry in trainer.router_history:
    shown = {k: v for k, v in entry.items() if k.startswith("mean/")}
    shown |= {k: v for k, v in entry.items() if k in ("task_loss", "router_loss", "lr")}
    print(f"step {entry['step']}", " ".join(f"{k}={v:.4g}" for k, v in shown.items()))
