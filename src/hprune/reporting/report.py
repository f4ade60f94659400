"""The report builder (`hprune report DIR ...`): which heads matter, how many can go, and what it buys, over all
runs under DIR.

Collects every finished run (collect.py), then writes into the report's dir the method comparison at matched
sparsity, the table of methods that train against their controls, the MoA table, the runs table (each as CSV,
Markdown, LaTeX), the plots (BLEU vs % pruned per model, BLEU and heads kept against each trained method's knob,
head heatmaps of importance, of the per-head tables methods declare and of masks, expert load, the attention
maps of analyzed sentences), report.md and report.html (one self-contained page) holding all of it, and
incomplete.txt listing runs without results. Pruned points are tested against their reference and against
each other with sacreBLEU's paired bootstrap where their translations were saved; runs that differ by seed only
are aggregated to mean and standard deviation. What a method adds is what it declared in its runs' metrics.json
(report_*: methods/__init__.py, Report): this package names no method.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from ..attention_types import ATTENTION_TYPES
from ..errors import UserError
from ..files import write_atomic
from ..rundir import CHECKPOINTS
from . import pages, plots, tables
from .collect import Collection, collect

TABLE_WRITERS = {"csv": lambda t: t.to_csv(index=False), "md": tables.markdown, "tex": tables.latex}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", str(text)).strip("_") or "run"


def _model_label(checkpoint: str) -> str:
    """outputs/demo/checkpoints/checkpoint_best.pt -> demo: the train run a checkpoint belongs to."""
    path = Path(str(checkpoint))
    return path.parent.parent.name if path.parent.name == CHECKPOINTS else path.stem  # <run>/checkpoints/<file>


class Report:
    """The report's sections, in order: tables, figures and lists, written as report.md and report.html."""

    def __init__(self, cfg: DictConfig, out: Path):
        self.cfg, self.out, self.sections = cfg, out, []
        for fmt in cfg.formats:
            if fmt not in TABLE_WRITERS:
                raise UserError(f"unknown table format '{fmt}' in formats; choose from {', '.join(TABLE_WRITERS)}")
        self.plot_dir = out / "plots"
        self.plot_dir.mkdir(parents=True, exist_ok=True)

    def table(self, name: str, title: str, table: pd.DataFrame, shown: pd.DataFrame | None = None) -> None:
        """table as CSV; `shown` (default: table), the version for reading, as Markdown, LaTeX and in the report."""
        if table.empty:
            return
        shown = table if shown is None else shown
        for fmt in self.cfg.formats:
            write_atomic(self.out / f"{name}.{fmt}", TABLE_WRITERS[fmt](table if fmt == "csv" else shown))
        self.sections.append(pages.Table(title, shown))

    def figure(self, stem: str, title: str, draw) -> None:
        paths = [self.plot_dir / f"{stem}.{fmt}" for fmt in self.cfg.plot_formats]
        draw(paths)
        self.sections.append(pages.Figure(title, next((p for p in paths if p.suffix in (".png", ".svg")), paths[0])))

    def items(self, title: str, lines: list[str]) -> None:
        self.sections.append(pages.Items(title, lines))

    def write(self, heading: str) -> None:
        write_atomic(self.out / "report.md", pages.markdown_page(heading, self.sections, self.out))
        write_atomic(self.out / "report.html", pages.html_page(heading, self.sections))


def _comparison_plots(report: Report, collection: Collection, group_by: list[str]) -> None:
    """BLEU vs % pruned per model and pool against each method's reference; per recipe over seeds too."""
    points = tables.pruning_points(collection)
    if points.empty:
        return
    for key, group in points.groupby(tables.GROUP + group_by, dropna=False, sort=False):
        label = " ".join([_model_label(key[0]), f"({key[1]})", *map(str, key[2:])])
        _curve_figure(report, group, f"bleu_vs_pruned_{_slug(label)}", label)
    seeded = points.dropna(subset=["recipe"])
    for key, group in seeded.groupby(["recipe", "types", *group_by], dropna=False, sort=False):
        if group["checkpoint"].nunique() > 1 or group["seed"].nunique() > 1:
            label = " ".join([_model_label(group["checkpoint"].iloc[0]), f"({key[1]})", *map(str, key[2:]),
                              f"over {max(group['checkpoint'].nunique(), group['seed'].nunique())} seeds"])
            _curve_figure(report, group, f"bleu_vs_pruned_{_slug(label)}", label)


def _curve_figure(report: Report, group: pd.DataFrame, stem: str, label: str) -> None:
    unpruned = group[group["reference"] == "unpruned"]["bleu_reference"].dropna()
    report.figure(stem, f"BLEU vs heads pruned, {label}",
                  lambda paths: plots.bleu_curve(group, float(unpruned.mean()) if len(unpruned) else float("nan"),
                                                 paths, f"BLEU vs heads pruned: {label}", by="method",
                                                 baseline_label="unpruned" + (" (mean)" if unpruned.nunique() > 1 else "")))


