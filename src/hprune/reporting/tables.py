"""Result tables from collected runs (reporting/collect.py), and their Markdown / LaTeX text.

- comparison: BLEU and ΔBLEU of each pruning method at matched sparsity (25 / 50 / 75 % of the pooled heads),
  read off each method's BLEU-vs-%-pruned points by linear interpolation, on one model and one head pool;
- controlled: the runs of methods that train, against their control (one row per setting of their knobs);
- moa: evaluated models with their experts (E, k), parameters, MACs per token and BLEU;
- runs: any columns of the runs, optionally grouped (mean, and how many runs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from ..bleu import tokenize_of
from ..errors import UserError
from ..rundir import RunDir
from .collect import SCORING_KEYS, Collection
from .significance import paired_bootstrap

GROUP = ["checkpoint", "types"]  # one comparison: the same model, the same pool of heads
P_VALUE_COLUMNS = ("p@", "p_")
MATCH_PCT = 0.5  # a point measured within this many percentage points of a target sparsity is "at" it
RUN_COLUMNS = ["run", "verb", "method", "layout", "pct_pruned", "kept_heads", "bleu", "delta_bleu", "chrf"]


def markdown(table: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A Markdown (pipe) table: pandas' to_markdown (tabulate) of the cells as `cells` writes them, numbers
    right-aligned."""
    text = _as_text(table, floatfmt)
    if table.columns.empty:
        return ""
    return text.to_markdown(index=False, disable_numparse=True, colalign=[
        "right" if pd.api.types.is_numeric_dtype(table[c]) else "left" for c in table.columns]) + "\n"


