"""The role-survival test (Voita et al.'s finding) on constructed masks: exact p-values by hand."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from hprune.analysis.survival import permutation_p, pooled_survival_test, role_survival_test, survival, sweep_masks


def roles_of(flags):
    return pd.DataFrame({"type": "enc-self", "layer": 0, "head": range(len(flags)), "positional": flags,
                         "syntactic": [None] * len(flags)})


def test_exact_p_of_a_hand_worked_case():
    """Survival (0, 1, 2, 3), heads 2 and 3 with a role: difference (2+3)/2 - (0+1)/2 = 2, the largest of the
    6 ways to choose 2 of 4 heads: p = 1/6. Heads 0 and 3 instead: (0+3)/2 - (1+2)/2 = 0, matched or beaten by
    4 of the 6 labellings ({2,3}, {1,3}, {0,3}, {1,2}): p = 4/6."""
    values = np.array([0.0, 1.0, 2.0, 3.0])
    assert permutation_p(values, np.array([False, False, True, True]), 0, 0) == pytest.approx(1 / 6)
    assert permutation_p(values, np.array([True, False, False, True]), 0, 0) == pytest.approx(4 / 6)


def test_role_heads_that_stay_open_longer_are_found_and_random_ones_are_not():
    lambdas = [0.0, 0.5, 1.0, 2.0, 4.0]
    open_until = [4, 4, 4, 3, 1, 1, 0, 0, 0, 1, 0, 2]  # of the four λ > 0, how many keep the head open
    masks = {lam: {"enc-self": [[int(open_until[h] > i - 1 if lam > 0 else 1) for h in range(12)]]}
             for i, lam in enumerate(lambdas)}
    heads = [("enc-self", 0, h) for h in range(12)]
    assert survival(masks, heads).tolist() == open_until
    found = role_survival_test(roles_of([True] * 4 + [False] * 8), masks, ["positional", "syntactic", "rare"])
    assert (found["role_heads"], found["other_heads"], found["lambdas"]) == (4, 8, [0.5, 1.0, 2.0, 4.0])
    assert found["mean_open_role"] == 3.75 and found["mean_open_other"] == 0.625
    assert found["p_value"] < 0.01  # 495 labellings: only the observed one reaches 3.125
    shuffled = role_survival_test(roles_of([False, True, False, False, False, False, True, False, True, False,
                                            True, False]), masks, ["positional"])
    assert shuffled["p_value"] > 0.5
    nothing = role_survival_test(roles_of([False] * 12), masks, ["positional"])
    assert nothing["p_value"] is None and nothing["role_heads"] == 0


def test_many_heads_fall_back_to_random_labellings():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 4, size=60).astype(float)
    labels = np.zeros(60, bool)
    labels[:20] = True
    values[:20] += 2  # the role heads survive longer
    assert permutation_p(values, labels, 2000, 1) <= 1 / 2001 + 1e-12  # C(60, 20) labellings: sampled


def test_pooled_test_permutes_within_each_model():
    """Model A: survival (0, 1), head 1 has the role; model B: (2, 3), head 3. Within-model relabellings are 4,
    of which only the observed one reaches its difference (1+3)/2 - (0+2)/2 = 1: p = 1/4. Pooling the heads
    without strata would also count {2, 3} (difference 2): 2/6."""
    def study(open_until, flags):
        lambdas = [1.0, 2.0, 4.0]
        masks = {lam: {"enc-self": [[int(o > i) for o in open_until]]} for i, lam in enumerate(lambdas)}
        return roles_of(flags), masks

    studies = [study([0, 1], [False, True]), study([2, 3], [False, True])]
    found = pooled_survival_test(studies, ["positional"], resamples=20_000, seed=3)
    assert (found["models"], found["role_heads"], found["other_heads"]) == (2, 2, 2)
    assert (found["mean_open_role"], found["mean_open_other"], found["difference"]) == (2.0, 1.0, 1.0)
    assert found["p_value"] == pytest.approx(0.25, abs=0.015)
    assert pooled_survival_test([study([0, 1], [False, False])], ["positional"])["p_value"] is None


def test_a_sweeps_masks_are_read_by_lambda_unfinished_jobs_left_out(tmp_path):
    for job, lam in enumerate((0.0, 2.0, 1.0, 4.0)):
        run = tmp_path / str(job)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("verb: prune\n")
        (run / "head_mask.json").write_text(json.dumps({"enc-self": [[1, job % 2]]}))
        if job != 3:  # the last job did not finish
            (run / "metrics.json").write_text(json.dumps({"l0_lambda": lam}))
    masks = sweep_masks(tmp_path)
    assert masks == {0.0: {"enc-self": [[1, 0]]}, 2.0: {"enc-self": [[1, 1]]}, 1.0: {"enc-self": [[1, 0]]}}
