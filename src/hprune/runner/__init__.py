"""One module per verb: a function from the composed config to a metrics dict, wrapped in a Hydra app."""
from __future__ import annotations

import functools
import sys
from typing import Callable

import hydra
from omegaconf import DictConfig

from ..errors import UserError

CONFIG_PATH = "pkg://hprune_configs"


def hydra_app(config_name: str) -> Callable:
    """Turn `verb(cfg) -> dict` into the verb's Hydra entry point; bad input ends as one line and exit 2."""
    def decorate(verb: Callable[[DictConfig], dict]) -> Callable:
        @hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)
        @functools.wraps(verb)
        def main(cfg: DictConfig):
            try:
                return verb(cfg)
            except UserError as err:
                print(f"hprune {cfg.verb}: error: {err}", file=sys.stderr)
                sys.exit(2)
        return main
    return decorate
