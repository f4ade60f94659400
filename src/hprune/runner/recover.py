"""`hprune recover ckpt=MODEL mask=RUN_OR_MASK recovery.loss=ce|word|sequence recovery.updates=N`: the model pruned
by a mask trained on, the unpruned model its teacher (recovery.py), through the library's Model.recover."""
from __future__ import annotations

from omegaconf import DictConfig

from ..rundir import run_dir
from . import hydra_app


def recover(cfg: DictConfig) -> dict:
    from ..api import Model
    from ..recovery import check

    check(cfg.recovery)  # bad settings refused before the model is opened
    model = Model.from_config(cfg)
    return model.recover(run_dir(), cfg.mask, cfg=cfg)


main = hydra_app("recover")(recover)
