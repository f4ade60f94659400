"""`hprune export ckpt=PATH [mask=head_mask.json] format=ctranslate2|fairseq`: the model, with the masked heads
physically removed, in a runtime's format (deploy/: one exporter per format, which checks, writes, verifies and
measures it). An export that computes otherwise than the masked model is one line, nothing written."""
from __future__ import annotations

from omegaconf import DictConfig

from ..deploy import get_exporter
from ..files import run_dir
from ..pruning.heads import kept_columns
from . import hydra_app


def export(cfg: DictConfig) -> dict:
    from ..evaluation import Evaluator
    from ..session import Session  # imports fairseq, which fills Hydra's config store: only once composed

    exporter = get_exporter(cfg.format, cfg.get("format_module"))
    if exporter.check is not None:
        exporter.check(cfg)
    session = Session.open(cfg)
    mask = session.fold_mechanisms(session.read_mask(cfg.mask) if cfg.mask else None) or session.unpruned_mask()
    metrics = {"format": cfg.format, "mask": cfg.mask, **kept_columns(mask), **session.provenance()}
    metrics.update(exporter.export(Evaluator.of(session, cfg), mask, run_dir(), cfg))
    return metrics


main = hydra_app("export")(export)
