"""Which CPU numeric path to pin: each candidate's speed on table 1's own training step, whether it
gives the same bytes run after run, and a fingerprint per operation for comparing CPU models.

ATen reads ATEN_CPU_CAPABILITY and MKL reads MKL_CBWR once, before their first kernel, so every
candidate path (`CANDIDATES`: name -> environment and oneDNN) runs in fresh processes, one at a
time, always on one thread (OMP_NUM_THREADS=MKL_NUM_THREADS=1, torch.set_num_threads(1)). The
candidates are interleaved in rounds: round r starts one child per candidate, which measures

(a) table 1's training step: the committed base `bases/tinyA/base0/model`, trainable `moe` as
    post-training selects it (`rpb.trainable.select_trainable`: routers, routed experts and the
    rows of the tokens the base never saw, row-scaled as `UpdateScaleCallback` does), batch
    64 x 48 random token ids (labels = ids, a fixed torch.Generator), AdamW lr 3e-4, gradients
    clipped at 1.0 as the Trainer does; `--warmup` steps, then `--steps` timed steps
    (time.perf_counter), and the sha256 of every parameter after them (the train digest);
(b) the kernel probe of earlier records (40 AdamW steps of tiny random qwen3_moe and deepseek_v3,
    `rpb.architectures.random_model`): records of other CPUs are keyed by these prints;
(c) a fingerprint per operation of a training step at table 1's shapes (`op_prints`: the
    linears of router, experts, attention and head, grouped_mm of the experts, causal
    scaled_dot_product_attention, softmax, sigmoid, SiLU, RMSNorm, the routing's topk / scatter /
    gather / index_add_, embedding, cross-entropy, one AdamW step; outputs and gradients), so the
    next CPU model names the operation that diverges.

A candidate is repeatable when every round gives the same train digest (and probe and op prints).
Prints one line per candidate per round as it goes and writes
bench/results/numeric_path_<cpu slug>_v2.json (the earlier format, numeric_path_<slug>.json, is
kept as it was), with the operations whose fingerprints split the candidates
(`ops_differing_between_candidates`). Two records (e.g. an Intel and an AMD one) are compared
per candidate and per operation with `--compare`:

    python bench/numeric_path.py [--rounds 3] [--warmup 3] [--steps 25] [--candidates a,b]
    python bench/numeric_path.py --compare bench/results/numeric_path_X_v2.json OTHER.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from any folder

from rpb.numerics import KERNEL_ENV, PATHS, cpu_model  # noqa: E402  (torch-free)

# The candidate paths: name -> (variables set at the process's start, oneDNN on). A variable not
# named is removed from the child's environment. `compatible` and `native` are the pipeline's own
# paths (rpb.numerics.PATHS, oneDNN off), the others the alternatives measured against them.
CANDIDATES: dict[str, tuple[dict[str, str], bool]] = {
    "compatible": (dict(PATHS["compatible"].env), False),
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}, False),
    "native": (dict(PATHS["native"].env), False),
    "native_auto": ({"MKL_CBWR": "AUTO"}, False),
    "native_onednn": ({}, True),
}
PATH_VARS = KERNEL_ENV
BASE = ROOT / "bases" / "tinyA" / "base0" / "model"
# Table 1's shapes (config/config.yaml models.tinyA.architecture, posttrain batch and length).
TABLE1_SHAPES = {
    "batch": 64,
    "seq": 48,
    "hidden": 64,
    "dense_hidden": 256,
    "expert_hidden": 128,
    "experts": 16,
    "top_k": 2,
    "heads": 4,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "vocab": 124,
}


def digest(tensor: Any) -> str:
    """First 12 hex of the sha256 of a tensor's bytes (contiguous, on the CPU)."""
    return hashlib.sha256(tensor.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:12]


