"""MoA models through the CLI: train -> eval (costs, expert load) -> Michel and Voita expert pruning with
export, and the answers to bad MoA settings."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from conftest import SMALL_DATA, SMALL_TRAIN, hprune, shared
from test_cli import assert_one_line_error

pytest.importorskip("fairseq")
MOA = ["model=moa_tiny"]


@pytest.fixture(scope="session")
def moa_run(tmp_path_factory, data_root):
    return shared(tmp_path_factory, "moa", lambda run: hprune("train", f"hydra.run.dir={run}", *SMALL_TRAIN, *MOA))


def test_train_eval_and_expert_pruning_end_to_end(moa_run, evaluated_run, tmp_path):
    train = json.loads((moa_run / "metrics.json").read_text())
    assert train["arch"] == "hprune_moa" and train["heads"]["enc-self"] == [8, 8, 8]  # experts per layer
    assert "moa_aux" in (moa_run / "train.log").read_text()  # the criterion added and logged the losses

    hprune("eval", f"ckpt={moa_run}", f"hydra.run.dir={tmp_path / 'eval'}", *SMALL_DATA, "device=cpu")
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert (metrics["moa_experts"], metrics["moa_top_k"], metrics["moa_head_dim"]) == (8, 4, 24)
    load = pd.read_csv(tmp_path / "eval" / "expert_load.csv")
    assert len(load) == 9 * 8  # 3 types x 3 layers x 8 experts
    assert load.groupby(["type", "layer"])["share"].sum().to_numpy() == pytest.approx(1.0)
    assert metrics["expert_share_min"] == pytest.approx(load["share"].min(), abs=1e-4)
    assert 0 < metrics["router_entropy"] <= 2.0795  # at most log 8
    # moa_tiny is sized to the dense tiny model's attention MACs (per token, counted: see test_moa)
    dense = evaluated_run[1]
    assert metrics["attention_macs_per_token"] == pytest.approx(dense["attention_macs_per_token"], rel=0.05)
    assert metrics["macs_per_token"] > metrics["attention_macs_per_token"]
    assert "expert_load_cv" not in dense

    out = tmp_path / "prune"
    hprune("prune", "--method", "michel", f"ckpt={moa_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.target_pct=50", "prune.baselines=[magnitude]", "prune.export=true")  # magnitude's expert rule
    pruned = json.loads((out / "metrics.json").read_text())
    importance = pd.read_csv(out / "head_importance.csv")
    assert len(importance) == 72 and (importance["importance"] > 0).sum() > 36  # experts, scored by gradients
    mask = json.loads((out / "head_mask.json").read_text())
    assert sum(map(sum, (row for rows in mask.values() for row in rows))) == 36
    # experts physically removed: fewer parameters, the same translations as the masked model
    assert pruned["export_same_translations"] and pruned["export_max_abs_diff"] < 1e-4
    assert pruned["n_params_pruned"] < pruned["n_params"]
    hprune("eval", f"ckpt={out / 'checkpoints' / 'checkpoint_pruned.pt'}", f"hydra.run.dir={out / 'eval'}",
           *SMALL_DATA, "device=cpu")
    evaluation = json.loads((out / "eval" / "metrics.json").read_text())
    assert evaluation["bleu"] == pruned["export_bleu"] and evaluation["n_params"] == pruned["n_params_pruned"]


@pytest.mark.slow  # 52 s (gates that converge to the budget); fisher, DSP and LRP on experts stay in `make test`
def test_voita_gates_on_experts_fold_into_the_same_translations_and_export(moa_run, tmp_path):
    """Hard Concrete gates on the 24 enc-self experts with a head budget: a closed gate is an expert out of the
    router, so the read-out (gates folded into W_o, closed experts masked) translates as the gated model does,
    and the physically pruned export as the masked one."""
    out = tmp_path / "voita"
    hprune("prune", "--method", "voita", f"ckpt={moa_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.head_budget=12", "prune.optim.max_update=200", "prune.optim.lr=0.02", "prune.budget_warmup=100",
           "prune.optim.warmup_updates=0", "prune.optim.log_interval=20", "prune.export=true")
    metrics = json.loads((out / "metrics.json").read_text())
    gates = pd.read_csv(out / "gates.csv")
    assert len(gates) == 24 and metrics["heads_pool"] == 24
    assert metrics["kept_heads"] == 12 and gates["kept"].sum() == 12  # the exact budget read-out
    assert metrics["bleu"] == metrics["bleu_gates"]
    assert metrics["export_same_translations"] and metrics["export_max_abs_diff"] < 1e-4
    assert metrics["n_params_pruned"] < metrics["n_params"]


@pytest.mark.parametrize("extra, expected", [
    (["model.moa_top_k=9"], "model.moa_top_k=9 must be between 1 and model.moa_experts=8"),
    (["model.moa_types=[enc-self,cross]"], "unknown attention type(s) ['cross']"),
    (["model.moa_types=[]"], "names no attention type"),
    (["model.moa_head_dim=0"], "model.moa_head_dim=0 must be a positive"),
    (["optim.criterion=label_smoothed_cross_entropy"], "would drop MoA's auxiliary losses"),
    (["model.moa_types=[dec-enc]", "model.encoder_attention_heads=5"],
     "model.encoder_embed_dim=64 is not divisible by model.encoder_attention_heads=5"),
])
def test_bad_moa_settings(tmp_path, extra, expected):
    proc = hprune("train", f"hydra.run.dir={tmp_path}", *SMALL_TRAIN, *MOA, *extra, check=False)
    assert_one_line_error(proc, expected)
    assert not (tmp_path / "checkpoints").exists()


def test_moa_option_on_a_dense_model(tmp_path):
    proc = hprune("train", f"hydra.run.dir={tmp_path}", *SMALL_TRAIN, "+model.moa_experts=8", check=False)
    assert_one_line_error(proc, "model.moa_experts is a MoA option but model.arch=hprune_transformer")


def test_methods_that_need_head_maps_refuse_moa(moa_run, tmp_path):
    proc = hprune("prune", "--method", "confidence", f"ckpt={moa_run}", f"hydra.run.dir={tmp_path / 'c'}",
                  *SMALL_DATA, "device=cpu", check=False)
    assert_one_line_error(proc, "confidence needs per-head attention maps")
    proc = hprune("analyze", f"ckpt={moa_run}", f"hydra.run.dir={tmp_path / 'a'}", *SMALL_DATA, "device=cpu",
                  check=False)
    assert_one_line_error(proc, "head roles need per-head attention maps")


@pytest.mark.slow
def test_moa_tiny_within_two_bleu_of_the_dense_tiny_model(tmp_path):
    """The issue's claim on the synthetic task, with `make demo`'s recipe for both models: moa_tiny (k=4 of 8
    experts of 24) against the dense model of equal MACs, transformer_tiny (4 heads of 16)."""
    results = {}
    for model in ("transformer_tiny", "moa_tiny"):
        run = tmp_path / model
        hprune("train", f"hydra.run.dir={run}", f"model={model}", "device=cpu", timeout=1200)
        hprune("eval", f"ckpt={run}", f"hydra.run.dir={run / 'eval'}", "device=cpu")
        results[model] = json.loads((run / "eval" / "metrics.json").read_text())
    dense, moa = results["transformer_tiny"], results["moa_tiny"]
    assert moa["attention_macs_per_token"] == pytest.approx(dense["attention_macs_per_token"], rel=0.05)
    assert moa["bleu"] >= dense["bleu"] - 2, (moa["bleu"], dense["bleu"])


def test_lrp_through_moa_layers_conserves_relevance_and_ranks_experts(moa_run, evaluated_run, tmp_path):
    """LRP through MoA layers (router weights held constant): relevance conserved at every block, every expert
    that tokens were routed to gets some; `--method lrp` ranks the 72 experts."""
    import torch

    from hprune import backend
    from hprune.analysis import relevance

    loaded = backend.load_model(moa_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))
    loaded.model.eval()
    src, prev = next(relevance.sentences(backend.batches(loaded, "valid", 500, 1), loaded.task.target_dictionary.pad()))
    trace = relevance.propagate(loaded.model, src, prev)
    for name, total in trace.totals:
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-3, rtol=0, msg=name)
    assert all(units.shape[1] == 8 for units in trace.heads.values())
    out = tmp_path / "lrp"
    hprune("prune", "--method", "lrp", f"ckpt={moa_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.step_pct=50", "prune.importance.max_batches=1")
    importance = pd.read_csv(out / "head_importance.csv")
    assert len(importance) == 72 and (importance["importance"] > 0).sum() > 36


def test_fisher_and_dsp_on_experts(moa_run, tmp_path):
    """Experts are heads to both: Kwon et al.'s search meets its budget in MACs counted on the exported MoA model
    (a pruned expert saves only once fewer than k remain), and DSP keeps exactly K experts."""
    out = tmp_path / "fisher"
    hprune("prune", "--method", "fisher", f"ckpt={moa_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.calibration.sentences=128", "prune.macs_budget=0.7")
    fisher = json.loads((out / "metrics.json").read_text())
    counted = fisher["attention_macs_per_token_pruned"] / fisher["attention_macs_per_token_unpruned"]
    assert counted == pytest.approx(fisher["attention_macs_pct"] / 100, abs=0.01) and counted <= 0.7 + 0.01
    assert fisher["export_same_translations"] and fisher["heads_pool"] == 72
    out = tmp_path / "dsp"
    hprune("prune", "--method", "dsp", f"ckpt={moa_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.head_budget=36", "prune.optim.max_update=20", "prune.cooldown=10", "prune.optim.max_tokens=2048")
    dsp = json.loads((out / "metrics.json").read_text())
    assert dsp["kept_heads"] == 36 and dsp["bleu"] == dsp["bleu_selector"]
