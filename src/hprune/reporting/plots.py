"""Plots of pruning results (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..attention_types import ATTENTION_TYPES
from ..files import replaced_atomically


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path | list[Path]) -> Path:
    """savefig (to each path: e.g. a .png and a .pdf) under a temporary name, then rename: no half-written
    image. Closes the figure; returns the first path."""
    paths = [path] if isinstance(path, Path) else list(path)
    try:
        for target in paths:
            with replaced_atomically(target) as tmp:
                fig.savefig(tmp, format=target.suffix.lstrip("."), dpi=120, bbox_inches="tight")
        return paths[0]
    finally:
        _figure().close(fig)


def _lines(ax, xlabel: str, title: str, legend: str = "best") -> None:
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc=legend)
    ax.grid(alpha=0.3)


def bleu_curve(curve: pd.DataFrame, baseline_bleu: float, path: Path | list[Path], title: str = "",
               by: str = "order", baseline_label: str = "unpruned") -> Path:
    """BLEU vs % of heads pruned, one line per pruning order (`by`), the reference as a dashed line. Rows of one
    setting at one point (its seeds: see curve_points) draw their mean with a standard-deviation error bar."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for order, rows in curve.groupby(by, sort=False):
        stats = curve_points(rows)
        if (stats["count"] > 1).any():
            ax.errorbar(stats["pct_pruned"], stats["mean"], yerr=stats["std"].fillna(0), marker="o", capsize=3,
                        label=f"{order} (mean ± sd, {int(stats['count'].max())} seeds)")
        else:
            ax.plot(stats["pct_pruned"], stats["mean"], marker="o", label=order)
    if not np.isnan(baseline_bleu):
        ax.axhline(baseline_bleu, color="grey", linestyle="--", linewidth=1, label=baseline_label)
    ax.set_ylabel("BLEU")
    _lines(ax, "% of heads pruned", title, legend="lower left")  # curves fall to the right
    return _save(fig, path)


def curve_points(rows: pd.DataFrame) -> pd.DataFrame:
    """One line's points: BLEU's mean, standard deviation and count over the rows of one setting at one % pruned
    (seeds: runs whose settings differ in the seed alone, the `setting` column of reporting/collect.py); runs of
    different settings at the same % (a sweep's control and a setting that pruned nothing) stay separate points."""
    keys = ["pct_pruned"] + (["setting"] if "setting" in rows else [])
    return (rows.groupby(keys, dropna=False)["bleu"].agg(["mean", "std", "count"]).reset_index()
            .sort_values("pct_pruned", kind="stable"))


def head_heatmaps(table: pd.DataFrame, value: str, path: Path | list[Path], title: str = "") -> Path:
    """One layer x head heatmap per attention type; heads missing from the table (removed) are blank."""
    plt = _figure()
    kinds = [k for k in ATTENTION_TYPES if k in set(table["type"])]
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds) + 1, 3.2), squeeze=False,
                             constrained_layout=True)
    vmin, vmax = table[value].min(), table[value].max()
    for ax, attn_type in zip(axes[0], kinds):
        rows = table[table["type"] == attn_type]
        grid = np.full((int(rows["layer"].max()) + 1, int(rows["head"].max()) + 1), np.nan)
        grid[rows["layer"].to_numpy(int), rows["head"].to_numpy(int)] = rows[value].to_numpy(float)
        image = ax.imshow(grid, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_title(attn_type)
        ax.set_xlabel("head")
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]))
    axes[0][0].set_ylabel("layer")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label=value)
    fig.suptitle(title)
    return _save(fig, path)


def attention_grid(stack: np.ndarray, rows: list, columns: list, path: Path | list[Path], title: str = "") -> Path:
    """One sentence's maps of one attention type: a (layer, head) grid of heatmaps, query rows against key
    columns, the tokens on the outer axes; a head pruned away (NaN) is blank."""
    plt = _figure()
    layers, heads = stack.shape[:2]
    size = max(1.2, min(2.6, 0.16 * max(len(rows), len(columns))))
    fig, axes = plt.subplots(layers, heads, figsize=(size * heads + 1, size * layers + 0.6), squeeze=False,
                             constrained_layout=True)
    font = max(3, min(7, 140 / max(len(rows), len(columns))))
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer][head]
            ax.imshow(stack[layer, head], cmap="viridis", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(columns)) if layer == layers - 1 else [])
            ax.set_yticks(range(len(rows)) if head == 0 else [])
            if layer == layers - 1:
                ax.set_xticklabels(columns, rotation=90, fontsize=font)
                ax.set_xlabel(f"head {head}", fontsize=7)
            if head == 0:
                ax.set_yticklabels(rows, fontsize=font)
                ax.set_ylabel(f"layer {layer}", fontsize=7)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def line(table: pd.DataFrame, x: str, ys: list, path: Path | list[Path], title: str = "") -> Path:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for y in ys:
        ax.plot(table[x], table[y], label=y)
    _lines(ax, x, title)
    return _save(fig, path)


