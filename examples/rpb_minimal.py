"""Router Prior Bias whole, in one file, on a transformers Qwen3-MoE (or Qwen2-MoE) model.

    python examples/rpb_minimal.py                      # a tiny random Qwen3-MoE, 20 steps
    python examples/rpb_minimal.py --model DIR --strength 1.0 --steps 50 --marginal

RPB as the library's `rpb` method does it (docs/methods.md). Per MoE layer, with h the router's
input, z = W h the live router's logits and z0 = W0 h the frozen base router's on the same h:
the experts are the top-k of z + λ z0 (a softmax router ranks by its logits), the gate weights
are the live router's own softmax at those experts. There is no loss term: the bias decides which
experts each token uses and trains, the router learns only through the gate weights, and the loss
is the LM loss alone. At the start W = W0, so z + λ z0 = (1 + λ) z ranks as the router does:
RPB begins as the base model, and as W drifts the base keeps a say in the selection. The bias
stays on at evaluation (the library's default for `rpb`).
`--marginal` is `rpb_marginal`: z0 replaced by log π, the base's mean routing distribution over
the corpus, dropped at evaluation. tests/test_examples.py checks both against the library (rpb
itself is not imported here).
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")  # the same softmax top-k router


def find_routers(model):
    """Every MoE router (the `mlp.gate` of each sparse layer), in layer order."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]
    if not routers:
        raise ValueError(f"no Qwen3-MoE or Qwen2-MoE router in {type(model).__name__}")
    return routers


def batches(n: int, vocab_size: int, seed: int = 0, size: int = 8, length: int = 16):
    """Synthetic data: arithmetic sequences of token ids, right-padded (mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(3, vocab_size, (size, 1), generator=g)
        step = torch.randint(1, 4, (size, 1), generator=g)  # +1, +2 or +3: learnable
        ids = 3 + (start + step * torch.arange(length)) % (vocab_size - 3)  # 0-2 are special ids
        lengths = torch.randint(length // 2, length + 1, (size, 1), generator=g)
        mask = (torch.arange(length) < lengths).long()
        ids, labels = ids.masked_fill(mask == 0, 0), ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


@torch.no_grad()
def extract_prior(model, data) -> dict:
    """The base's router prior, in one pass over `data`: its router weights W0 (frozen copies),
    and per layer the mean routing distribution π and the expert usage counts (padding skipped)."""
    routers = find_routers(model)
    outputs = {}  # layer -> the router's (logits, gate weights, experts) in the latest forward
    hooks = [
        r.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
        for i, r in enumerate(routers)
    ]
    n_experts = routers[0].num_experts
    prob_sums = torch.zeros(len(routers), n_experts, dtype=torch.float64)  # float64: many tokens
    usage = torch.zeros(len(routers), n_experts, dtype=torch.int64)
    n_tokens, was_training = 0, model.training
    model.eval()
    for batch in data:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        keep = batch["attention_mask"].reshape(-1).bool()  # router rows are batch * seq tokens
        for i, (logits, _, experts) in outputs.items():
            prob_sums[i] += F.softmax(logits, dim=-1, dtype=torch.float)[keep].sum(0).double()
            usage[i] += torch.bincount(experts[keep].reshape(-1), minlength=n_experts)
        n_tokens += int(keep.sum())
    for hook in hooks:
        hook.remove()
    model.train(was_training)
    weights, mean_probs = [r.weight.detach().float().clone() for r in routers], prob_sums / n_tokens
    return {"base_weights": weights, "mean_probs": mean_probs.float(), "usage": usage}


def route(router, logits, bias):
    """The router's own gate weights, at the experts chosen by the top-k of logits + bias."""
    # Ranked on logits + bias, not on softmax(logits + bias): a large bias would saturate the
    # softmax into ties. Without a bias both rank alike, and this is the router's own forward.
    experts = torch.topk(logits.float() + bias, router.top_k, dim=-1)[1]
    weights = F.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), experts  # what the MoE block expects of its gate


def rpb_hook(layer, prior, strength, marginal, router, args, output):
    """Forward hook on one router: replace its routing with RPB's."""
    if marginal:  # rpb_marginal: a training-time device, the model routes natively in eval
        if not router.training:
            return None
        bias = strength * torch.log(prior["mean_probs"][layer].clamp_min(1e-9))
    else:  # rpb: the base router's logits on the same hidden state, a fixed target (no grad)
        with torch.no_grad():
            hidden = args[0].reshape(-1, router.weight.shape[-1])
            bias = strength * F.linear(hidden, prior["base_weights"][layer].to(hidden)).float()
    return route(router, output[0], bias)


def attach_rpb(model, prior, strength: float = 1.0, marginal: bool = False) -> list:
    """RPB's hooks on every router; `hook.remove()` on each returns the model to native routing."""
    return [
        router.register_forward_hook(partial(rpb_hook, layer, prior, strength, marginal))
        for layer, router in enumerate(find_routers(model))
    ]


def train(model, prior, data, *, strength=1.0, marginal=False, lr=1e-2, log=None):
    """Post-train `model` with RPB, one AdamW step per batch of `data`."""
    hooks = attach_rpb(model, prior, strength, marginal)
    model.config.output_router_logits = False  # no load-balancing loss of the model's own
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step, batch in enumerate(data):
        loss = model(**batch).loss  # the LM loss alone: RPB adds no router term
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if log:
            log(f"step {step + 1} loss={loss.item():.4f}")
    for hook in hooks:
        hook.remove()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="a Qwen3-MoE checkpoint directory (default: a tiny random one)")
    p.add_argument("--strength", type=float, default=1.0, help="λ, the bias's strength")
    p.add_argument("--marginal", action="store_true", help="bias by log π (rpb_marginal)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
        tiny |= dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
        tiny |= dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**tiny, norm_topk_prob=True))
    vocab = model.config.get_text_config().vocab_size
    prior = extract_prior(model, batches(4, vocab, seed=1))  # the base, before any training
    print(f"rpb on {len(prior['base_weights'])} routers; base usage share per layer:")
    print((prior["usage"] / prior["usage"].sum(-1, keepdim=True)).numpy().round(3))
    data = batches(args.steps, vocab, seed=2)
    train(model, prior, data, strength=args.strength, marginal=args.marginal, lr=args.lr, log=print)
