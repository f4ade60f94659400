"""`hprune prune --method NAME ckpt=PATH`: one pruning method on one model (methods/: an order's curve, or a
procedure of its own), through the library's Model.prune. metrics.json is written last (by the verb wrapper): a
run without it did not finish."""
from __future__ import annotations

from omegaconf import DictConfig

from ..rundir import run_dir
from . import hydra_app


def prune(cfg: DictConfig) -> dict:
    from ..api import Model, checked_method

    checked_method(cfg)  # bad settings refused before the model is opened
    return Model.from_config(cfg).prune(cfg.prune.method, run_dir(), cfg=cfg).metrics


main = hydra_app("prune")(prune)
