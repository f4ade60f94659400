"""One table per multirun sweep: every job's overrides and headline metrics, written next to the jobs.

Hydra calls `SweepTable.on_multirun_end` in the launching process once every job has returned (with any
launcher: basic, joblib, submitit), so `hprune prune --method voita -m prune.l0_lambda=0.01,0.03,0.1` ends
with sweep.csv / sweep.md in the sweep dir, one row per λ. A job without metrics.json (failed, killed, still
running elsewhere) is listed as incomplete, never silently dropped.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, List, Tuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..files import write_atomic
from .collect import read_overrides

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)
# headline metrics, in this order, where a verb writes them
METRIC_COLUMNS = ("method", "head_budget", "kept_heads", "kept_enc_self", "kept_dec_self", "kept_dec_enc",
                  "pct_pruned", "bleu", "delta_bleu", "bleu_finetuned", "bleu_scratch", "chrf", "valid_loss")


def sweep_rows(sweep_dir: Path) -> Tuple[pd.DataFrame, List[str]]:
    """(one row per finished job: its overrides, then its headline metrics; the incomplete jobs' dirs)."""
    import pandas as pd  # here, not at import: Hydra builds this callback at the start of every run
    rows, incomplete = [], []
    for job in sorted((p for p in Path(sweep_dir).iterdir() if (p / ".hydra").is_dir()),
                      key=lambda p: (len(p.name), p.name)):
        overrides = read_overrides(job)
        try:
            metrics = json.loads((job / "metrics.json").read_text())
        except (OSError, json.JSONDecodeError):
            incomplete.append(job.name)
            continue
        row = {"job": job.name}
        row.update(dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o))
        row.update({k: metrics[k] for k in METRIC_COLUMNS if k in metrics})
        rows.append(row)
    return pd.DataFrame(rows), incomplete


def write_table(sweep_dir: Path) -> pd.DataFrame:
    from .tables import markdown

    table, incomplete = sweep_rows(sweep_dir)
    if not table.empty:
        constant = [c for c in table.columns if c != "job" and table[c].astype(str).nunique() == 1
                    and c not in METRIC_COLUMNS]
        table = table.drop(columns=constant)  # overrides every job shares say nothing about the sweep
        write_atomic(sweep_dir / "sweep.csv", table.to_csv(index=False))
        write_atomic(sweep_dir / "sweep.md", markdown(table))
        print(f"sweep {sweep_dir}:\n{markdown(table)}", end="")
    if incomplete:
        print(f"incomplete jobs (no metrics.json): {', '.join(incomplete)}")
    return table


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            write_table(sweep_dir)
