"""`hprune data prepare data=...`: build the binarized data set into the cache (or find it there)."""
from __future__ import annotations

import logging

from omegaconf import DictConfig

from ..data.prepare import prepare
from ..errors import UserError
from . import hydra_app

log = logging.getLogger(__name__)


def data(cfg: DictConfig) -> dict:
    if cfg.action != "prepare":
        raise UserError(f"unknown data action '{cfg.action}'; use `hprune data prepare`")
    bin_dir = prepare(cfg.data, cfg.paths.data_root)
    print(f"{cfg.data.name}: {bin_dir}")
    return {"data_bin": str(bin_dir)}


main = hydra_app("data", writes_metrics=False)(data)
