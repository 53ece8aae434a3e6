"""A probe for tests/test_import_graph.py: a file that imports an experiment."""

from experiments.premise_screen import screen  # noqa: F401
