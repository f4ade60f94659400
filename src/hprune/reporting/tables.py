"""Result tables from collected runs (reporting/collect.py), and their Markdown / LaTeX text.

- comparison: BLEU and ΔBLEU of each pruning method at matched sparsity (25 / 50 / 75 % of the pooled heads),
  read off each method's BLEU-vs-%-pruned points by linear interpolation, on one model and one head pool;
- lambdas: Voita et al.'s gated runs, one row per λ (or head budget);
- moa: evaluated models with their experts (E, k), parameters, MACs per token and BLEU;
- runs: any columns of the runs, optionally grouped (mean, and how many runs).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..errors import UserError
from .collect import SCORING_KEYS, Collection

GROUP = ["checkpoint", "types"]  # one comparison: the same model, the same pool of heads
RUN_COLUMNS = ["run", "verb", "method", "pct_pruned", "kept_heads", "bleu", "delta_bleu", "chrf"]


def markdown(table: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """Markdown (pandas' own to_markdown needs the optional tabulate package)."""
    lines = ["| " + " | ".join(map(str, table.columns)) + " |",
             "|" + "|".join("---:" if pd.api.types.is_numeric_dtype(table[c]) else "---" for c in table.columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in _cells(table, floatfmt)]
    return "\n".join(lines) + "\n"


def latex(table: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A booktabs tabular (no jinja2 needed, unlike DataFrame.to_latex)."""
    def esc(text: str) -> str:
        for char, repl in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                           ("$", r"\$"), ("{", r"\{"), ("}", r"\}"), ("Δ", r"$\Delta$")):
            text = text.replace(char, repl)
        return text

    align = "".join("r" if pd.api.types.is_numeric_dtype(table[c]) else "l" for c in table.columns)
    lines = [rf"\begin{{tabular}}{{{align}}}", r"\toprule", " & ".join(esc(str(c)) for c in table.columns) + r" \\",
             r"\midrule"]
    lines += [" & ".join(esc(cell) for cell in row) + r" \\" for row in _cells(table, floatfmt)]
    return "\n".join(lines + [r"\bottomrule", r"\end{tabular}"]) + "\n"


def _cells(table: pd.DataFrame, floatfmt: str) -> list[list[str]]:
    """Text of every cell: floats with floatfmt, except in columns of whole numbers (counts that NaNs turned
    into floats); blanks for missing values."""
    whole = {c for c in table.columns if pd.api.types.is_float_dtype(table[c])
             and table[c].dropna().apply(float.is_integer).all() and table[c].notna().any()}

    def cell(column, value) -> str:
        if value is None or (isinstance(value, (float, np.floating)) and pd.isna(value)):
            return ""
        if isinstance(value, (float, np.floating)):
            return str(int(value)) if column in whole else format(value, floatfmt)
        return str(value)

    return [[cell(c, v) for c, v in zip(table.columns, row)] for row in table.itertuples(index=False)]


# --------------------------------------------------------------------------------------------- comparison
def pruning_points(collection: Collection) -> pd.DataFrame:
    """(run, checkpoint, types, method, pct_pruned, bleu, bleu_unpruned, scoring keys): every point of every
    pruning curve, and one point per prune run without a curve (a gated Voita run is one point)."""
    runs = collection.runs
    keep = ["run", *GROUP, "method", "pct_pruned", "bleu", "bleu_unpruned", *SCORING_KEYS]
    parts = [collection.curves.reindex(columns=keep)] if not collection.curves.empty else []
    curve_runs = set(collection.curves["run"]) if not collection.curves.empty else set()
    single = runs[(runs["verb"] == "prune") & ~runs["run"].isin(curve_runs)] if "method" in runs else runs.iloc[:0]
    parts.append(single.reindex(columns=keep))
    points = pd.concat(parts, ignore_index=True).dropna(subset=["pct_pruned", "bleu"])
    return points.astype({"pct_pruned": float, "bleu": float})


def check_comparable(points: pd.DataFrame, group_by: list[str]) -> None:
    """BLEU scores in one comparison must come from the same data, split and beam search."""
    for key, rows in points.groupby(GROUP + group_by, dropna=False):
        for setting in SCORING_KEYS:
            if setting in group_by:
                continue
            values = rows[setting].astype(str).unique()
            if len(values) > 1:
                first = rows[rows[setting].astype(str) == values[0]]["run"].iloc[0]
                second = rows[rows[setting].astype(str) == values[1]]["run"].iloc[0]
                raise UserError(f"runs {first} and {second} prune the same model but are scored with different "
                                f"{setting} ({values[0]} vs {values[1]}), so their BLEU cannot be compared; report "
                                f"them apart, or add group_by=[{setting}] for one table each")


def interpolate(points: pd.DataFrame, targets: list[float]) -> list[float]:
    """BLEU at each target % pruned, linear between measured points; NaN outside the measured range."""
    by_pct = points.groupby("pct_pruned")["bleu"].mean().sort_index()
    x, y = by_pct.index.to_numpy(float), by_pct.to_numpy(float)
    return [float(np.interp(t, x, y)) if x.min() <= t <= x.max() else float("nan") for t in targets]


def comparison(collection: Collection, sparsity: list[float], group_by: list[str] = ()) -> pd.DataFrame:
    """One row per (model, pool, method): BLEU and ΔBLEU (vs the unpruned model) at each target sparsity."""
    points = pruning_points(collection)
    if points.empty:
        return pd.DataFrame()
    group_by = list(group_by)
    check_comparable(points, group_by)
    rows = []
    for key, group in points.groupby(GROUP + group_by, dropna=False, sort=False):
        unpruned = group["bleu_unpruned"].dropna()
        baseline = float(unpruned.iloc[0]) if len(unpruned) else float("nan")
        for method, method_points in group.groupby("method", sort=False):
            row = dict(zip(GROUP + group_by, key))
            row.update({"method": method, "points": len(method_points), "unpruned": baseline})
            for target, bleu in zip(sparsity, interpolate(method_points, sparsity)):
                row[f"BLEU@{target:g}%"] = bleu
                row[f"ΔBLEU@{target:g}%"] = bleu - baseline
            rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------- λ, MoA, runs
LAMBDA_COLUMNS = ["run", "types", "l0_lambda", "head_budget", "kept_heads", "alive_heads", "heads_pool",
                  "pct_pruned", "bleu", "delta_bleu", "bleu_finetuned", "bleu_scratch"]
MOA_COLUMNS = ["run", "moa_experts", "moa_top_k", "moa_head_dim", "n_params", "macs_per_token",
               "attention_macs_per_token", "bleu", "expert_load_cv", "router_entropy"]


def _present(table: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    return table[[c for c in columns if c in table and table[c].notna().any()]]


def lambdas(collection: Collection) -> pd.DataFrame:
    runs = collection.runs
    if "method" not in runs:
        return pd.DataFrame()
    voita = runs[(runs["verb"] == "prune") & (runs["method"] == "voita")]
    return _present(voita.sort_values(["checkpoint", "types", "l0_lambda"], na_position="last"), LAMBDA_COLUMNS)


def moa(collection: Collection) -> pd.DataFrame:
    """Evaluated models: MoA ones with E and k, dense ones (E, k blank) next to them for reference."""
    runs = collection.runs
    evals = runs[runs["verb"] == "eval"]
    if "moa_experts" not in evals or evals["moa_experts"].isna().all():
        return pd.DataFrame()
    table = _present(evals.sort_values(["moa_experts", "moa_top_k"], na_position="first"), MOA_COLUMNS)
    return table.rename(columns={"moa_experts": "E", "moa_top_k": "k", "moa_head_dim": "head_dim",
                                 "n_params": "params", "macs_per_token": "MACs/token",
                                 "attention_macs_per_token": "attention MACs/token"})


def runs_table(collection: Collection, columns: list[str] | None, group_by: list[str]) -> pd.DataFrame:
    """The runs with the chosen columns (default: the headline ones present); grouped: means and a count."""
    runs = collection.runs
    wanted = list(columns) if columns else [c for c in RUN_COLUMNS if c in runs]
    unknown = [c for c in [*wanted, *group_by] if c not in runs]
    if unknown:
        raise UserError(f"unknown column {', '.join(repr(c) for c in unknown)}; the runs have: "
                        f"{', '.join(sorted(runs.columns))}")
    if not group_by:
        return runs[wanted]
    values = [c for c in wanted if c not in group_by and pd.api.types.is_numeric_dtype(runs[c])]
    grouped = runs.groupby(list(group_by), dropna=False)
    table = grouped[values].mean().reset_index() if values else grouped.size().reset_index()[list(group_by)]
    table.insert(len(group_by), "runs", grouped.size().to_numpy())
    return table
