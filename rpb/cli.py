"""`rpb` and `python -m rpb.cli`: the command's entry point.

The people's verbs (`rpb finetune`, `rpb prior`, `rpb inspect`) are the library's (rpb.user_cli)
and run without the pipeline; every other verb (`rpb pipeline <job>`, `check-config`,
`relayout`, `--help`) is the pipeline's command line (rpb.pipeline.cli, which lists the people's
verbs too), loaded by name only then, so that the library imports nothing of the pipeline.

An entry point, not part of the library: configs name it in their training launcher
(config/paper.yaml's workflow/scripts/accelerate_launch.sh runs `accelerate launch ... -m
rpb.cli`), and the launcher is one
of every training job's parameters, so a new spelling would make Snakemake rerun every finished
post-training run of an existing results folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence

from rpb import user_cli

PIPELINE = "rpb.pipeline"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `rpb` command (`argv`, else the process's arguments); its exit status."""
    words = sys.argv[1:] if argv is None else list(argv)
    verb = next((w for w in words if not w.startswith("-")), None)
    if verb in user_cli.VERBS or importlib.util.find_spec(PIPELINE) is None:
        return user_cli.main(argv)
    return importlib.import_module(f"{PIPELINE}.cli").main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
