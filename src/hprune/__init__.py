"""hprune: attention-head pruning experiments on fairseq Transformer translation models.

As a library: `hprune.open(ckpt, **settings)` opens a model as the CLI's verbs do (hprune.api, docs/api.md);
`hprune.HeadMask` is a head mask to build, combine and save. Loaded at first use, so that `import hprune` (and
the CLI's start) stays light."""
__version__ = "0.1.0"
__all__ = ["open", "Model", "HeadMask", "HeadScores", "Translation", "Pruned"]


def __getattr__(name: str):
    if name == "HeadMask":
        from .pruning.heads import HeadMask

        return HeadMask
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'hprune' has no attribute '{name}'")
