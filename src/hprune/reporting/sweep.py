"""One table per multirun sweep: every job's overrides and headline metrics, written next to the jobs.

Hydra calls `SweepTable.on_multirun_end` in the launching process once every job has returned (with any
launcher: basic, joblib, submitit), so `hprune prune --method <a trained method> -m prune.<its knob>=a,b,c` ends
with sweep.csv / sweep.md in the sweep dir, one row per value. A job without metrics.json (failed, killed, still
running elsewhere) is listed as incomplete, never silently dropped.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, List, Tuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..files import write_atomic
from ..rundir import RunDir

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)
# headline metrics, in this order, where a verb writes them; a method adds the knobs and columns it declares
# (metrics.json's report_knobs after `method`, report_sweep_columns after `delta_bleu`: methods/__init__.py)
METRIC_COLUMNS = ("method", "kept_heads", "kept_enc_self", "kept_dec_self", "kept_dec_enc", "pct_pruned", "bleu",
                  "delta_bleu", "chrf", "valid_loss")


def metric_columns(rows: List[dict]) -> List[str]:
    """METRIC_COLUMNS with the methods' own: their knobs that no override of the sweep already shows, after
    `method`; their sweep columns after `delta_bleu`."""
    knobs, extra = {}, {}
    for row in rows:
        knobs.update(dict.fromkeys(k for k in row.get("report_knobs") or [] if f"prune.{k}" not in row))
        extra.update(dict.fromkeys(row.get("report_sweep_columns") or []))
    columns = list(METRIC_COLUMNS)
    columns[1:1] = list(knobs)
    at = columns.index("delta_bleu") + 1
    columns[at:at] = list(extra)
    return columns


def sweep_rows(sweep_dir: Path) -> Tuple[pd.DataFrame, List[str], List[str]]:
    """(one row per finished job: its overrides, then its headline metrics; the incomplete jobs' dirs; the
    headline metric columns)."""
    import pandas as pd  # here, not at import: Hydra builds this callback at the start of every run
    jobs, incomplete = [], []
    for job in sorted((p for p in Path(sweep_dir).iterdir() if (p / ".hydra").is_dir()),
                      key=lambda p: (len(p.name), p.name)):
        overrides = RunDir(job).overrides()
        metrics = RunDir(job).metrics()
        if metrics is None:
            incomplete.append(job.name)
            continue
        row = {"job": job.name}
        row.update(dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o))
        jobs.append((row, metrics))
    columns = metric_columns([{**row, **metrics} for row, metrics in jobs])
    rows = [{**row, **{k: metrics[k] for k in columns if k in metrics}} for row, metrics in jobs]
    return pd.DataFrame(rows), incomplete, columns


def write_table(sweep_dir: Path) -> pd.DataFrame:
    from .tables import markdown

    table, incomplete, metric_columns_ = sweep_rows(sweep_dir)
    if not table.empty:
        constant = [c for c in table.columns if c != "job" and table[c].astype(str).nunique() == 1
                    and c not in metric_columns_]
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
