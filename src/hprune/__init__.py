"""hprune: attention-head pruning experiments on fairseq Transformer translation models."""
__version__ = "0.1.0"