def op_prints(shapes: dict[str, int] | None = None, seed: int = 0) -> dict[str, str]:
    """A fingerprint (`digest`) of each operation of a training step, from fixed inputs at
    `shapes` (table 1's by default): op name -> digest, `<op>.grad_<input>` for its gradients
    under a fixed upstream gradient. An operation this torch cannot run reads "error: ..."."""
    import torch
    import torch.nn.functional as F

    s = {**TABLE1_SHAPES, **(shapes or {})}
    g = torch.Generator().manual_seed(seed)
    tokens, h = s["batch"] * s["seq"], s["hidden"]
    out: dict[str, str] = {}

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * scale).requires_grad_(True)

    def record(name: str, fn, *inputs: torch.Tensor, grads: tuple[str, ...] = ()) -> Any:
        try:
            y = fn(*inputs)
        except RuntimeError as err:  # an op this build lacks: named, not fatal
            out[name] = f"error: {str(err).splitlines()[0][:80]}"
            return None
        out[name] = digest(y)
        if grads and y.requires_grad:
            upstream = torch.randn(y.shape, generator=g)
            got = torch.autograd.grad(y, inputs, upstream)
            for label, grad in zip(grads, got, strict=True):
                out[f"{name}.grad_{label}"] = digest(grad)
        return y

    x = randn(tokens, h)
    linears = {
        "router": s["experts"],
        "expert_up": 2 * s["expert_hidden"],  # gate and up fused, as transformers' experts hold
        "q_proj": s["heads"] * s["qk_head_dim"],
        "kv_a_proj": s["kv_lora_rank"] + s["qk_rope_head_dim"],
        "o_proj": h,
        "dense_up": s["dense_hidden"],
        "lm_head": s["vocab"],
    }
    for name, n_out in linears.items():
        w = randn(n_out, h, scale=h**-0.5)
        record(f"linear_{name}", F.linear, x, w, grads=("x", "w"))
    hidden = randn(tokens, s["expert_hidden"])
    record("linear_expert_down", F.linear, hidden, randn(h, s["expert_hidden"]), grads=("x", "w"))
    latent = randn(tokens, s["kv_lora_rank"])
    n_kv = s["heads"] * (s["qk_head_dim"] - s["qk_rope_head_dim"] + s["v_head_dim"])
    record("linear_kv_b_proj", F.linear, latent, randn(n_kv, s["kv_lora_rank"]), grads=("x", "w"))
    record("matmul_router", torch.matmul, x, randn(h, s["experts"]), grads=("x", "w"))

    # The experts' grouped matmul (transformers' default experts kernel on CPU), tokens sorted.
    e, k = s["experts"], s["top_k"]
    per = torch.full((e,), tokens * k // e, dtype=torch.int32)
    per[-1] += tokens * k - int(per.sum())
    offs = torch.cumsum(per, 0).to(torch.int32)
    routed = randn(tokens * k, h)
    w_up = randn(e, 2 * s["expert_hidden"], h, scale=h**-0.5)
    record(
        "grouped_mm_experts",
        lambda a, b: F.grouped_mm(a, b.transpose(-2, -1), offs=offs),
        routed,
        w_up,
        grads=("x", "w"),
    )
    record(
        "bmm_experts", torch.bmm, randn(e, 64, h), randn(e, h, s["expert_hidden"]), grads=("a", "b")
    )

    q = randn(s["batch"], s["heads"], s["seq"], s["qk_head_dim"])
    kk = randn(s["batch"], s["heads"], s["seq"], s["qk_head_dim"])
    v = randn(s["batch"], s["heads"], s["seq"], s["v_head_dim"])
    record(
        "sdpa_causal",
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
        q,
        kk,
        v,
        grads=("q", "k", "v"),
    )
    logits = randn(tokens, e)
    record("softmax", lambda a: torch.softmax(a, dim=-1), logits, grads=("x",))
    scores = record("sigmoid", torch.sigmoid, logits, grads=("x",))
    record("silu", F.silu, randn(tokens, s["expert_hidden"]), grads=("x",))
    record(
        "silu_mul",
        lambda a, b: F.silu(a) * b,
        randn(tokens, 128),
        randn(tokens, 128),
        grads=("a", "b"),
    )

    def rms_norm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # DeepseekV3RMSNorm
        variance = a.pow(2).mean(-1, keepdim=True)
        return w * (a * torch.rsqrt(variance + 1e-6))

    record("rms_norm", rms_norm, x, randn(h), grads=("x", "w"))

    with torch.no_grad():
        values, indices = torch.topk(scores.detach(), k, dim=-1, sorted=False)
    out["topk.values"], out["topk.indices"] = digest(values), digest(indices)
    record(
        "gather", lambda a: a.gather(1, indices), scores.detach().requires_grad_(True), grads=("x",)
    )
    record(
        "scatter",
        lambda a: torch.zeros(tokens, e).scatter(1, indices, a),
        values.clone().requires_grad_(True),
        grads=("src",),
    )
    token_idx = torch.randint(0, tokens, (tokens * k,), generator=g)
    record(
        "index_add",
        lambda a: torch.zeros(tokens, h).index_add(0, token_idx, a),
        routed,
        grads=("src",),
    )
    table = randn(s["vocab"], h)
    ids = torch.randint(0, s["vocab"], (tokens,), generator=g)
    record("embedding", lambda w: F.embedding(ids, w), table, grads=("w",))
    head_logits = randn(tokens, s["vocab"])
    record("cross_entropy", lambda a: F.cross_entropy(a, ids), head_logits, grads=("logits",))

    param = torch.nn.Parameter(torch.randn(e, 2 * s["expert_hidden"], h, generator=g))
    param.grad = torch.randn(param.shape, generator=g)
    optimizer = torch.optim.AdamW([param], lr=3e-4)
    optimizer.step()
    out["adamw_step"] = digest(param)
    out["adamw_step.exp_avg_sq"] = digest(optimizer.state[param]["exp_avg_sq"])
    return out


def probe_prints() -> dict[str, str]:
    """The kernel probe of the earlier records: 40 AdamW steps of tiny random qwen3_moe and
    deepseek_v3 (lr 3e-3, batch 16 x 24), the sha256 of the final parameters (16 hex)."""
    import torch

    from rpb.architectures import random_model

    prints = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        torch.manual_seed(0)
        model = random_model(family, vocab_size=128, pad_token_id=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = torch.Generator().manual_seed(1)
        for _ in range(40):
            ids = torch.randint(3, 128, (16, 24), generator=data)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        sha = hashlib.sha256()
        for parameter in model.parameters():
            sha.update(parameter.detach().numpy().tobytes())
        prints[family] = sha.hexdigest()[:16]
    return prints


def table1_step(warmup: int, steps: int) -> dict[str, Any]:
    """Table 1's training step on the committed base (module docstring, (a)): seconds per timed
    step and the sha256 of every parameter after warmup + steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rpb.pipeline.data import DOMAIN_TOKENS, PRETRAIN_DOMAINS, SPECIAL_TOKENS
    from rpb.trainable import UpdateScaleCallback, select_trainable

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    model.train()
    # The tokens the base never saw in pretraining (rpb.pipeline.training.unseen_token_ids, here
    # every such token of the vocabulary, since the batch is random ids).
    seen = {t for d in PRETRAIN_DOMAINS for t in DOMAIN_TOKENS[d]} | set(SPECIAL_TOKENS)
    new_ids = sorted(i for t, i in tokenizer.get_vocab().items() if t not in seen)
    selection = select_trainable(model, "moe", new_token_ids=new_ids)
    rows = UpdateScaleCallback(model, selection.row_scales)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4)
    data = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batch, seq = TABLE1_SHAPES["batch"], TABLE1_SHAPES["seq"]

    def step() -> None:
        ids = torch.randint(3, vocab, (batch, seq), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        rows.on_pre_optimizer_step(None, None, None)
        optimizer.step()
        rows.on_optimizer_step(None, None, None)
        optimizer.zero_grad()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    sha = hashlib.sha256()
    for parameter in model.parameters():
        sha.update(parameter.detach().numpy().tobytes())
    return {"seconds_per_step": seconds, "train_digest": sha.hexdigest()[:16]}


def child(name: str, warmup: int, steps: int) -> dict[str, Any]:
    """One candidate's measurements, in a process started with its environment."""
    import torch

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = CANDIDATES[name][1]
    result = {"capability_in_use": torch.backends.cpu.get_cpu_capability()}
    result.update(table1_step(warmup, steps))
    result["probe_prints"] = probe_prints()
    result["op_prints"] = op_prints()
    return result


def child_env(name: str) -> dict[str, str]:
    """The environment a candidate's process starts with."""
    variables, _ = CANDIDATES[name]
    env = {k: v for k, v in os.environ.items() if k not in PATH_VARS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), **variables)
    return env


def run_candidate(name: str, warmup: int, steps: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", name, "--warmup", str(warmup)]
    out = subprocess.run(
        [*argv, "--steps", str(steps)],
        env=child_env(name),
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(f"candidate {name}: child failed\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(names: list[str], rounds: int, warmup: int, steps: int) -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    print(
        f"{'round':>5} {'candidate':<14} {'cap':<7} {'s/step':>7} {'train':<16} probe", flush=True
    )
    for r in range(rounds):
        for name in names:
            got = run_candidate(name, warmup, steps)
            runs[name].append(got)
            probe = "/".join(v[:12] for v in got["probe_prints"].values())
            print(
                f"{r:>5} {name:<14} {got['capability_in_use']:<7} "
                f"{got['seconds_per_step']:7.3f} {got['train_digest']:<16} {probe}",
                flush=True,
            )
    rows = []
    for name in names:
        got = runs[name]
        variables, onednn = CANDIDATES[name]

        def same(key: str, got: list[dict[str, Any]] = got) -> bool:
            return len({json.dumps(g[key], sort_keys=True) for g in got}) == 1

        per_round = [round(g["seconds_per_step"], 4) for g in got]
        rows.append(
            {
                "name": name,
                "env": {v: variables.get(v, "unset") for v in PATH_VARS},
                "onednn": onednn,
                "capability_in_use": got[0]["capability_in_use"],
                "seconds_per_step": per_round,
                "median": round(statistics.median(per_round), 4),
                "repeatable": same("train_digest") and same("probe_prints") and same("op_prints"),
                "train_digest": got[0]["train_digest"],
                "train_digests": [g["train_digest"] for g in got],
                "probe_repeatable": same("probe_prints"),
                "op_prints_repeatable": same("op_prints"),
                "probe_prints": got[0]["probe_prints"],
                "op_prints": got[0]["op_prints"],
            }
        )
    fastest = min(row["median"] for row in rows)
    for row in rows:
        row["ratio_to_fastest"] = round(row["median"] / fastest, 3)
    return rows


def op_groups(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The operations whose fingerprints differ between the candidates of one record, gathered
    by how they split the candidates: "a | b c" (a's bytes differ from b's and c's) -> ops."""
    groups: dict[str, list[str]] = {}
    for op in rows[0]["op_prints"] if rows else ():
        split: dict[str, list[str]] = {}
        for row in rows:
            split.setdefault(row["op_prints"].get(op, "missing"), []).append(row["name"])
        if len(split) > 1:
            groups.setdefault(" | ".join(" ".join(n) for n in split.values()), []).append(op)
    return groups


def compare(mine: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Lines naming, per candidate both records hold, the train digest, probe prints and
    operations whose fingerprints differ between them."""
    a = {row["name"]: row for row in mine.get("candidates", [])}
    b = {row["name"]: row for row in other.get("candidates", [])}
    lines = [f"A: {mine.get('cpu_model')} ({mine.get('date')})"]
    lines.append(f"B: {other.get('cpu_model')} ({other.get('date')})")
    for label, record in (("A", mine), ("B", other)):
        if "candidates" not in record:
            lines.append(f"{label} is an earlier record (no candidates, probe prints per setting)")
    for name in [n for n in a if n in b]:
        ra, rb = a[name], b[name]
        ops = sorted(
            k
            for k in ra["op_prints"].keys() | rb["op_prints"].keys()
            if ra["op_prints"].get(k) != rb["op_prints"].get(k)
        )
        probes = sorted(
            k for k in ra["probe_prints"] if ra["probe_prints"][k] != rb["probe_prints"].get(k)
        )
        train = "same" if ra["train_digest"] == rb["train_digest"] else "differs"
        probe = "differs: " + ", ".join(probes) if probes else "same"
        lines.append(
            f"{name}: train {train}; probe {probe}; "
            f"ops {'differ: ' + ', '.join(ops) if ops else 'all same'} "
            f"({len(ops)} of {len(ra['op_prints'])})"
        )
    for name in sorted(a.keys() ^ b.keys()):
        lines.append(f"{name}: only in {'A' if name in a else 'B'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated")
    parser.add_argument("--compare", nargs=2, metavar=("MINE.json", "OTHER.json"))
    parser.add_argument("--out", type=Path, help="the record's path (default: by CPU slug)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.warmup, args.steps)), flush=True)
        return
    if args.compare:
        records = [json.loads(Path(p).read_text()) for p in args.compare]
        print("\n".join(compare(*records)))
        return
    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        sys.exit(f"--candidates: {', '.join(unknown)} not in {', '.join(CANDIDATES)}")
    load_before = os.getloadavg()
    rows = measure(names, args.rounds, args.warmup, args.steps)
    load_after = os.getloadavg()
    print(f"{'candidate':<14} {'median':>7} {'ratio':>6} repeatable probe", flush=True)
    for row in rows:
        probe = "/".join(v[:12] for v in row["probe_prints"].values())
        print(
            f"{row['name']:<14} {row['median']:7.3f} {row['ratio_to_fastest']:6.3f} "
            f"{'yes' if row['repeatable'] else 'NO':<10} {probe}"
        )
    groups = op_groups(rows)
    print("ops that differ between candidates:" + ("" if groups else " none"))
    for split, ops in groups.items():
        print(f"  {split}: {', '.join(ops)}")
    import torch
    import transformers

    cpu = cpu_model()
    slug = hashlib.sha256(cpu.encode()).hexdigest()[:8]
    command = " ".join(["python bench/numeric_path.py", *sys.argv[1:]])
    record = {
        "cpu_model": cpu,
        "cpu_slug": slug,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "setup": {
            "rounds": args.rounds,
            "warmup": args.warmup,
            "steps": args.steps,
            "base": str(BASE.relative_to(ROOT)),
            "trainable": "moe",
            "lr": 3e-4,
            "shapes": TABLE1_SHAPES,
        },
        # The machine's 1/5/15-minute load before and after: other jobs share the cores.
        "load_average": {"before": load_before, "after": load_after},
        "candidates": rows,
        "ops_differing_between_candidates": groups,
    }
    out = args.out or ROOT / "bench" / "results" / f"numeric_path_{slug}_v2.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({cpu})")


if __name__ == "__main__":
    main()
