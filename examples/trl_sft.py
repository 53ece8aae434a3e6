"""An rpb router method with TRL's SFTTrainer: `RouterMethodSFTTrainer(..., router_method=m)`.

    python examples/trl_sft.py                          # tiny random Qwen3-MoE, rpb, 10 steps
    python examples/trl_sft.py --model PATH --method anchor_kl --steps 50

SFTTrainer's loss and metrics (entropy, mean_token_accuracy) are kept; the model's own
load-balancing loss is turned off (one warning says how to keep it), so the method's term is the
only router term.
"""

import argparse
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from rpb.architectures import char_tokenizer, random_model
from rpb.methods import make_method
from rpb.prior import extract_prior
from rpb.trl import RouterMethodSFTTrainer

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

rows = [
    {"prompt": f"{a}+{b}=", "completion": str(a + b)}
    for a in range(0, 100, 7)
    for b in range(0, 100, 9)
]
enc = tok([r["prompt"] + r["completion"] for r in rows[:64]], return_tensors="pt", padding=True)
prior = extract_prior(
    model,
    [dict(enc)],
    progress=False,
)  # its provenance (model folder, revision, a hash of the batches) is filled in
method = make_method(args.method).attach(model, prior)
print(f"{args.method} on {method.control.num_layers} routers of {type(model).__name__}")
config = SFTConfig(
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
trainer = RouterMethodSFTTrainer(
    model=model,
    args=config,
    train_dataset=Dataset.from_list(rows),
    processing_class=tok,
    router_method=method,
)
with method:  # detaches the hooks afterwards: the model routes natively again
    trainer.train()
# rpb's router term is 0 by design: its bias acts on which experts are selected, not on the
# loss. What moves under it is the drift from the base router (mean/kl_to_base up,
# mean/topk_overlap_with_base down), printed first.
for log in trainer.state.log_history:
    if "loss" in log:
        keys = ("task_loss", "router_loss", "entropy", "mean_token_accuracy")
        shown = {k: v for k, v in log.items() if k.startswith("mean/")} | {k: log[k] for k in keys}
        print(f"step {log['step']}", " ".join(f"{k}={v:.4g}" for k, v in shown.items()))
