"""`hprune data prepare data=...`: build the binarized data set into the cache (or find it there).
`hprune data fetch published=NAME`: download and unpack one of fairseq's published models.
`hprune data fetch hf=ORG/NAME`: download a Hugging Face Hub translation model (FSMT, Marian, M2M100/NLLB-200, mBART-50)."""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ..data.prepare import bind, prepare
from ..data.published import PUBLISHED, fetch_published
from ..errors import UserError
from ..hub import fetch_hub
from ..model_folder import HF_FAMILIES
from . import hydra_app

log = logging.getLogger(__name__)


def data(cfg: DictConfig) -> dict:
    if cfg.action == "fetch" and cfg.hf:
        folder = fetch_hub(cfg.hf, Path(cfg.paths.models_root), cfg.mirror, str(cfg.revision))
        print(f"{cfg.hf}: {folder}")
        return {"model_dir": str(folder)}
    if cfg.action == "fetch":
        if not cfg.published:
            raise UserError(f"hprune data fetch needs published=NAME, one of: {', '.join(PUBLISHED)}; or hf=ORG/NAME "
                            f"(a Hugging Face Hub model: {', '.join(f.model_class for f in HF_FAMILIES.values())})")
        folder = fetch_published(cfg.published, Path(cfg.paths.models_root), Path(cfg.paths.data_root) / "downloads",
                                 cfg.mirror)
        print(f"{cfg.published}: {folder}")
        return {"model_dir": str(folder)}
    if cfg.action != "prepare":
        raise UserError(f"unknown data action '{cfg.action}'; use `hprune data prepare` or `hprune data fetch`")
    bin_dir = prepare(bind(cfg.data), cfg.paths.data_root)
    print(f"{cfg.data.name}: {bin_dir}")
    return {"data_bin": str(bin_dir)}


main = hydra_app("data", writes_metrics=False)(data)
