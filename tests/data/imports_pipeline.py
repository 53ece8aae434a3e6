"""A probe for tests/test_import_graph.py: an example-like script importing the pipeline."""

from rpb.pipeline.tokenizer import build_tokenizer  # noqa: F401