def _knob_plots(report: Report, trained: pd.DataFrame, runs: pd.DataFrame) -> None:
    """BLEU and heads kept against the first knob a trained method declares (e.g. a penalty's weight), where its
    runs vary it: one figure per method and pool, with the control and the start as references."""
    if trained.empty:
        return
    declared = runs.dropna(subset=["report_knobs"]) if "report_knobs" in runs else runs.iloc[0:0]
    for method, group in trained.groupby("method", sort=False):
        spec = declared[declared["method"] == method]
        knobs = spec["report_knobs"].iloc[0] if len(spec) else []
        knob = next((k for k in knobs if k in group and group[k].notna().sum() > 1), None)
        if knob is None:
            continue
        title = spec["report_title"].iloc[0] if "report_title" in spec and isinstance(spec["report_title"].iloc[0], str) \
            else method
        labels = runs.set_index("run")["control_label"] if "control_label" in runs else pd.Series(dtype=object)
        for types, points in group.dropna(subset=[knob]).groupby("types", sort=False):
            references = {}
            if "bleu_control" in points and points["bleu_control"].notna().any():
                label = labels.get(points["control_run"].dropna().iloc[0], None) if "control_run" in points else None
                references[label if isinstance(label, str) else "control"] = float(points["bleu_control"].astype(float).mean())
            start = points["bleu"] - points["delta_bleu"] if "delta_bleu" in points else pd.Series(dtype=float)
            if start.notna().any():
                references["start (before the extra training)"] = float(start.mean())
            report.figure(f"{_slug(method)}_{knob}_{_slug(types)}", f"BLEU and heads kept vs {knob} ({method}, {types})",
                          lambda paths: plots.bleu_and_heads(points.astype({knob: float}), knob, paths,
                                                             f"{title} on {types}: BLEU and heads kept vs {knob}",
                                                             references))


def _mask_table(mask_file: Path) -> pd.DataFrame:
    mask = json.loads(mask_file.read_text())
    return pd.DataFrame([{"type": attn_type, "layer": layer, "head": head, "alive": alive}
                         for attn_type, rows in mask.items() for layer, row in enumerate(rows)
                         for head, alive in enumerate(row)])


def _run_heatmaps(report: Report, runs: pd.DataFrame) -> None:
    """Per-head heatmaps of each run: its importance, the per-head tables its method declares (report_heatmaps),
    its final mask, the expert load."""
    common = [("head_importance.csv", "importance", "head importance", pd.read_csv),
              ("head_mask.json", "alive", "final head mask (1 = kept)", _mask_table),
              ("expert_load.csv", "share", "expert load (share of tokens)",
               lambda f: pd.read_csv(f).rename(columns={"expert": "head"}))]
    for run in runs.itertuples():
        declared = getattr(run, "report_heatmaps", None)
        own = [(name, column, title, pd.read_csv) for name, column, title in declared] \
            if isinstance(declared, (list, tuple)) else []
        for filename, value, title, read in [common[0], *own, *common[1:]]:
            path = Path(run.path) / filename
            if path.exists():
                table = read(path)
                report.figure(f"{_slug(run.run)}_{value}", f"{title}: {run.run}",
                              lambda paths: plots.head_heatmaps(table, value, paths, f"{title}: {run.run}"))


def _attention_figures(report: Report, runs: pd.DataFrame) -> None:
    """The attention maps `hprune analyze dump=N` wrote: the first report.attention_sentences sentences of each
    run, one (layer, head) grid per attention type."""
    axes = {"enc_self": ("source_tokens", "source_tokens"), "dec_self": ("decoder_tokens", "decoder_tokens"),
            "dec_enc": ("target_tokens", "source_tokens")}  # each map's rows and columns
    for run in runs.itertuples():
        files = sorted((Path(run.path) / "attention").glob("*.npz"), key=lambda p: int(p.stem))
        for path in files[:report.cfg.attention_sentences]:
            maps = np.load(path)
            for attn_type, key in ((attn_type, attn_type.replace("-", "_")) for attn_type in ATTENTION_TYPES):
                if key not in maps:
                    continue
                rows, columns = (maps[name].tolist() for name in axes[key])
                title = f"{attn_type} attention, sentence {path.stem}: {run.run}"
                report.figure(f"{_slug(run.run)}_attention_{path.stem}_{key}", title,
                              lambda paths: plots.attention_grid(maps[key], rows, columns, paths, title))


