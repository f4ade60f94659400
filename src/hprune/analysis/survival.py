"""Voita et al.'s finding as a test: do heads with a role survive the L0 penalty longer than heads without one?

Input: the head roles of the start model (`hprune analyze`'s head_roles.csv) and the head masks of a λ sweep
of Voita's gates on the same model. A head's survival is the number of the sweep's λ > 0 at which it stays open
(masks need not be nested from one λ to the next, so no single "closing λ" is assumed). The statistic is the
mean survival of the heads with a role minus that of the gated heads without one. Its p-value (one-sided: role
heads survive longer) comes from a permutation test of the role labels over the gated heads, exact (every
labelling) when there are at most EXACT_LIMIT labellings, else from `resamples` random ones.
"""
from __future__ import annotations

from itertools import combinations
from math import comb
from typing import Dict, List, Sequence

import numpy as np
import pandas as pd

EXACT_LIMIT = 200_000


def survival(masks: Dict[float, dict], heads: Sequence[tuple]) -> np.ndarray:
    """For each (type, layer, head): at how many of the masks' λ > 0 it is open."""
    kept = [mask for lam, mask in sorted(masks.items()) if lam > 0]
    return np.array([sum(int(bool(mask[kind][layer][head])) for mask in kept) for kind, layer, head in heads])


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


def role_survival_test(roles: pd.DataFrame, masks: Dict[float, dict], role_columns: List[str],
                       resamples: int = 10_000, seed: int = 12345) -> dict:
    """roles: head_roles.csv rows of the gated heads' types; masks: {λ: head mask} of the sweep. The heads
    tested are those a mask of the sweep can close: the types the masks gate (any mask with a 0 there, or
    the rows given)."""
    heads = list(roles[["type", "layer", "head"]].itertuples(index=False, name=None))
    columns = [c for c in role_columns if c in roles]
    has_role = roles[columns].fillna(False).astype(bool).any(axis=1).to_numpy() if columns else np.zeros(len(roles), bool)
    open_at = survival(masks, heads)
    result = {"lambdas": sorted(lam for lam in masks if lam > 0), "role_heads": int(has_role.sum()),
              "other_heads": int((~has_role).sum()), "mean_open_role": None, "mean_open_other": None,
              "difference": None, "p_value": None}
    if not has_role.any() or has_role.all():
        return result  # nothing to compare
    result.update(mean_open_role=round(float(open_at[has_role].mean()), 4),
                  mean_open_other=round(float(open_at[~has_role].mean()), 4))
    result["difference"] = round(result["mean_open_role"] - result["mean_open_other"], 4)
    result["p_value"] = round(permutation_p(open_at.astype(float), has_role, resamples, seed), 4)
    return result
