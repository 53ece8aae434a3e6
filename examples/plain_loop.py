"""An rpb router method in a plain PyTorch training loop.

    python examples/plain_loop.py                       # tiny random Qwen3-MoE, rpb, 10 steps
    python examples/plain_loop.py --model PATH --method anchor_kl --steps 50

The prior is read off the starting model (the base) on the same synthetic data.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rpb.architectures import char_tokenizer, random_model
from rpb.methods import make_method
from rpb.prior import extract_prior

p = argparse.ArgumentParser()
p.add_argument("--model", help="a checkpoint directory (default: a tiny random Qwen3-MoE)")
p.add_argument("--method", default="rpb")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--batch-size", type=int, default=8)
args = p.parse_args()
torch.manual_seed(0)

if args.model:
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
else:
    tok = char_tokenizer()
    model = random_model("qwen3_moe", vocab_size=len(tok), pad_token_id=tok.pad_token_id)
tok.pad_token = tok.pad_token or tok.eos_token
tok.padding_side = "right"
device = "cuda" if torch.cuda.is_available() else "cpu"
model.to(device)


def batch(step: int) -> dict[str, torch.Tensor]:
    """Synthetic additions ("12+7=19" + EOS), a different slice of them each step."""
    g = torch.Generator().manual_seed(step)
    a, b = torch.randint(0, 100, (2, args.batch_size), generator=g).tolist()
    texts = [f"{x}+{y}={x + y}{tok.eos_token}" for x, y in zip(a, b, strict=True)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return dict(enc)


prior = extract_prior(
    model,
    [batch(-s) for s in range(1, 5)],
    progress=False,
)  # its provenance (model folder, revision, a hash of the batches) is filled in
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
with make_method(args.method).attach(model, prior) as method:
    print(f"{args.method} on {method.control.num_layers} routers of {type(model).__name__}")
    for step in range(args.steps):
        method.set_progress(step, args.steps)  # schedules (rpb_anneal) read it
        inputs = batch(step)
        out = model(**inputs)
        router_loss = method.router_loss(attention_mask=inputs["attention_mask"])
        (out.loss + router_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        method.on_step_end()  # per-step state (rpb_adaptive's bias)
        stats = method.routing_stats()  # drift of this step's routing from the base
        # rpb's router term is 0 by design: its bias acts on which experts are selected,
        # not on the loss. What moves under it is the drift from the base router
        # (mean/kl_to_base up, mean/topk_overlap_with_base down), printed first.
        metrics = {k: v for k, v in stats.items() if k.startswith("mean/")}
        metrics |= {"task_loss": out.loss.item(), "router_loss": router_loss.item()}
        print(f"step {step + 1}", " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
