"""`hprune export ckpt=PATH [mask=head_mask.json] format=ctranslate2|fairseq`: the model, with the masked heads
physically removed, in a runtime's format (deploy/: one exporter per format, which checks, writes, verifies and
measures it), through the library's Model.export. An export that computes otherwise than the masked model is one
line, nothing written."""
from __future__ import annotations

from omegaconf import DictConfig

from ..rundir import run_dir
from . import hydra_app


def export(cfg: DictConfig) -> dict:
    from ..api import Model, checked_exporter

    checked_exporter(cfg)  # bad settings refused before the model is opened
    model = Model.from_config(cfg)
    return model.export(run_dir(), model.session.read_mask(cfg.mask) if cfg.mask else None, cfg=cfg)


main = hydra_app("export")(export)
