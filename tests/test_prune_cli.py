"""`hprune prune` end to end through the CLI, and its answers to bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from conftest import SMALL_DATA, hprune
from test_cli import assert_one_line_error

pytest.importorskip("fairseq")
TYPES = ("enc-self", "dec-self", "dec-enc")


@pytest.fixture(scope="session")
def pruned_run(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("prune") / "run"
    started = time.perf_counter()
    proc = hprune("prune", "--method", "michel", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA,
                  "device=cpu", "prune.ablations=[single,one_head]", "prune.baselines=[random]",
                  "prune.export=true", "significance.resamples=1000", subprocess=True)  # the verb as its own process
    return out, time.perf_counter() - started, proc.stdout


def test_curve_ablations_and_export_end_to_end(pruned_run, evaluated_run):
    out, seconds, stdout = pruned_run
    # the curve and both ablations (45 + 9 BLEU evaluations), plus a baseline order (confidence and magnitude, the
    # other head-level orders: test_hf_multilingual, test_api) and the export
    assert seconds < 120, seconds  # the goal: curve and both ablations within 2 minutes
    metrics = json.loads((out / "metrics.json").read_text())
    curve = pd.read_csv(out / "curve.csv")
    assert list(curve["order"].unique()) == ["michel", "random"]
    michel = curve[curve["order"] == "michel"]
    assert list(michel["pct_target"]) == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert list(michel["heads_pruned"]) == [0, 4, 8, 11, 15, 18, 22, 26, 29, 33]  # ceil(36 * pct / 100)
    kept = michel[["kept_enc_self", "kept_dec_self", "kept_dec_enc"]].sum(axis=1)
    assert list(kept) == [36 - n for n in michel["heads_pruned"]]
    # 0 % pruned is the unpruned model: exactly `hprune eval`'s BLEU
    assert michel["bleu"].iloc[0] == evaluated_run[1]["bleu"] == metrics["bleu_unpruned"]
    assert michel["bleu"].iloc[-1] < michel["bleu"].iloc[0]
    assert "| order | heads_pruned |" in " ".join((out / "curve.md").read_text().split())
    assert "| michel | 0 |" in " ".join(stdout.split())

    # significance: each point against the unpruned model, each baseline point against michel's at that step,
    # from the translations written for every point; recomputed here with sacreBLEU's own command line
    assert len(list((out / "hypotheses").glob("*.txt"))) == 20 and curve.loc[curve["step"] == 0, "p_vs_unpruned"].isna().all()
    refs = Path(evaluated_run[1]["data_bin"]).parent / "raw" / "test.tgt"
    for order, against, column in (("michel", "michel.0", "p_vs_unpruned"), ("random", "michel.5", "p_vs_method")):
        cli = subprocess.run([str(Path(sys.executable).with_name("sacrebleu")), str(refs), "-i",
                              str(out / "hypotheses" / f"{against}.txt"), str(out / "hypotheses" / f"{order}.5.txt"),
                              "--paired-bs", "--paired-bs-n", "1000", "-f", "json"], capture_output=True, text=True,
                             env={**os.environ, "SACREBLEU_SEED": "12345"}, check=True)
        row = curve[(curve["order"] == order) & (curve["step"] == 5)].iloc[0]
        assert row[column] == pytest.approx(json.loads(cli.stdout)[1]["BLEU"]["p_value"], abs=1e-4), order
    assert curve.loc[curve["order"] == "michel", "p_vs_method"].isna().all()
    assert bool(curve[curve["order"] == "michel"].iloc[-1]["significant_vs_unpruned"])  # 90 % pruned: a real loss

    importance = pd.read_csv(out / "head_importance.csv")
    assert len(importance) == 36 and sorted(importance["rank"]) == list(range(1, 37))
    assert set(importance.columns) >= {"type", "layer", "head", "id", "importance", "rank"}
    norms = importance.groupby(["type", "layer"])["importance"].apply(lambda s: (s ** 2).sum())
    assert norms.to_numpy() == pytest.approx(1.0)

    single = pd.read_csv(out / "ablation_single.csv")
    assert len(single) == 36 and set(single["type"]) == set(TYPES)
    assert (single["delta_bleu"] == (single["bleu"] - metrics["bleu_unpruned"]).round(4)).all()
    one_head = pd.read_csv(out / "ablation_one_head.csv")
    assert len(one_head) == 9 and (one_head["heads_removed"] == 3).all()
    top = importance.loc[importance.groupby(["type", "layer"])["importance"].idxmax()]
    assert sorted(zip(top["type"], top["layer"], top["head"])) == sorted(
        zip(one_head["type"], one_head["layer"], one_head["kept_head"]))

    mask = json.loads((out / "head_mask.json").read_text())
    assert set(mask) == set(TYPES) and all(len(rows) == 3 and all(len(r) == 4 for r in rows) for rows in mask.values())
    chosen = michel[michel["pct_pruned"] == metrics["pct_pruned"]].iloc[0]
    assert sum(map(sum, (r for rows in mask.values() for r in rows))) == 36 - chosen["heads_pruned"]
    assert chosen["delta_bleu"] >= -1.0 and metrics["bleu"] == chosen["bleu"]
    assert metrics["export_same_translations"] and metrics["export_bleu"] == metrics["bleu"]
    assert metrics["export_max_abs_diff"] < 1e-4
    assert (metrics["n_params_pruned"] < metrics["n_params"]) == (chosen["heads_pruned"] > 0)
    # `hprune eval` on the pruned checkpoint: the same BLEU, the heads of head_mask.json
    hprune("eval", f"ckpt={out / 'checkpoints' / 'checkpoint_pruned.pt'}", f"hydra.run.dir={out / 'eval'}",
           *SMALL_DATA, "device=cpu")
    evaluation = json.loads((out / "eval" / "metrics.json").read_text())
    assert evaluation["bleu"] == metrics["export_bleu"] and evaluation["n_params"] == metrics["n_params_pruned"]
    assert [evaluation[f"kept_{k.replace('-', '_')}"] for k in TYPES] == [sum(map(sum, mask[k])) for k in TYPES]
    for plot in ("curve.png", "head_importance.png"):
        assert (out / plot).stat().st_size > 10_000


def test_target_percentage_and_reestimation(trained_run, tmp_path):
    out = tmp_path / "run"
    hprune("prune", "--method=michel", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.step_pct=50", "prune.target_pct=25", "prune.reestimate=true", "prune.min_heads_per_layer=1",
           "prune.types=[enc-self,dec-self]")
    metrics = json.loads((out / "metrics.json").read_text())
    curve = pd.read_csv(out / "curve.csv")
    assert list(curve["pct_target"]) == [0, 25, 50]
    assert list(curve["heads_pruned"]) == [0, 6, 12]  # of the 24 enc-self and dec-self heads
    assert (curve["kept_dec_enc"] == 12).all()
    assert metrics["pct_pruned"] == 25 and metrics["kept_dec_enc"] == 12
    mask = json.loads((out / "head_mask.json").read_text())
    assert all(sum(row) >= 1 for kind in ("enc-self", "dec-self") for row in mask[kind])


def test_finetuned_curve_is_measured_against_its_finetuning_control(trained_run, evaluated_run, tmp_path):
    """With fine-tuning between steps, every pruned point has a control: the unpruned model fine-tuned the same
    way (same updates, learning rate, batch order). It is the same for every order, and it is exactly what
    fine-tuning the unpruned checkpoint by hand gives."""
    from hprune import backend
    from hprune.evaluation import score

    out = tmp_path / "run"
    hprune("prune", "--method=michel", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.step_pct=50", "prune.baselines=[random]", "prune.finetune.updates=3", "prune.finetune.lr=1e-3",
           "significance.resamples=100")
    curve = pd.read_csv(out / "curve.csv").set_index(["order", "step"])
    assert curve["bleu_control"].isna().tolist() == [True, False, True, False]  # step 0 is not fine-tuned
    assert curve.loc[("michel", 1), "bleu_control"] == curve.loc[("random", 1), "bleu_control"]
    row = curve.loc[("michel", 1)]
    assert row["delta_bleu_control"] == pytest.approx(row["bleu"] - row["bleu_control"], abs=1e-3)
    assert 0 <= row["p_vs_control"] <= 1
    loaded = backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))
    backend.finetune(loaded, backend.build_criterion(loaded), updates=3, lr=1e-3, max_tokens=4096, seed=1 + 1)
    generation = OmegaConf.load(out / ".hydra" / "config.yaml").generation
    hypotheses = backend.translate(loaded, generation, "test", 1, "subword_nmt").hypotheses
    assert (out / "hypotheses" / "control.1.txt").read_text().splitlines() == hypotheses
    references = (out / "references.txt").read_text().splitlines()
    assert score(hypotheses, references).bleu == row["bleu_control"]


def is_per_stack(mask: dict) -> bool:
    """Every encoder layer keeps one number of heads; every decoder layer another, in self- and cross-attention."""
    encoder = {sum(row) for row in mask["enc-self"]}
    decoder = {sum(row) for kind in ("dec-self", "dec-enc") for row in mask[kind]}
    return len(encoder) == 1 and len(decoder) == 1


def test_per_stack_layout_prunes_whole_levels_and_exports_without_padding(trained_run, tmp_path):
    """3 encoder layers and 3 decoder layers (self + cross) of 4 heads: a level is 3 encoder or 6 decoder heads.
    Every step is a per_stack mask that prunes at least the step's share (9, 18, 27 of the 36 heads), at most a
    level more (cumulative: a step cannot give back what the last one pruned); its CTranslate2 export needs no
    padding: all of the pruning survives there."""
    out = tmp_path / "run"
    hprune("prune", "--method=michel", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.step_pct=25", "prune.target_pct=50", "prune.layout=per_stack", "prune.baselines=[magnitude]")
    metrics = json.loads((out / "metrics.json").read_text())
    curve = pd.read_csv(out / "curve.csv")
    assert (curve["layout"] == "per_stack").all() and metrics["layout"] == "per_stack"
    for order, points in curve.groupby("order"):
        assert all(n <= pruned < n + 6 for n, pruned in zip([0, 9, 18, 27], points["heads_pruned"])), order
        assert (points["kept_enc_self"] % 3 == 0).all() and (points["kept_dec_self"] == points["kept_dec_enc"]).all()
        assert (points["kept_dec_self"] % 3 == 0).all() and (points["kept_dec_self"] >= 3).all()
    mask = json.loads((out / "head_mask.json").read_text())
    assert is_per_stack(mask) and 50 <= metrics["pct_pruned"] < 50 + 100 * 6 / 36
    pytest.importorskip("ctranslate2")
    hprune("export", f"ckpt={trained_run}", f"mask={out / 'head_mask.json'}", f"hydra.run.dir={tmp_path / 'ct2'}",
           *SMALL_DATA, "device=cpu")
    exported = json.loads((tmp_path / "ct2" / "metrics.json").read_text())
    assert exported["attention_macs_pct_ctranslate2"] == exported["attention_macs_pct_mask"] < 100
    assert exported["ctranslate2_encoder_heads"] == sum(mask["enc-self"][0])
    assert exported["speedup_ctranslate2_fixed_length"] > 0 and exported["decoding_length_fixed"] > 1


def run_error(trained_run, tmp_path, *extra, ckpt=None):
    out = tmp_path / "run"
    proc = hprune("prune", f"ckpt={ckpt or trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", *extra,
                  check=False)
    # nothing half-written: no result file of any kind
    assert not [p.name for p in out.glob("*") if p.name not in (".hydra", "prune.log")]
    return proc


@pytest.mark.parametrize("extra,expected", [
    (["prune.step_pct=0"], "prune.step_pct=0 is outside (0, 100]"),
    (["prune.step_pct=150"], "prune.step_pct=150 is outside (0, 100]"),
    (["prune.target_pct=150"], "cannot prune more heads than exist"),
    (["prune.min_heads_per_layer=4"], "is more than can be pruned with prune.min_heads_per_layer=4"),
    (["prune.importance.split=nosuch"], "nosuch.src-tgt.src.bin is missing"),
    (["prune.importance.max_batches=0"], "leaves no data to score heads on"),
    (["prune.types=[enc-self,cross]"], "unknown attention type(s) ['cross']"),
    (["prune.baselines=[voita]"], "unknown pruning order 'voita'"),
    (["prune.layout=stacked"], "prune.layout=stacked is not a layout"),
    (["prune.layout=per_stack", "prune.types=[enc-self,dec-enc]"], "add dec-self to prune.types"),
    (["prune.layout=per_stack", "prune.step_pct=80"], "and prune.layout=per_stack"),
])
def test_bad_settings(trained_run, tmp_path, extra, expected):
    assert_one_line_error(run_error(trained_run, tmp_path, *extra), expected)


def test_checkpoint_that_is_not_an_hprune_model(trained_run, tmp_path):
    import torch
    state = torch.load(trained_run / "checkpoints" / "checkpoint_best.pt", weights_only=False)
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = "lstm"
    torch.save(state, tmp_path / "lstm.pt")
    assert_one_line_error(run_error(trained_run, tmp_path, ckpt=tmp_path / "lstm.pt"), "'lstm' model, which hprune cannot run")


def test_method_sugar():
    proc = hprune("prune", "--method", "random", "ckpt=x", "--cfg", "job")
    assert "method: random" in proc.stdout and "step_pct: 10" in proc.stdout
    # flags after overrides (`-m` after `--method voita ckpt=...`, as the README writes sweeps) still parse
    from hprune_cli.main import _desugar
    assert _desugar("prune", ["--method", "voita", "ckpt=x", "-m", "prune.l0_lambda=0,0.1", "--cfg", "job"]) == [
        "-m", "--cfg", "job", "prune=voita", "ckpt=x", "prune.l0_lambda=0,0.1"]
    assert_one_line_error(hprune("prune", "--method", "nope", "ckpt=x", check=False), "unknown prune 'nope'",
                          "michel")
    assert_one_line_error(hprune("prune", "--method", check=False), "--method needs a value")
