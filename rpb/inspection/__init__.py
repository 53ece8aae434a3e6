"""`rpb inspect`: how far a fine-tune's routing moved from its base, and how much of its change
(its forgetting, on held-out domains) its routers carry, for any MoE checkpoint pair rpb routes.

    rpb inspect --base DIR --tuned DIR --data FILE.jsonl [--eval FILE.jsonl ...] --out DIR

1. **Routing drift** over `--data` (rpb.coactivation's metrics, measured as the pipeline's
   analysis measures them): per MoE layer, the top-k overlap of the tuned model's selection with
   the base router's on the tuned model's own hidden states and KL(base || tuned) of the two
   routing distributions there (so a layer whose router did not move reads overlap 1, KL 0,
   whatever moved before it); the relative change of the router weight; each model's expert
   usage over its own forward (normalised entropy, dead experts: never selected, overloaded
   experts: more than twice the uniform share of selections); and, with the `analysis` extra,
   the co-activation communities' NMI and ARI between base and tuned.
2. **Change priced by part** with `--eval` files (prompt/completion JSONL, one per domain): every
   cell of rpb.router_swap's factorial (base, tuned and the models that take some parts from
   each: routers / routed experts / trunk, or routers against the rest with `--parts routers`)
   scores each domain as the pipeline's evaluation does: the mean per-token log-likelihood of
   completion + EOS given the prompt (`ll_per_token`, nats), p(target) = exp(its sum) (percent)
   and exact match (percent: the completion and EOS are the greedy continuation under teacher
   forcing). `rpb.router_swap.decompose` splits each base-to-tuned change into main effects,
   interactions, Shapley values (adding up to the total) and put-back shares. A tuned model that
   keeps a method's routing at evaluation (`rpb finetune --method rpb` keeps its bias) is
   measured and scored as it is evaluated, and that routing goes with its routers: the cells
   that take the tuned routers route with it, those with the base's routers without it.
3. **Output** in `--out`: inspect.json (every number, the inputs' sha256 and rpb's version),
   inspect.md and inspect.html, a page with its plots drawn as inline SVG.

Memory: one model on the device at a time; the swapped cells are assembled on the CPU (the base
loaded there with the tuned model's parts copied in, from a CPU copy of the tuned model) and
moved to the device to be scored. The plots are SVG written here rather than matplotlib figures:
matplotlib is the pipeline extra's, not the library's, and a page with inline SVG is one file
that opens anywhere.

Torch and transformers are imported inside the functions that need them: building the parser
costs nothing.
"""

from rpb.inspection.command import add_inspect, cmd_inspect
from rpb.inspection.measure import (
    FORMAT,
    OUT_FILES,
    batches_of,
    community_rows,
    inspect_models,
    load_checkpoint,
    mean_row,
    read_jsonl,
    score_examples,
    tokenize,
)
from rpb.inspection.outputs import markdown, page, write_outputs

__all__ = [
    "FORMAT",
    "OUT_FILES",
    "add_inspect",
    "batches_of",
    "cmd_inspect",
    "community_rows",
    "inspect_models",
    "load_checkpoint",
    "markdown",
    "mean_row",
    "page",
    "read_jsonl",
    "score_examples",
    "tokenize",
    "write_outputs",
]
