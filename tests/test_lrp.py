"""Layer-wise relevance propagation: the α-β rule against closed forms worked out by hand, the analytic
Jacobians against autograd's, conservation through a whole trained model, and `--method lrp` end to end."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import SMALL_DATA, hprune
from hprune.analysis import lrp

EPS = lrp.EPS


def test_linear_layer_equals_the_closed_form_worked_by_hand():
    # y = W x + b with x = (1, -2), W = [[1, 2], [3, -1]], b = (0.5, -1), R_y = (1, 0.5). Contributions
    # z_ji = b_j / 2 + W_ji x_i: z_0 = (0.25 + 1, 0.25 - 4) = (1.25, -3.75), z_1 = (-0.5 + 3, -0.5 + 2) = (2.5, 1.5).
    # y_0 splits 0.5 · 1.25/1.25 to x_0 and 0.5 · (-3.75)/(-3.75) to x_1: (0.5, 0.5); y_1 has no negative part:
    # 0.5 · (2.5, 1.5)/4 = (0.3125, 0.1875). R_x = 1·(0.5, 0.5) + 0.5·(0.3125, 0.1875) = (0.65625, 0.59375),
    # total 1.25, rescaled to R_y's total 1.5: (0.7875, 0.7125).
    x = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64)
    bias = torch.tensor([0.5, -1.0], dtype=torch.float64)
    relevance = torch.tensor([[[1.0, 0.5]]], dtype=torch.float64)  # (seeds, positions, outputs)
    result = lrp.linear(relevance, x, weight, bias)
    torch.testing.assert_close(result, torch.tensor([[[0.7875, 0.7125]]], dtype=torch.float64), atol=1e-4, rtol=0)


def test_one_attention_head_equals_the_closed_form():
    # one query q = 1 over two keys k = (0, ln 3), values v = (2, -1), scaling 1: w = (1/4, 3/4), o = -1/4.
    # z_v = w_s v_s = (1/2, -3/4); z_k = w_s (v_s - o) q k_s = (0, 3/4 · (-3/4) · ln 3); z_q = Σ_s w_s (v_s - o) k_s q
    # = the same. One positive contribution (z_v1) takes α = 1/2; the negative ones share β = 1/2 by size.
    ln3 = math.log(3.0)
    negative = [-0.5625 * ln3, -0.5625 * ln3, -0.75]  # z_q, z_k2, z_v2
    total = sum(negative)
    expected_q, expected_k2, expected_v2 = (0.5 * z / total for z in negative)
    relevance = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    q = torch.tensor([[[1.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.0], [ln3]]], dtype=torch.float64)
    v = torch.tensor([[[2.0], [-1.0]]], dtype=torch.float64)
    rq, rk, rv = lrp.attention(relevance, q, k, v, scaling=1.0)
    assert rq.item() == pytest.approx(expected_q, abs=1e-4)
    assert rk.flatten().tolist() == pytest.approx([0.0, expected_k2], abs=1e-4)
    assert rv.flatten().tolist() == pytest.approx([0.5, expected_v2], abs=1e-4)
    assert (rq.sum() + rk.sum() + rv.sum()).item() == pytest.approx(1.0, abs=1e-4)  # conserved, to ε


def alpha_beta(relevance: torch.Tensor, jacobian: torch.Tensor, x: torch.Tensor, f_zero: torch.Tensor) -> torch.Tensor:
    """The reference's generic rule from a Jacobian (outputs, inputs), for one seed: z = f(0)/N + J x."""
    z = f_zero.view(-1, 1) / x.numel() + jacobian * x.view(1, -1)
    pos, neg = z.clamp(min=0), z.clamp(max=0)
    shares = 0.5 * pos / (pos.sum(1, keepdim=True) + EPS) + 0.5 * neg / (neg.sum(1, keepdim=True) - EPS)
    r = relevance.view(-1) @ shares
    return r * relevance.abs().sum() / (r.abs().sum() + EPS)


