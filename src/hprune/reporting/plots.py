"""Plots of pruning results (matplotlib, no display needed)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from ..pruning.heads import ATTENTION_TYPES


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """savefig to a temporary name, then rename: no half-written image. Closes the figure."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format=path.suffix.lstrip("."), dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
        return path
    finally:
        _figure().close(fig)


def _lines(ax, xlabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)


def bleu_curve(curve: pd.DataFrame, baseline_bleu: float, path: Path, title: str = "") -> Path:
    """BLEU vs % of heads pruned, one line per pruning order, the unpruned model as a dashed line."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for order, rows in curve.groupby("order", sort=False):
        ax.plot(rows["pct_pruned"], rows["bleu"], marker="o", label=order)
    ax.axhline(baseline_bleu, color="grey", linestyle="--", linewidth=1, label="unpruned")
    ax.set_ylabel("BLEU")
    _lines(ax, "% of heads pruned", title)
    return _save(fig, path)


def head_heatmaps(table: pd.DataFrame, value: str, path: Path, title: str = "") -> Path:
    """One layer x head heatmap per attention type; heads missing from the table (removed) are blank."""
    plt = _figure()
    kinds = [k for k in ATTENTION_TYPES if k in set(table["type"])]
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds) + 1, 3.2), squeeze=False,
                             constrained_layout=True)
    vmin, vmax = table[value].min(), table[value].max()
    for ax, kind in zip(axes[0], kinds):
        rows = table[table["type"] == kind]
        grid = np.full((int(rows["layer"].max()) + 1, int(rows["head"].max()) + 1), np.nan)
        grid[rows["layer"].to_numpy(int), rows["head"].to_numpy(int)] = rows[value].to_numpy(float)
        image = ax.imshow(grid, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_title(kind)
        ax.set_xlabel("head")
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]))
    axes[0][0].set_ylabel("layer")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label=value)
    fig.suptitle(title)
    return _save(fig, path)


def line(table: pd.DataFrame, x: str, ys: list, path: Path, title: str = "") -> Path:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for y in ys:
        ax.plot(table[x], table[y], label=y)
    _lines(ax, x, title)
    return _save(fig, path)