def build(cfg: DictConfig, out: Path, complete: Optional[Callable[[dict, dict], dict]] = None) -> dict:
    """The report of the runs under cfg.runs, written into `out`; `complete`: see collect.read_run."""
    roots = OmegaConf.to_container(cfg.runs) if OmegaConf.is_list(cfg.runs) else [cfg.runs]
    group_by = list(cfg.group_by)
    collection = collect([Path(r) for r in roots], complete)
    columns = list(cfg.columns) if cfg.columns else None
    runs = tables.runs_table(collection, columns, group_by)  # checks the columns first
    report = Report(cfg, out)
    sig = cfg.significance
    tests = tables.SavedHypotheses(sig.resamples, sig.seed)
    sparsity = list(cfg.sparsity)
    comparison = tables.comparison(collection, sparsity, group_by, tests)
    if not comparison.empty:
        comparison.insert(0, "model", comparison.pop("checkpoint").map(_model_label))
    testing = (f"; * : p < 0.05 against the reference, paired bootstrap over the test sentences (sacreBLEU, "
               f"{sig.resamples} resamples, seed {sig.seed}), where a point was measured at that sparsity"
               if sig.resamples else "")
    report.table("comparison", f"Pruning methods at matched sparsity ({', '.join(f'{s:g}' for s in sparsity)} % of "
                 "the pooled heads; BLEU interpolated between measured points, blank outside them; ΔBLEU against the "
                 "reference: the unpruned model, a fine-tuned curve's fine-tuning control, a trained method's control"
                 f"{_controls(collection.runs)}{testing})",
                 comparison, tables.marked(comparison) if not comparison.empty else None)
    macs = tables.matched_macs(collection, group_by)
    if not macs.empty:
        macs.insert(0, "model", macs.pop("checkpoint").map(_model_label))
    report.table("matched_macs", "Runs pruned to a MACs budget against the other methods at the attention MACs they "
                 f"reached (BLEU; curves interpolated, single runs within {tables.MATCH_MACS:g} points)", macs)
    pairs = tables.pairwise(collection, sparsity, group_by, tests)
    if not pairs.empty:
        pairs.insert(0, "model", pairs.pop("checkpoint").map(_model_label))
    report.table("pairwise", "Methods against each other at matched sparsity (difference: versus minus method; "
                 f"paired bootstrap, {sig.resamples} resamples, seed {sig.seed})", pairs,
                 pairs.drop(columns=["recipe"]) if not pairs.empty else None)
    seeds = tables.over_seeds(comparison, ["types", *group_by, "method"])
    report.table("comparison_seeds", "The comparison over seeds: mean and standard deviation; sig@: the seeds whose "
                 "difference from the reference is significant", seeds)
    report.table("pairwise_seeds", "Methods against each other over seeds",
                 tables.over_seeds(pairs, ["types", *group_by, "sparsity", "method", "versus"]))
    _comparison_plots(report, collection, group_by)
    trained = tables.controlled(collection, tests)
    report.table("controlled", f"Methods that train, against their control{_controls(collection.runs)} (the same "
                 "extra training without the pressure to prune): delta_bleu_control against it, delta_bleu against "
                 "the start", trained)
    _knob_plots(report, trained, collection.runs)
    _frontier(report, tables.frontier(collection))
    report.table("moa", "Mixture of attention heads: experts, cost and BLEU", tables.moa(collection))
    report.table("runs", "Runs", runs)
    _run_heatmaps(report, collection.runs[collection.runs["verb"].isin(["prune", "eval"])])
    _attention_figures(report, collection.runs[collection.runs["verb"] == "analyze"])
    incomplete = "".join(f"{run}: {why}\n" for run, why in collection.incomplete)
    write_atomic(out / "incomplete.txt", incomplete)
    if incomplete:
        report.items("Incomplete runs (no results)", incomplete.splitlines())
    report.write(f"hprune report: {', '.join(map(str, roots))}")
    print(tables.markdown(comparison) if not comparison.empty else tables.markdown(runs), end="")
    if collection.incomplete:
        print(f"incomplete runs ({len(collection.incomplete)}): " +
              "; ".join(f"{run} ({why})" for run, why in collection.incomplete))
    print(f"{len(collection.runs)} runs -> {out / 'report.md'}")
    return {"runs": len(collection.runs), "incomplete": len(collection.incomplete)}


def _frontier(report: Report, table: pd.DataFrame) -> None:
    """What pruning buys where it is spent: BLEU against the latency measured in CTranslate2, per model."""
    if table.empty:
        return
    table.insert(0, "model", table.pop("checkpoint").map(_model_label))
    report.table("frontier", "Accuracy against latency: the unpruned model (the reference), each run's BLEU and its "
                 "latency in CTranslate2 (measured, % of the unpruned model's; low and high: the range of its timing "
                 "rounds), its MACs per target token (% of the model's), and each recovery of a run (its pruned "
                 "model's latency and MACs); frontier: no point of the model has at least its BLEU at a latency its "
                 "timing could not tell from its own or lower, and is better in one", table)
    for model, rows in table.groupby("model", sort=False):
        report.figure(f"frontier_{_slug(model)}", f"BLEU against latency and MACs: {model}",
                      lambda paths, rows=rows: plots.frontier(rows, paths, f"{model}: BLEU against latency "
                                                                            "(CTranslate2) and MACs"))


def _controls(runs: pd.DataFrame) -> str:
    """ (method: its control's label, ...)": what each trained method's runs say their control is."""
    if "control_label" not in runs:
        return ""
    labels = runs.dropna(subset=["control_label"]).drop_duplicates("method")
    return " (" + "; ".join(f"{m}: {label}" for m, label in zip(labels["method"], labels["control_label"])) + ")" \
        if len(labels) else ""
