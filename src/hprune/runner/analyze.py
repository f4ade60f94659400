"""`hprune analyze ckpt=PATH`: what each head does, on a split read with teacher forcing (head_analysis.py),
through the library's Model.analyze."""
from __future__ import annotations

from omegaconf import DictConfig

from ..rundir import run_dir
from . import hydra_app


def analyze(cfg: DictConfig) -> dict:
    from ..api import Model
    from ..head_analysis import check_settings

    check_settings(cfg)  # bad settings refused before the model is opened
    return Model.from_config(cfg).analyze(run_dir(), cfg=cfg)


main = hydra_app("analyze")(analyze)