def latex(table: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A booktabs tabular: pandas' Styler.to_latex, LaTeX's special characters escaped. Δ (a column prefix) is
    written $\\Delta$, which pdflatex reads without a Greek font; pandas' escaping leaves it as it is."""
    text = _as_text(table, floatfmt)
    align = "".join("r" if pd.api.types.is_numeric_dtype(table[c]) else "l" for c in table.columns)
    styled = text.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    return styled.to_latex(hrules=True, column_format=align).replace("Δ", r"$\Delta$")


def _as_text(table: pd.DataFrame, floatfmt: str) -> pd.DataFrame:
    return pd.DataFrame(cells(table, floatfmt), columns=[str(c) for c in table.columns], dtype=object)


def cells(table: pd.DataFrame, floatfmt: str) -> list[list[str]]:
    """Text of every cell: floats with floatfmt, except in columns of whole numbers (counts that NaNs turned
    into floats); blanks for missing values."""
    whole = {c for c in table.columns if pd.api.types.is_float_dtype(table[c])
             and table[c].dropna().apply(float.is_integer).all() and table[c].notna().any()}

    def cell(column, value) -> str:
        if value is None or (isinstance(value, (float, np.floating)) and pd.isna(value)):
            return ""
        if isinstance(value, (float, np.floating)):
            if str(column).startswith(P_VALUE_COLUMNS):  # p-values: 0.00 would hide p = 0.001
                return format(value, ".4f")
            return str(int(value)) if column in whole else format(value, floatfmt)
        return str(value)

    return [[cell(c, v) for c, v in zip(table.columns, row)] for row in table.itertuples(index=False)]


# --------------------------------------------------------------------------------------------- comparison
POINT_COLUMNS = ["run", *GROUP, "method", "layout", "pct_pruned", "attention_macs_pct", "macs_budget", "bleu",
                 "bleu_unpruned", "recipe", "train_seed", "seed", "setting", *SCORING_KEYS]
MATCH_MACS = 2.5  # a single run measured within this many points of attention MACs kept is "at" that level


def is_control(runs: pd.DataFrame) -> pd.Series:
    """The runs that are some trained run's control, as their method declared it in metrics.json
    (methods/__init__.py: Control)."""
    return runs.get("is_control", pd.Series(False, index=runs.index)).fillna(False).astype(bool)


def with_controls(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs of the methods that train with their control: the run that shares its control_key (the same
    checkpoint, seed, schedule and pool) and is the control (the same extra training without the pressure to
    prune). Adds bleu_control, control_run and control_path (blank where no control ran)."""
    runs = runs.copy()
    runs["bleu_control"] = float("nan")
    for column in ("control_run", "control_path"):
        runs[column] = None
    if "control_key" not in runs:
        return runs
    controls = runs[is_control(runs)].drop_duplicates("control_key").set_index("control_key")
    for i in runs.index[runs["control_key"].notna() & ~is_control(runs)]:
        key = runs.at[i, "control_key"]
        if key in controls.index:
            runs.at[i, "bleu_control"] = float(controls.at[key, "bleu"])
            runs.at[i, "control_run"], runs.at[i, "control_path"] = controls.at[key, "run"], controls.at[key, "path"]
    return runs


def pruning_points(collection: Collection) -> pd.DataFrame:
    """Every point of every pruning curve, and one point per prune run without a curve (a trained method's run is
    one point), with its reference: the unpruned model, or for a method that trains, its control where one ran.
    Columns: POINT_COLUMNS, reference, bleu_reference, and where the point's translations and the reference's
    are (path, hyp; reference_path, reference_hyp: see hprune/rundir.py)."""
    runs = with_controls(collection.runs)
    parts = []
    if not collection.curves.empty:
        curves = collection.curves.reindex(columns=POINT_COLUMNS + ["path", "step", "bleu_control"])
        steps, controlled = curves["step"], curves["bleu_control"].notna()  # fine-tuned curves: their control
        curves["hyp"] = [f"{m}.{int(s)}" if pd.notna(s) else None for m, s in zip(curves["method"], steps)]
        curves["reference_hyp"] = [(f"control.{int(s)}" if c else f"{m}.0") if pd.notna(s) else None
                                   for m, s, c in zip(curves["method"], steps, controlled)]
        curves["reference_path"] = curves["path"]
        curves["reference"] = ["fine-tuning control" if c else "unpruned" for c in controlled]
        curves["bleu_reference"] = curves["bleu_control"].where(controlled, curves["bleu_unpruned"])
        parts.append(curves.drop(columns=["step", "bleu_control"]))
    curve_runs = set(collection.curves["run"]) if not collection.curves.empty else set()
    if "method" in runs:
        # (a run that pruned FFN neurons too is no point on a heads axis: the frontier table holds it)
        neurons = runs["kept_neurons"].notna() if "kept_neurons" in runs else False
        single = runs[(runs["verb"] == "prune") & ~runs["run"].isin(curve_runs) & ~neurons]
        single = single.reindex(columns=POINT_COLUMNS + ["path", "bleu_control", "control_path", "control_label"])
        controlled = single["bleu_control"].notna()
        single["hyp"] = "pruned"
        single["reference"] = [label if c and isinstance(label, str) else "control" if c else "unpruned"
                               for label, c in zip(single["control_label"], controlled)]
        single["bleu_reference"] = single["bleu_control"].where(controlled, single["bleu_unpruned"])
        single["reference_path"] = single["control_path"].where(controlled, single["path"])
        single["reference_hyp"] = ["pruned" if c else "unpruned" for c in controlled]
        parts.append(single.drop(columns=["bleu_control", "control_path", "control_label"]))
    if not parts:
        return pd.DataFrame(columns=POINT_COLUMNS)
    points = pd.concat(parts, ignore_index=True).dropna(subset=["pct_pruned", "bleu"])
    # a layout other than free is another method on the same model: compared with the free one, not mixed in
    points["method"] = [m if pd.isna(layout) or layout == "free" else f"{m} ({layout})"
                        for m, layout in zip(points["method"], points["layout"])]
    points = points.astype({"pct_pruned": float, "bleu": float, "bleu_reference": float})
    points["delta"] = points["bleu"] - points["bleu_reference"]
    return points


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


def interpolate(points: pd.DataFrame, targets: list[float], value: str = "bleu", axis: str = "pct_pruned") -> list[float]:
    """`value` at each target of `axis` (% pruned), linear between measured points; NaN outside the measured range."""
    by_pct = points.groupby(axis)[value].mean().sort_index()
    x, y = by_pct.index.to_numpy(float), by_pct.to_numpy(float)
    return [float(np.interp(t, x, y)) if x.min() <= t <= x.max() else float("nan") for t in targets]


def measured_at(points: pd.DataFrame, target: float) -> Optional[pd.Series]:
    """The point measured at target % pruned (within half a percentage point), if there is one."""
    near = points[(points["pct_pruned"] - target).abs() <= MATCH_PCT]
    return near.iloc[0] if len(near) else None


class SavedHypotheses:
    """Saved translations of the runs, read once each, and paired bootstrap tests between them (sacreBLEU's);
    resamples=0 tests nothing."""

    def __init__(self, resamples: int, seed: int):
        self.resamples, self.seed, self.cache = resamples, seed, {}

    def read(self, path, name: Optional[str]) -> Optional[list[str]]:
        """A run's hypotheses `name`, or its references with name=None; None where they were not saved."""
        if (path, name) not in self.cache:
            run = None if path is None or pd.isna(path) else Path(path)
            self.cache[(path, name)] = (None if run is None else RunDir(run).references() if name is None
                                        else RunDir(run).hypotheses(name))
        return self.cache[(path, name)]

    def test(self, base: pd.Series, point: pd.Series, against: str = "reference") -> Optional[dict]:
        """paired_bootstrap of `point` vs base's reference model (against="reference": the unpruned model or the
        control of base's run) or vs base itself (against="point"); None where translations are missing."""
        if not self.resamples:
            return None
        baseline = (self.read(base["reference_path"], base["reference_hyp"]) if against == "reference"
                    else self.read(base["path"], base["hyp"]))
        system, references = self.read(point["path"], point["hyp"]), self.read(point["path"], None)
        if baseline is None or system is None or references is None or not len(baseline) == len(system) == len(references):
            return None
        return paired_bootstrap(baseline, system, references, self.resamples, self.seed, self.tokenize(point["path"]))

    def tokenize(self, path) -> str:
        """sacreBLEU's tokenization of a run's BLEU (from its signature), read once per run."""
        if ("tokenize", path) not in self.cache:
            signature = (RunDir(Path(path)).metrics() or {}).get("bleu_signature")
            self.cache[("tokenize", path)] = tokenize_of(signature)
        return self.cache[("tokenize", path)]


def comparison(collection: Collection, sparsity: list[float], group_by: list[str] = (),
               tests: Optional[SavedHypotheses] = None) -> pd.DataFrame:
    """One row per (model, pool, method): BLEU at each target sparsity and ΔBLEU against the method's reference
    (the unpruned model; a trained method's control); with `tests`, where a point was measured at that
    sparsity, the p-value of that difference (paired bootstrap over the test sentences)."""
    points = pruning_points(collection)
    if points.empty:
        return pd.DataFrame()
    group_by = list(group_by)
    check_comparable(points, group_by)
    rows = []
    for key, group in points.groupby(GROUP + group_by, dropna=False, sort=False):
        for method, method_points in group.groupby("method", sort=False):
            pruned = method_points[method_points["pct_pruned"] > 0]  # step 0 is its own reference
            reference = (pruned if len(pruned) else method_points)["reference"].iloc[0]
            bleu_reference = (pruned if len(pruned) else method_points)["bleu_reference"].dropna().unique()
            row = dict(zip(GROUP + group_by, key))
            row.update({"method": method, "recipe": method_points["recipe"].iloc[0],
                        "train_seed": method_points["train_seed"].iloc[0], "seed": method_points["seed"].iloc[0],
                        "points": len(method_points), "reference": reference,
                        # one number where the reference is one model; blank where it is one per point
                        "reference_bleu": float(bleu_reference[0]) if len(bleu_reference) == 1 else float("nan")})
            bleus, deltas = interpolate(method_points, sparsity), interpolate(method_points, sparsity, "delta")
            for target, bleu, delta in zip(sparsity, bleus, deltas):
                row[f"BLEU@{target:g}%"], row[f"ΔBLEU@{target:g}%"] = bleu, delta
                point = measured_at(method_points, target)
                test = tests.test(point, point) if tests is not None and point is not None else None
                if tests is not None and tests.resamples:
                    row[f"p@{target:g}%"] = test["p_value"] if test else float("nan")
                    row[f"sig@{target:g}%"] = test["significant"] if test else None
            rows.append(row)
    return pd.DataFrame(rows)


def pairwise(collection: Collection, sparsity: list[float], group_by: list[str], tests: SavedHypotheses) -> pd.DataFrame:
    """Methods against each other at matched sparsity, where both measured a point there: one row per pair (in
    the order the methods first appear), the second method's BLEU minus the first's, and its p-value."""
    points = pruning_points(collection)
    rows = []
    if points.empty or not tests.resamples:
        return pd.DataFrame()
    for key, group in points.groupby(GROUP + list(group_by), dropna=False, sort=False):
        methods = list(dict.fromkeys(group["method"]))
        for target in sparsity:
            at = {m: measured_at(group[group["method"] == m], target) for m in methods}
            present = [m for m in methods if at[m] is not None]
            for i, first in enumerate(present):
                for second in present[i + 1:]:
                    test = tests.test(at[first], at[second], against="point")
                    if test is None:
                        continue
                    rows.append({**dict(zip(GROUP + list(group_by), key)), "recipe": group["recipe"].iloc[0],
                                 "sparsity": target, "method": first, "versus": second,
                                 "bleu": float(at[first]["bleu"]), "bleu_versus": float(at[second]["bleu"]),
                                 "difference": test["delta"], "p_value": test["p_value"],
                                 "significant": test["significant"]})
    return pd.DataFrame(rows)


def matched_macs(collection: Collection, group_by: list[str] = ()) -> pd.DataFrame:
    """Every run pruned to a MACs budget (metrics.json's macs_budget) against the other methods on the same model and pool at the
    attention MACs it reached: a curve's BLEU interpolated there, a single run's where it is within MATCH_MACS
    points of it. One row per budgeted run, one BLEU column per method."""
    points = pruning_points(collection)
    if points.empty or points["macs_budget"].isna().all():
        return pd.DataFrame()
    points = points.dropna(subset=["attention_macs_pct"]).astype({"attention_macs_pct": float})
    rows = []
    for key, group in points.groupby(GROUP + list(group_by), dropna=False, sort=False):
        budgeted = group[group["macs_budget"].notna()]
        for point in budgeted.itertuples():
            macs = point.attention_macs_pct
            row = {**dict(zip(GROUP + list(group_by), key)), "run": point.run, "macs_budget": point.macs_budget,
                   "attention MACs kept %": macs, point.method: point.bleu}
            for method, others in group[group["run"] != point.run].groupby("method", sort=False):
                if others["run"].nunique() == 1 and len(others) > 1:  # a curve
                    row.setdefault(method, interpolate(others, [macs], axis="attention_macs_pct")[0])
                else:
                    near = others[(others["attention_macs_pct"] - macs).abs() <= MATCH_MACS]
                    row.setdefault(method, float(near["bleu"].mean()) if len(near) else float("nan"))
            rows.append(row)
    return pd.DataFrame(rows)


def frontier(collection: Collection) -> pd.DataFrame:
    """What pruning buys: per model, the unpruned model (the reference: 100 % of its latency and MACs), every prune
    run whose latency in CTranslate2 was measured (latency.measure, or a latency budget), with the range of its
    timing rounds, and each recovery of such a run (its own recovery stage, or `hprune recover` of it: the pruned
    model's structure, so its latency and MACs), BLEU against latency and against the whole model's MACs per target
    token. `frontier` marks the points no other point of the model beats: at least its BLEU at a latency not above
    what its timing could be (its rounds' highest), and higher BLEU, or faster beyond its own rounds' highest, or
    the unpruned model itself (a cut that buys nothing measurable is no point of the frontier)."""
    runs = collection.runs
    if "latency_pct_measured" not in runs or runs["latency_pct_measured"].isna().all():
        return pd.DataFrame()
    get = lambda run, key: getattr(run, key, float("nan"))  # noqa: E731
    measured = runs.dropna(subset=["latency_pct_measured"])
    rows, unpruned = [], {}
    for run in measured.itertuples():
        macs = 100 * get(run, "macs_per_token_pruned") / get(run, "macs_per_token_unpruned") \
            if pd.notna(get(run, "macs_per_token_pruned")) else float("nan")
        point = {"checkpoint": run.checkpoint, "run": run.run, "method": run.method, "stage": "pruned",
                 "bleu": run.bleu, "latency %": run.latency_pct_measured,
                 "latency low": get(run, "latency_pct_low"), "latency high": get(run, "latency_pct_high"),
                 "speed-up": get(run, "latency_speedup"), "model MACs %": round(macs, 2),
                 "attention MACs %": get(run, "attention_macs_pct"), "kept heads": get(run, "kept_heads"),
                 "kept neurons": get(run, "kept_neurons")}
        rows.append(point)
        if pd.notna(get(run, "bleu_unpruned")):
            unpruned.setdefault(run.checkpoint, run.bleu_unpruned)
        recoveries = [run] if pd.notna(get(run, "bleu_recovered")) else []
        if "verb" in runs and "mask" in runs:  # `hprune recover mask=<this run>` (or its head_mask.json)
            folder = Path(get(run, "path") if pd.notna(get(run, "path")) else run.run).resolve()
            recoveries += [r for r in runs[runs["verb"] == "recover"].itertuples()
                           if isinstance(r.mask, str) and Path(r.mask).resolve().parent == folder]
        for recovered in recoveries:
            rows.append({**point, "run": recovered.run, "stage": "recovered",
                         "method": f"{run.method} + {recovered.recovery_loss}", "bleu": recovered.bleu_recovered,
                         "bleu before": recovered.bleu_before_recovery,
                         "recovery updates": recovered.recovery_updates,
                         "recovery s": recovered.recovery_seconds,
                         "p vs pruned": recovered.p_recovered_vs_pruned,
                         "p vs unpruned": recovered.p_recovered_vs_unpruned})
    for checkpoint, bleu in unpruned.items():
        rows.append({"checkpoint": checkpoint, "run": "", "method": "unpruned", "stage": "unpruned", "bleu": bleu,
                     "latency %": 100.0, "speed-up": 1.0, "model MACs %": 100.0, "attention MACs %": 100.0})
    table = pd.DataFrame(rows)
    slowest = table["latency high"].fillna(table["latency %"]) if "latency high" in table else table["latency %"]

    def beaten(i: int) -> bool:  # another point of the model as good in both (its latency within i's noise) and
        # better in one (faster beyond its own noise), or the unpruned model itself: a cut that buys nothing
        # measurable is no point of the frontier
        bleu, latency, could_be = table.at[i, "bleu"], table.at[i, "latency %"], slowest[i]
        others = (table["checkpoint"] == table.at[i, "checkpoint"]) & (table.index != i)
        same, surely = table[others], slowest[others]
        return bool(((same["bleu"] >= bleu) & (same["latency %"] <= could_be)
                     & ((same["bleu"] > bleu) | (surely < latency) | (same["stage"] == "unpruned"))).any())
    table["frontier"] = [not beaten(i) for i in table.index]
    return table.sort_values(["checkpoint", "latency %", "stage"]).reset_index(drop=True)


def over_seeds(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Rows that differ only by seed (same recipe of the model, same `keys`) as mean and standard deviation
    (n - 1) of every number, with the seeds counted; a `sig@` column becomes how many seeds were significant.
    Empty when no rows repeat; rows of one seed stay, with a blank standard deviation."""
    if table.empty or not table.groupby(["recipe", *keys], dropna=False).size().gt(1).any():
        return pd.DataFrame()
    values = [c for c in table.columns if c.startswith(("BLEU@", "ΔBLEU@", "bleu", "difference")) and
              pd.api.types.is_numeric_dtype(table[c])]
    out = []
    for key, rows in table.groupby(["recipe", *keys], dropna=False, sort=False):
        row = {"model": rows["model"].iloc[0] if "model" in rows else key[0], **dict(zip(keys, key[1:])),
               "seeds": len(rows)}
        for column in values:
            row[f"{column} mean"], row[f"{column} sd"] = rows[column].mean(), rows[column].std(ddof=1)
        for column in [c for c in table.columns if c.startswith("sig@") or c == "significant"]:
            row[column] = f"{int(rows[column].fillna(False).astype(bool).sum())}/{len(rows)}"
        out.append(row)
    return pd.DataFrame(out)


def marked(table: pd.DataFrame) -> pd.DataFrame:
    """The comparison for reading: ΔBLEU@s% with * where significant at 0.05 (sig@ columns dropped, recipe and
    seeds only when they tell something)."""
    table = table.copy()
    for column in [c for c in table.columns if c.startswith("sig@")]:
        delta = "Δ" + column.replace("sig@", "BLEU@")
        table[delta] = [("" if pd.isna(d) else f"{d:+.2f}" + ("*" if s is True else ""))
                        for d, s in zip(table[delta], table[column])]
        table = table.drop(columns=column)
    drop = ["recipe"] + [c for c in ("train_seed", "seed") if c in table and table[c].nunique(dropna=True) <= 1]
    return table.drop(columns=[c for c in drop if c in table])


# --------------------------------------------------------------------------------------------- trained, MoA, runs
CONTROLLED_COLUMNS = ["run", "method", "types", "kept_heads", "heads_pool", "pct_pruned", "bleu", "delta_bleu"]
MOA_COLUMNS = ["run", "moa_experts", "moa_top_k", "moa_head_dim", "n_params", "macs_per_token",
               "attention_macs_per_token", "bleu", "expert_load_cv", "router_entropy"]


def _present(table: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    return table[[c for c in columns if c in table and table[c].notna().any()]]


def declared(runs: pd.DataFrame, key: str) -> list[str]:
    """What the runs' methods declared for the report (metrics.json's `report_<key>`: methods/__init__.py,
    Report), in the order first seen."""
    found: dict = {}
    for values in runs.get(f"report_{key}", pd.Series(dtype=object)).dropna():
        found.update(dict.fromkeys(values if isinstance(values, (list, tuple)) else []))
    return list(found)


def controlled(collection: Collection, tests: Optional[SavedHypotheses] = None) -> pd.DataFrame:
    """Runs of the methods that train with a control (one row per setting of the knobs their methods declare),
    against that control where it ran: ΔBLEU (control), the pruning's own effect, and with `tests` its p-value;
    delta_bleu stays the change from the start, which for the control is what the extra training alone did."""
    runs = with_controls(collection.runs)
    if "control_key" not in runs:
        return pd.DataFrame()
    trained = runs[runs["control_key"].notna()].copy()
    trained["delta_bleu_control"] = trained["bleu"].astype(float) - trained["bleu_control"].astype(float)
    if tests is not None and tests.resamples:
        points = pruning_points(collection).set_index("run")
        found = [tests.test(points.loc[run], points.loc[run]) if run in points.index and control not in (None, run)
                 else None for run, control in zip(trained["run"], trained["control_run"])]
        trained["p_vs_control"] = [t["p_value"] if t else float("nan") for t in found]
        trained["significant_vs_control"] = [t["significant"] if t else None for t in found]
    knobs = declared(trained, "knobs")
    columns = (CONTROLLED_COLUMNS[:3] + knobs + CONTROLLED_COLUMNS[3:] + declared(trained, "columns")
               + ["control_run", "bleu_control", "delta_bleu_control", "p_vs_control", "significant_vs_control"])
    order = [c for c in ("checkpoint", "types", "method", *knobs) if c in trained]
    return _present(trained.sort_values(order, na_position="last"), columns)


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