def test_analytic_jacobians_agree_with_autograd():
    """Layer norm (one token) and a head of attention (all its inputs): lrp's analytic Jacobians give the same
    relevance as the generic rule with autograd's Jacobian (the reference's default path)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(6, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    relevance = torch.rand(1, 1, 6, generator=gen, dtype=torch.float64)
    norm = lambda t: torch.nn.functional.layer_norm(t, (6,), weight, bias, 1e-5)  # noqa: E731
    expected = alpha_beta(relevance, torch.autograd.functional.jacobian(norm, x), x, norm(torch.zeros(6, dtype=torch.float64)))
    torch.testing.assert_close(lrp.layer_norm(relevance, x.view(1, 6), weight, bias, 1e-5).view(-1), expected)

    q, k, v = (torch.randn(1, n, 3, generator=gen, dtype=torch.float64) for n in (4, 5, 5))
    allowed = torch.rand(4, 5, generator=gen) > 0.3
    allowed[:, 0] = True
    relevance = torch.rand(1, 1, 4, 3, generator=gen, dtype=torch.float64)

    def head(flat):
        q_, k_, v_ = flat[:12].view(4, 3), flat[12:27].view(5, 3), flat[27:].view(5, 3)
        logits = 0.7 * q_ @ k_.t()
        return (torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v_).flatten()

    flat = torch.cat([q.flatten(), k.flatten(), v.flatten()])
    expected = alpha_beta(relevance, torch.autograd.functional.jacobian(head, flat), flat, head(torch.zeros_like(flat)))
    rq, rk, rv = lrp.attention(relevance, q, k, v, 0.7, allowed)
    torch.testing.assert_close(torch.cat([rq.flatten(), rk.flatten(), rv.flatten()]), expected)


def test_relevance_is_conserved_layer_by_layer_through_a_trained_model(trained_run, evaluated_run):
    """Every seed's relevance stays 1 at every block boundary, decoder and encoder, within 1e-3 (ε = 1e-5 of
    each step's normalisers, over 15 blocks); a masked head gets none, a kept head some."""
    from hprune import backend
    from hprune.analysis import relevance
    from hprune.pruning.heads import mask_without

    loaded = backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))
    loaded.model.eval()
    src, prev = next(relevance.sentences(backend.batches(loaded, "valid", 500, 1), loaded.task.target_dictionary.pad()))
    trace = relevance.propagate(loaded.model, src, prev)
    assert len(trace.totals) == 15  # 3 decoder layers x 3 blocks, 3 encoder layers x 2
    for name, total in trace.totals:
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-3, rtol=0, msg=name)
    loaded.model.set_head_mask(mask_without(loaded.model, {("enc-self", 1, 2), ("dec-enc", 0, 0)}))
    masked = relevance.propagate(loaded.model, src, prev)
    assert (masked.heads[("enc-self", 1)][:, 2] == 0).all() and (masked.heads[("dec-enc", 0)][:, 0] == 0).all()
    assert (masked.heads[("enc-self", 1)][:, [0, 1, 3]].sum(0) > 0).all()


def test_lrp_order_end_to_end(trained_run, evaluated_run, tmp_path):
    out = tmp_path / "run"
    hprune("prune", "--method", "lrp", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.step_pct=50", "prune.importance.max_batches=1", "prune.importance.normalize_by_layer=false")
    importance = pd.read_csv(out / "head_importance.csv")
    assert len(importance) == 36 and (importance["importance"] > 0).all()
    # the shares of one attention sublayer's heads are part of the relevance passing that layer: below 1
    per_layer = importance.groupby(["type", "layer"])["importance"].sum()
    assert (per_layer < 1).all()
    curve = pd.read_csv(out / "curve.csv")
    assert list(curve["heads_pruned"]) == [0, 18]
    assert json.loads((out / "metrics.json").read_text())["method"] == "lrp"
