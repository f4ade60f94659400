"""`hprune prune --method NAME ckpt=PATH`: one pruning method on one model (methods/: an order's curve, or a
procedure of its own). metrics.json is written last (by the verb wrapper): a run without it did not finish."""
from __future__ import annotations

from omegaconf import DictConfig

from ..files import run_dir
from ..pruning.heads import check_layout
from . import hydra_app


def prune(cfg: DictConfig) -> dict:
    from ..methods import get_method
    from ..session import Session  # imports fairseq, which fills Hydra's config store: only once composed

    p = cfg.prune
    method = get_method(p.method, p.get("module"))
    method.validate(p)
    check_layout(p.layout, p.types)
    return method.prune(Session.open(cfg), cfg, run_dir())


main = hydra_app("prune")(prune)