def bleu_and_heads(table: pd.DataFrame, x: str, path: Path | list[Path], title: str = "",
                   references: dict | None = None) -> Path:
    """BLEU against `x` (a trained method's knob, e.g. a penalty's weight; a log axis when all values are positive),
    heads kept on a second axis; `references`: label -> BLEU drawn as horizontal lines (its control, the start)."""
    plt = _figure()
    table = table.sort_values(x)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(table[x], table["bleu"], marker="o", color="tab:blue", label="BLEU")
    for (label, bleu), style in zip((references or {}).items(), ("--", ":")):
        ax.axhline(bleu, color="grey", linestyle=style, linewidth=1, label=label)
    if references:
        ax.legend(loc="lower left")
    ax.set_ylabel("BLEU", color="tab:blue")
    positive = table[x][table[x] > 0]
    if len(positive) and (table[x] >= 0).all():  # penalty grids are geometric; a 0 control stays on the axis
        ax.set_xscale("symlog", linthresh=float(positive.min())) if (table[x] == 0).any() else ax.set_xscale("log")
    twin = ax.twinx()
    twin.plot(table[x], table["kept_heads"], marker="s", color="tab:orange", label="heads kept")
    twin.set_ylabel("heads kept", color="tab:orange")
    twin.set_ylim(0, max(table["heads_pool"].max() if "heads_pool" in table else table["kept_heads"].max(), 1) * 1.05)
    ax.set_xlabel(x)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def frontier(table: pd.DataFrame, path: Path | list[Path], title: str = "") -> Path:
    """BLEU against the latency measured in CTranslate2 and against the model's MACs (one panel each): the unpruned
    model a star at 100 %, a point per pruned run coloured by method with its timing rounds' range as a bar, each
    recovery a triangle above (or below) its pruned model, joined to it; the frontier's points ringed and joined."""
    plt = _figure()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    colours = {}
    for ax, x in zip(axes, ("latency %", "model MACs %")):
        pruned = table[table["stage"] == "pruned"]
        for method, rows in pruned.groupby("method", sort=False):
            colours[method] = ax.scatter(rows[x], rows["bleu"], label=method, zorder=3).get_facecolor()[0]
            if x == "latency %" and "latency low" in rows:
                spread = rows.dropna(subset=["latency low", "latency high"])
                ax.errorbar(spread[x], spread["bleu"], xerr=[spread[x] - spread["latency low"],
                                                             spread["latency high"] - spread[x]],
                            fmt="none", ecolor=colours[method], elinewidth=1, capsize=2, zorder=2)
        recovered = table[table["stage"] == "recovered"]
        for method, rows in recovered.groupby("method", sort=False):
            ax.scatter(rows[x], rows["bleu"], marker="^", label=method, zorder=3)
        for x_value, before, after in zip(recovered[x], recovered.get("bleu before", []), recovered["bleu"]):
            ax.plot([x_value, x_value], [before, after], color="grey", linewidth=0.8, linestyle=":", zorder=1)
        reference = table[table["stage"] == "unpruned"]
        ax.scatter(reference[x], reference["bleu"], marker="*", s=160, color="black", label="unpruned", zorder=5)
        best = table[table["frontier"]].dropna(subset=[x]).sort_values(x)
        ax.plot(best[x], best["bleu"], color="black", linewidth=1, zorder=2)
        ax.scatter(best[x], best["bleu"], s=120, facecolors="none", edgecolors="black", zorder=4,
                   label="frontier (latency)")
        ax.set_xlabel("latency in CTranslate2, % of the unpruned model's\n(measured; bar: the timing rounds)"
                      if x == "latency %" else "MACs per target token, % of the unpruned model's\n(counted)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("BLEU")
    axes[0].legend(loc="lower right", fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)
