"""Voita et al.'s finding as a test: do heads with a role survive the L0 penalty longer than heads without one?

Input: the head roles of the start model (`hprune analyze`'s head_roles.csv) and the head masks of a λ sweep
of Voita's gates on the same model. A head's survival is the number of the sweep's λ > 0 at which it stays open
(masks need not be nested from one λ to the next, so no single "closing λ" is assumed). The statistic is the
mean survival of the heads with a role minus that of the gated heads without one. Its p-value (one-sided: role
heads survive longer) comes from a permutation test of the role labels over the gated heads, exact (every
labelling) when there are at most EXACT_LIMIT labellings, else from `resamples` random ones. Over several models
(training seeds), `pooled_survival_test` permutes the labels within each model, so that a model whose gates all
close early weighs on neither side.
"""
from __future__ import annotations

import json
from itertools import combinations
from math import comb
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pandas as pd

from ..rundir import RunDir

EXACT_LIMIT = 200_000


def sweep_masks(sweep_dir: Path) -> Dict[float, dict]:
    """{λ: head mask} of the finished Voita runs of a sweep (its job folders)."""
    runs = [run for run in RunDir.under(sweep_dir) if run.path != Path(sweep_dir) and run.finished]
    return {run.metrics()["l0_lambda"]: json.loads(run.head_mask.read_text()) for run in runs}


def survival(masks: Dict[float, dict], heads: Sequence[tuple]) -> np.ndarray:
    """For each (type, layer, head): at how many of the masks' λ > 0 it is open."""
    kept = [mask for lam, mask in sorted(masks.items()) if lam > 0]
    return np.array([sum(int(bool(mask[attn_type][layer][head])) for mask in kept) for attn_type, layer, head in heads])


def permutation_p(values: np.ndarray, labels: np.ndarray, resamples: int, seed: int) -> float:
    """One-sided p of mean(values[labels]) - mean(values[~labels]) under random relabelling."""
    n, k = len(values), int(labels.sum())
    total = values.sum()

    def difference(chosen_sum):
        return chosen_sum / k - (total - chosen_sum) / (n - k)

    observed = difference(values[labels].sum())
    if comb(n, k) <= EXACT_LIMIT:
        sums = np.array([values[list(chosen)].sum() for chosen in combinations(range(n), k)])
        return float(np.mean(difference(sums) >= observed - 1e-12))
    rng = np.random.default_rng(seed)
    sums = np.array([values[rng.permutation(n)[:k]].sum() for _ in range(resamples)])
    return float((1 + np.sum(difference(sums) >= observed - 1e-12)) / (1 + resamples))


def has_role(roles: pd.DataFrame, role_columns: List[str]) -> np.ndarray:
    """Per row of head_roles.csv: has it any of the roles (columns measured; a blank one counts as no)?"""
    columns = [c for c in role_columns if c in roles]
    return roles[columns].fillna(False).astype(bool).any(axis=1).to_numpy() if columns else np.zeros(len(roles), bool)


def _labelled_survival(roles: pd.DataFrame, masks: Dict[float, dict], role_columns: List[str]) -> tuple:
    """(survival of each row's head, whether it has a role)."""
    heads = list(roles[["type", "layer", "head"]].itertuples(index=False, name=None))
    return survival(masks, heads).astype(float), has_role(roles, role_columns)


def _result(open_at: np.ndarray, labels: np.ndarray, **extra) -> dict:
    """The test's summary, its means filled only when there are heads on both sides (p is the caller's)."""
    both = labels.any() and not labels.all()
    role, other = (round(float(open_at[side].mean()), 4) if both else None for side in (labels, ~labels))
    return {**extra, "role_heads": int(labels.sum()), "other_heads": int((~labels).sum()), "mean_open_role": role,
            "mean_open_other": other, "difference": round(role - other, 4) if both else None, "p_value": None}


def role_survival_test(roles: pd.DataFrame, masks: Dict[float, dict], role_columns: List[str],
                       resamples: int = 10_000, seed: int = 12345) -> dict:
    """roles: head_roles.csv rows of the gated heads' types; masks: {λ: head mask} of the sweep."""
    open_at, labels = _labelled_survival(roles, masks, role_columns)
    result = _result(open_at, labels, lambdas=sorted(lam for lam in masks if lam > 0))
    if result["difference"] is not None:
        result["p_value"] = round(permutation_p(open_at, labels, resamples, seed), 4)
    return result


def pooled_survival_test(studies: List[tuple], role_columns: List[str], resamples: int = 10_000,
                         seed: int = 12345) -> dict:
    """studies: (roles, masks) per model, as role_survival_test takes them. The statistic: the mean survival of
    all role heads minus that of all other heads; its one-sided p from `resamples` relabellings, each permuting
    the labels within every model."""
    per_model = [_labelled_survival(roles, masks, role_columns) for roles, masks in studies]
    open_at, labels = (np.concatenate(side) for side in zip(*per_model))
    result = _result(open_at, labels, models=len(studies))
    if result["difference"] is None:
        return result

    def difference(chosen: np.ndarray) -> float:
        return open_at[chosen].mean() - open_at[~chosen].mean()

    observed = difference(labels)
    rng = np.random.default_rng(seed)
    bounds = np.cumsum([0] + [len(model_labels) for _, model_labels in per_model])
    hits = 0
    for _ in range(resamples):
        shuffled = np.concatenate([rng.permutation(labels[a:b]) for a, b in zip(bounds, bounds[1:])])
        hits += difference(shuffled) >= observed - 1e-12
    result["p_value"] = round((1 + hits) / (1 + resamples), 4)
    return result
