"""Differentiable Subset Pruning: the relaxed top-K against its closed-form properties, the temperature
schedule, gradients, and `--method dsp` end to end (exactly K heads), with its answers to bad input."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import SMALL_DATA, hprune
from test_cli import assert_one_line_error

pytest.importorskip("fairseq")
from hprune_fairseq.mechanisms.subset import SubsetSelector, hard_top_k, soft_top_k  # noqa: E402


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("temperature", [10.0, 1.0, 0.1])
def test_relaxed_top_k_sums_to_k(k, temperature):
    scores = torch.randn(12, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    mask = soft_top_k(scores, k, temperature)
    assert mask.sum().item() == pytest.approx(k, abs=1e-9) and (mask >= 0).all()


def test_at_low_temperature_it_is_the_hard_top_k_and_gradients_reach_the_logits():
    scores = torch.tensor([0.3, -1.2, 2.0, 0.9, 0.31, -0.4], dtype=torch.float64)
    torch.testing.assert_close(soft_top_k(scores, 3, 1e-4), hard_top_k(scores, 3))
    assert hard_top_k(scores, 3).tolist() == [0, 0, 1, 1, 1, 0]  # 2.0, 0.9, 0.31
    logits = scores.clone().requires_grad_(True)
    (soft_top_k(logits, 3, 0.5) * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    assert logits.grad.abs().min() > 0  # every logit moves the mask at a moderate temperature


def test_temperature_falls_log_linearly_and_the_selector_keeps_exactly_k():
    selector = SubsetSelector(count=8, k=3, temperature=(0.1, 1e-8), cooldown=100, logit_scale=2.0)
    assert selector.temperature() == pytest.approx(0.1)
    selector.step.fill_(50)
    assert selector.temperature() == pytest.approx(math.sqrt(0.1 * 1e-8))  # halfway in log space
    selector.step.fill_(100)
    assert selector.temperature() == 1e-8
    selector.step.fill_(0)
    selector.train()
    mask = selector.sample()  # at τ = 0.1: soft, so gradients reach every logit
    assert mask.sum().item() == pytest.approx(3, abs=1e-6)
    selector.set_num_updates(7)  # fairseq's update count, set before each training batch
    assert int(selector.step) == 7
    mask.pow(2).sum().backward()
    assert selector.theta.grad is not None and selector.theta.grad.abs().sum() > 0
    selector.eval()
    assert selector.deterministic().sum() == 3 and set(selector.deterministic().unique().tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(selector.deterministic(), hard_top_k(selector.theta.detach() * 2.0, 3))
    # straight through: the hard mask forward, the gradient passed to the logits unchanged
    ste = SubsetSelector(count=5, k=2, straight_through=True).train()
    (ste.sample() * torch.arange(5.0)).sum().backward()
    torch.testing.assert_close(ste.theta.grad, torch.arange(5.0) * ste.logit_scale)
    # K = every head: the control selects nothing
    everything = SubsetSelector(count=4, k=4).train()
    assert everything.sample().tolist() == [1.0] * 4 and everything.deterministic().tolist() == [1.0] * 4


def test_dsp_keeps_exactly_k_heads_end_to_end(trained_run, tmp_path):
    out = tmp_path / "run"
    hprune("prune", "--method", "dsp", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.head_budget=10", "prune.optim.max_update=30", "prune.cooldown=20", "prune.optim.max_tokens=2048",
           "prune.export=true")
    metrics = json.loads((out / "metrics.json").read_text())
    logits = pd.read_csv(out / "dsp_logits.csv")
    mask = json.loads((out / "head_mask.json").read_text())
    assert metrics["kept_heads"] == 10 == logits["kept"].sum() == sum(sum(map(sum, rows)) for rows in mask.values())
    assert set(logits.nlargest(10, "logit")[["type", "layer", "head"]].itertuples(index=False, name=None)) == \
        set(logits[logits["kept"] == 1][["type", "layer", "head"]].itertuples(index=False, name=None))
    assert metrics["bleu"] == metrics["bleu_selector"]  # the selection folded into the weights: same translations
    assert metrics["export_same_translations"] and metrics["export_max_abs_diff"] < 1e-4
    assert not metrics["control"] and metrics["pct_pruned"] == pytest.approx(100 * 26 / 36, abs=0.01)
    assert 0 < metrics["attention_macs_pct"] < 100 and metrics["macs_removed_pct"] > 0


def test_per_stack_read_out_and_the_selecting_checkpoint_exported_directly(trained_run, tmp_path):
    """prune.layout=per_stack reads out at most K heads in a layout CTranslate2 holds (K = 10 of 3 encoder
    layers and 3 decoder layers of 4 heads: 1 per encoder layer and 1 per decoder sublayer, 9); `hprune export`
    of the selecting checkpoint with that head_mask.json folds the selection as the run did."""
    pytest.importorskip("ctranslate2")
    from hprune import backend
    from test_export import largest_log_prob_difference
    out = tmp_path / "run"
    hprune("prune", "--method", "dsp", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.head_budget=10", "prune.optim.max_update=20", "prune.cooldown=10", "prune.optim.max_tokens=2048",
           "prune.export=true", "prune.layout=per_stack")
    metrics = json.loads((out / "metrics.json").read_text())
    logits = pd.read_csv(out / "dsp_logits.csv")
    assert metrics["layout"] == "per_stack" and logits["kept_free"].sum() == 10 and logits["kept"].sum() == 9
    assert (metrics["kept_enc_self"], metrics["kept_dec_self"], metrics["kept_dec_enc"]) == (3, 3, 3)
    for (kind, layer), heads in logits.groupby(["type", "layer"]):  # each sublayer keeps its highest logit
        assert heads.loc[heads["kept"] == 1, "logit"].item() == heads["logit"].max()
    assert metrics["export_same_translations"] and metrics["export_max_abs_diff"] < 1e-4

    export = tmp_path / "ct2"
    hprune("export", f"ckpt={out / 'checkpoints' / 'checkpoint_last.pt'}", f"mask={out / 'head_mask.json'}",
           f"hydra.run.dir={export}", *SMALL_DATA, "device=cpu")
    exported = json.loads((export / "metrics.json").read_text())
    assert (exported["ctranslate2_encoder_heads"], exported["ctranslate2_decoder_heads"]) == (1, 1)
    assert exported["attention_macs_pct_ctranslate2"] == exported["attention_macs_pct_mask"]  # no padding
    folded = backend.load_model(out / "checkpoints" / "checkpoint_pruned.pt", Path(metrics["data_bin"]))
    assert largest_log_prob_difference(folded, export / "ctranslate2", "valid", None) < 1e-4


@pytest.mark.parametrize("extra,expected", [
    (["prune.head_budget=37"], "prune.head_budget=37 is more heads than"),
    (["prune.head_budget=0"], "prune.head_budget=0: DSP keeps exactly K heads"),
    (["prune.head_budget=4", "prune.optim.lr_scheduler=inverse_sqrt"], "use prune.optim.lr_scheduler=fixed"),
    (["prune.head_budget=4", "prune.temperature=[0.1,0]"], "must be two temperatures > 0"),
])
def test_bad_settings(trained_run, tmp_path, extra, expected):
    out = tmp_path / "run"
    proc = hprune("prune", "--method", "dsp", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA,
                  "device=cpu", *extra, check=False)
    assert_one_line_error(proc, expected)
    assert not (out / "metrics.json").exists() and not (out / "checkpoints").exists()


def test_missing_head_budget_is_one_line(trained_run, tmp_path):
    proc = hprune("prune", "--method", "dsp", f"ckpt={trained_run}", f"hydra.run.dir={tmp_path}", *SMALL_DATA,
                  "device=cpu", check=False)
    assert_one_line_error(proc, "prune.head_budget is not set")
