"""`hprune report DIR ...`: the report over every run under DIR (reporting/report.py builds it)."""
from __future__ import annotations

from omegaconf import DictConfig

from ..files import run_dir
from ..reporting.report import build
from . import hydra_app


def report_runs(cfg: DictConfig) -> dict:
    return build(cfg, run_dir())


main = hydra_app("report", writes_metrics=False)(report_runs)
