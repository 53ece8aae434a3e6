"""`python -m rpb.cli`: the `rpb` command, whose subcommands live in rpb.pipeline.cli.

An entry point, not part of the library: configs name it in their training launcher
(`train_launcher: accelerate launch ... -m rpb.cli`, config/paper.yaml), and the launcher is one
of every training job's parameters, so a new spelling would make Snakemake rerun every finished
post-training run of an existing results folder.
"""

from rpb.pipeline.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
