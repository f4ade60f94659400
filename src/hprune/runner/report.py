"""`hprune report DIR ...`: which heads matter, how many can go, and what it buys, over all runs under DIR.

Collects every finished run (reporting/collect.py), then writes into the run dir the method comparison at
matched sparsity, the λ table of gated runs, the MoA table, the runs table (each as CSV, Markdown, LaTeX),
the plots (BLEU vs % pruned per model, BLEU and heads kept vs λ, head heatmaps of importance, gates and masks,
expert load), report.md holding all of it, and incomplete.txt listing runs without results.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..files import run_dir, write_atomic
from ..reporting import plots, tables
from ..reporting.collect import Collection, collect
from . import hydra_app

TABLE_WRITERS = {"csv": lambda t: t.to_csv(index=False), "md": tables.markdown, "tex": tables.latex}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", str(text)).strip("_") or "run"


def _model_label(checkpoint: str) -> str:
    """outputs/demo/checkpoints/checkpoint_best.pt -> demo: the train run a checkpoint belongs to."""
    path = Path(str(checkpoint))
    return path.parent.parent.name if path.parent.name == "checkpoints" else path.stem


class Report:
    def __init__(self, cfg: DictConfig, out: Path):
        self.cfg, self.out, self.sections = cfg, out, []
        for fmt in cfg.formats:
            if fmt not in TABLE_WRITERS:
                raise UserError(f"unknown table format '{fmt}' in formats; choose from {', '.join(TABLE_WRITERS)}")
        self.plot_dir = out / "plots"
        self.plot_dir.mkdir(parents=True, exist_ok=True)

    def table(self, name: str, title: str, table: pd.DataFrame) -> None:
        if table.empty:
            return
        for fmt in self.cfg.formats:
            write_atomic(self.out / f"{name}.{fmt}", TABLE_WRITERS[fmt](table))
        self.sections.append(f"## {title}\n\n{tables.markdown(table)}")

    def figure(self, stem: str, title: str, draw) -> None:
        paths = [self.plot_dir / f"{stem}.{fmt}" for fmt in self.cfg.plot_formats]
        draw(paths)
        self.sections.append(f"![{title}](plots/{paths[0].name})\n")


def _comparison_plots(report: Report, collection: Collection, group_by: list[str]) -> None:
    points = tables.pruning_points(collection)
    if points.empty:
        return
    for key, group in points.groupby(tables.GROUP + group_by, dropna=False, sort=False):
        label = " ".join([_model_label(key[0]), f"({key[1]})", *map(str, key[2:])])
        unpruned = group["bleu_unpruned"].dropna()
        report.figure(f"bleu_vs_pruned_{_slug(label)}", f"BLEU vs heads pruned, {label}",
                      lambda paths: plots.bleu_curve(group, float(unpruned.iloc[0]) if len(unpruned) else float("nan"),
                                                     paths, f"BLEU vs heads pruned: {label}", by="method"))


def _lambda_plots(report: Report, lambdas: pd.DataFrame) -> None:
    if lambdas.empty or "l0_lambda" not in lambdas or lambdas["l0_lambda"].isna().all():
        return
    for types, group in lambdas.dropna(subset=["l0_lambda"]).groupby("types", sort=False):
        report.figure(f"lambda_{_slug(types)}", f"BLEU and heads kept vs λ ({types})",
                      lambda paths: plots.bleu_and_heads(group.astype({"l0_lambda": float}), "l0_lambda", paths,
                                                         f"Voita gates on {types}: BLEU and heads kept vs λ"))


def _mask_table(mask_file: Path) -> pd.DataFrame:
    mask = json.loads(mask_file.read_text())
    return pd.DataFrame([{"type": kind, "layer": layer, "head": head, "alive": alive}
                         for kind, rows in mask.items() for layer, row in enumerate(rows)
                         for head, alive in enumerate(row)])


def _run_heatmaps(report: Report, runs: pd.DataFrame) -> None:
    sources = [("head_importance.csv", "importance", "head importance", pd.read_csv),
               ("gates.csv", "gate", "deterministic gates", pd.read_csv),
               ("head_mask.json", "alive", "final head mask (1 = kept)", _mask_table),
               ("expert_load.csv", "share", "expert load (share of tokens)",
                lambda f: pd.read_csv(f).rename(columns={"expert": "head"}))]
    for run in runs.itertuples():
        for filename, value, title, read in sources:
            path = Path(run.path) / filename
            if path.exists():
                table = read(path)
                report.figure(f"{_slug(run.run)}_{value}", f"{title}: {run.run}",
                              lambda paths: plots.head_heatmaps(table, value, paths, f"{title}: {run.run}"))


def report_runs(cfg: DictConfig) -> dict:
    roots = OmegaConf.to_container(cfg.runs) if OmegaConf.is_list(cfg.runs) else [cfg.runs]
    group_by = list(cfg.group_by)
    collection = collect([Path(r) for r in roots])
    columns = list(cfg.columns) if cfg.columns else None
    runs = tables.runs_table(collection, columns, group_by)  # checks the columns first
    out = run_dir()
    report = Report(cfg, out)
    comparison = tables.comparison(collection, list(cfg.sparsity), group_by)
    if not comparison.empty:
        comparison.insert(0, "model", comparison.pop("checkpoint").map(_model_label))
    report.table("comparison", f"Pruning methods at matched sparsity ({', '.join(f'{s:g}' for s in cfg.sparsity)} "
                 "% of the pooled heads; BLEU interpolated between measured points, blank outside them)", comparison)
    _comparison_plots(report, collection, group_by)
    lambdas = tables.lambdas(collection)
    report.table("lambda", "Voita et al. gates: one row per λ", lambdas)
    _lambda_plots(report, lambdas)
    report.table("moa", "Mixture of attention heads: experts, cost and BLEU", tables.moa(collection))
    report.table("runs", "Runs", runs)
    _run_heatmaps(report, collection.runs[collection.runs["verb"].isin(["prune", "eval"])])
    incomplete = "".join(f"{run}: {why}\n" for run, why in collection.incomplete)
    write_atomic(out / "incomplete.txt", incomplete)
    if incomplete:
        report.sections.append("## Incomplete runs (no results)\n\n" + "".join(f"- {line}\n" for line in incomplete.splitlines()))
    write_atomic(out / "report.md", f"# hprune report: {', '.join(map(str, roots))}\n\n" + "\n".join(report.sections))
    print(tables.markdown(comparison) if not comparison.empty else tables.markdown(runs), end="")
    if collection.incomplete:
        print(f"incomplete runs ({len(collection.incomplete)}): " +
              "; ".join(f"{run} ({why})" for run, why in collection.incomplete))
    print(f"{len(collection.runs)} runs -> {out / 'report.md'}")
    return {"runs": len(collection.runs), "incomplete": len(collection.incomplete)}


main = hydra_app("report", writes_metrics=False)(report_runs)
