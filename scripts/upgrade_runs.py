"""Add what `hprune report` now reads to prune runs made before it was recorded: the control fields of the
methods that train (control_key, is_control, control_label; methods/__init__.py: Control), computed from each
run's own .hydra/config.yaml and metrics.json exactly as the prune verb computes them now.

    python scripts/upgrade_runs.py outputs/study        # every run under the folder; prints what it changed
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from hprune.files import write_json
from hprune.methods import get_method


def upgrade(root: Path) -> int:
    changed = 0
    for config_file in sorted(root.rglob(".hydra/config.yaml")):
        run = config_file.parent.parent
        metrics_file = run / "metrics.json"
        cfg = OmegaConf.load(config_file)
        if cfg.get("verb") != "prune" or not metrics_file.is_file():
            continue
        metrics = json.loads(metrics_file.read_text())
        if "control_key" in metrics:
            continue
        method = get_method(cfg.prune.method, cfg.prune.get("module"))
        if method.control is None:
            continue
        metrics.update(method.control.fields(cfg, metrics))
        write_json(metrics_file, metrics)
        print(f"{run}: {method.name}, control_key {metrics['control_key']}, is_control {metrics['is_control']}")
        changed += 1
    return changed


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/upgrade_runs.py DIR [DIR ...]")
    print(f"{sum(upgrade(Path(folder)) for folder in sys.argv[1:])} runs upgraded")
