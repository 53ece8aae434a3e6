"""The `rpb inspect` command line (registered with the people's verbs, rpb.user_cli)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rpb.inspection.measure import DTYPES, OUT_FILES, inspect_models
from rpb.router_swap import PARTS, factors

log = logging.getLogger(__name__)

# --parts spellings: "experts" is short for the routed experts.
PART_ALIASES = {"experts": "routed_experts"}


def parse_parts(text: str) -> tuple[str, ...]:
    """`--parts`: a comma-separated list of routers, experts (routed_experts) and trunk."""
    names = [PART_ALIASES.get(p.strip(), p.strip()) for p in text.split(",") if p.strip()]
    try:
        factors(names)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct names among routers, experts, trunk"
        ) from None
    return tuple(p for p in PARTS if p in names)


# --- the command line -------------------------------------------------------------------------

EPILOG = """\
example:
  rpb inspect --base ./Qwen3-30B-A3B --tuned ./qwen3-sft --data probe.jsonl \\
      --eval math.jsonl --eval code.jsonl --out ./inspect

--data: {"text": ...} or {"prompt": ..., "completion": ...} lines, the texts routing drift is
measured on. --eval: {"prompt": ..., "completion": ...} lines, one file per domain; each is
scored on base, tuned and every swap cell, and the change split by part. OUT receives
inspect.json, inspect.md and inspect.html (docs/library.md, "Inspecting a fine-tune").
"""


def add_inspect(sub: Any) -> argparse.ArgumentParser:
    """Register `rpb inspect` on the `rpb` subparsers `sub`; return its parser."""
    p = sub.add_parser(
        "inspect",
        help="how far a fine-tune's routing moved from its base, and what each part carries",
        description="Routing drift of a fine-tuned MoE checkpoint against its base over a JSONL\n"
        "file, and with --eval its change per domain split by part (routers, routed experts,\n"
        "trunk) by the factorial part swap; writes inspect.json, inspect.md and inspect.html.",
        epilog=EPILOG,
        # Each default is in its flag's help (%(default)s), so the plain formatter serves.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=cmd_inspect)
    p.add_argument("--base", type=Path, required=True, metavar="DIR", help="the base checkpoint")
    p.add_argument(
        "--tuned", type=Path, required=True, metavar="DIR", help="its fine-tuned checkpoint"
    )
    p.add_argument(
        "--data", type=Path, required=True, metavar="FILE", help="JSONL texts to measure drift on"
    )
    p.add_argument(
        "--eval",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="prompt/completion JSONL of one domain (repeatable)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the outputs")
    p.add_argument(
        "--parts",
        type=parse_parts,
        default="routers,experts,trunk",
        metavar="LIST",
        help="the factors of the swap: routers (against the rest) or routers,experts,trunk "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--device", default="auto", help="torch device (default: %(default)s, cuda if available)"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="(default: %(default)s, as saved)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="examples per forward (default: %(default)s)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=1024,
        metavar="N",
        help="tokens per example, the last kept (default: %(default)s)",
    )
    return p


def cmd_inspect(args: argparse.Namespace) -> None:
    """`rpb inspect`: inspect_models with the flags."""
    for flag in ("batch_size", "max_length"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    flags = ("parts", "device", "dtype", "batch_size", "max_length")
    settings = {flag: getattr(args, flag) for flag in flags}
    inspect_models(args.base, args.tuned, args.data, args.out, evals=args.eval, **settings)
    log.info("rpb inspect: wrote %s in %s", ", ".join(OUT_FILES), args.out)
