"""`hprune report DIR ...`: the report over every run under DIR (reporting/report.py builds it). Runs written
before their method declared what the report reads (its control and report fields) get them from the method's
registration, in memory: the runs themselves are left as they are."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..reporting.report import build
from ..rundir import run_dir
from . import hydra_app


def declared(config: dict, metrics: dict) -> dict:
    """What a prune run's method declares that its metrics.json lacks."""
    from ..methods import get_method

    if config.get("verb") != "prune" or not isinstance(config.get("prune"), dict):
        return {}
    try:
        method = get_method(config["prune"].get("method"), config["prune"].get("module"))
    except UserError:  # a method this installation does not have: the run as it is
        return {}
    found = {} if "report_knobs" in metrics else method.report.fields()
    if method.control is not None and "control_key" not in metrics:
        found.update(method.control.fields(OmegaConf.create(config), metrics))
    return found


def report_runs(cfg: DictConfig) -> dict:
    return build(cfg, run_dir(), declared)


main = hydra_app("report", writes_metrics=False)(report_runs)
