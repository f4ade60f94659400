"""`hprune prune --method NAME ckpt=PATH`: one pruning method on one model (methods/: an order's curve, or a
procedure of its own). metrics.json is written last (by the verb wrapper): a run without it did not finish."""
from __future__ import annotations

import importlib.util

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..files import run_dir
from ..pruning.heads import check_layout
from ..rundir import RunDir
from . import hydra_app


def prune(cfg: DictConfig) -> dict:
    from ..methods import get_method
    from ..session import Session  # imports fairseq, which fills Hydra's config store: only once composed

    p = cfg.prune
    method = get_method(p.method, p.get("module"))
    method.validate(p)
    check_layout(p.layout, p.types)
    if cfg.latency.measure and importlib.util.find_spec("ctranslate2") is None:
        raise UserError("latency.measure=true needs the ctranslate2 package (latency is measured in it): pip install "
                        "'hprune[deploy]'")
    session, out = Session.open(cfg), run_dir()
    metrics = method.prune(session, cfg, out)
    if (cfg.latency.measure or p.get("latency_budget") is not None) and RunDir(out).head_mask.exists():
        if "latency_pct_measured" not in metrics:  # (a latency budget's search measured its own mask)
            metrics.update(latency_of(session, cfg, session.read_mask(RunDir(out).head_mask)))
        metrics["latency_settings"] = {k: v for k, v in OmegaConf.to_container(cfg.latency).items() if k != "measure"}
        if "latency_pct_predicted" in metrics:  # how far a latency table's prediction held
            metrics["latency_prediction_ratio"] = round(metrics["latency_pct_predicted"]
                                                        / metrics["latency_pct_measured"], 4)
    return metrics


def latency_of(session, cfg: DictConfig, mask: dict) -> dict:
    """The pruned model's latency in CTranslate2 against the unpruned model's (deploy/latency.py), as metrics."""
    from ..deploy.latency import LatencySettings, latency_metrics

    settings = LatencySettings(**cfg.latency)
    seconds = session.latency(mask, settings)
    metrics = latency_metrics(seconds["pruned"] / seconds["unpruned"])
    print(f"latency in CTranslate2 ({settings.compute_type}, {settings.threads} thread(s), beam {settings.beam}): "
          f"{metrics['latency_pct_measured']:g} % of the unpruned model's ({1 / seconds['pruned']:.1f} against "
          f"{1 / seconds['unpruned']:.1f} sentences/s)")
    return metrics


main = hydra_app("prune")(prune)
