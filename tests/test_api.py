"""hprune as a library (hprune.api, docs/api.md): what a notebook gets from `hprune.open` is what the CLI's verbs
write, checked against the CLI's own runs on the same model (the verbs call the same methods, so these pin the
settings' composition and the typed results, not a second copy of the work)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import hprune
from conftest import ROOT, SMALL_DATA
from conftest import hprune as cli
from hprune.errors import UserError
from hprune.rundir import RunDir

pytest.importorskip("fairseq")
SETTINGS = {"device": "cpu", **{key: int(value) for key, value in (item.split("=", 1) for item in SMALL_DATA)}}


@pytest.fixture(scope="module")
def model(trained_run):
    return hprune.open(trained_run, **SETTINGS)


def test_a_run_opened_from_python_translates_as_hprune_eval(model, evaluated_run):
    out, metrics = evaluated_run
    translation = model.evaluate()
    assert (translation.bleu, translation.chrf, translation.sentences) == \
        (metrics["bleu"], metrics["chrf"], metrics["sentences"])
    assert translation.bleu_signature == metrics["bleu_signature"] and translation.split == metrics["split"]
    assert translation.hypotheses == (out / f"hypotheses.{metrics['split']}.txt").read_text().splitlines()
    assert len(translation.references) == translation.sentences
    assert "test_sets" not in repr(model) and "parameters" in repr(model)


def test_scores_and_masks_are_the_curves_and_a_saved_mask_is_the_clis(model, trained_run, tmp_path):
    run = tmp_path / "michel"
    cli("prune", "--method", "michel", f"ckpt={trained_run}", "prune.step_pct=50", f"hydra.run.dir={run}",
        *SMALL_DATA, "device=cpu")
    scores = model.scores("michel")
    written = pd.read_csv(run / "head_importance.csv")
    merged = written.merge(scores.table, on=["type", "layer", "head", "id"], suffixes=("_cli", "_api"))
    assert len(merged) == len(written) == 36
    assert merged["importance_api"].to_numpy() == pytest.approx(merged["importance_cli"].to_numpy(), abs=1e-6)
    assert (merged["rank_api"] == merged["rank_cli"]).all()

    half = scores.mask(pct=50)  # the least important half, as the curve's step at 50 % removes it
    curve = pd.read_csv(run / "curve.csv").set_index("pct_target")
    assert len(half.removed) == curve.loc[50, "heads_pruned"] == 18
    assert sum(half.kept.values()) == 36 - 18
    assert [half.kept[t] for t in ("enc-self", "dec-self", "dec-enc")] == \
        curve.loc[50, ["kept_enc_self", "kept_dec_self", "kept_dec_enc"]].tolist()
    assert model.evaluate(half).bleu == curve.loc[50, "bleu"]

    saved = half.save(tmp_path / "half.json")
    assert hprune.HeadMask.read(saved, model.module) == half
    eval_run = tmp_path / "eval"
    cli("eval", f"ckpt={trained_run}", f"mask={saved}", f"hydra.run.dir={eval_run}", *SMALL_DATA, "device=cpu")
    assert json.loads((eval_run / "metrics.json").read_text())["bleu"] == curve.loc[50, "bleu"]
    # and the curve's own masks: the least important 25 % of the same scores
    assert scores.mask(prune=9).removed == scores.mask(pct=25).removed


def test_masks_are_objects_to_build_combine_and_check(model):
    full = model.mask()
    assert full.kept == {"enc-self": 12, "dec-self": 12, "dec-enc": 12} and full.removed == []
    a = full.without(("enc-self", 0, 1), "D:2:4")  # a head as a tuple (0-based) or as Michel's id (1-based)
    b = full.without(("enc-self", 0, 1), ("dec-enc", 1, 0))
    assert a.removed == [("enc-self", 0, 1), ("dec-self", 1, 3)]
    assert (a & b).removed == [("enc-self", 0, 1), ("dec-self", 1, 3), ("dec-enc", 1, 0)]  # both keep
    assert (a | b).removed == [("enc-self", 0, 1)]  # either keeps
    assert full.removed == [] and isinstance(a, dict)  # the schema's dict: every verb takes it
    assert (dict(a) | b).removed == (a | b).removed and (dict(a) & b).removed == (a & b).removed
    either = hprune.HeadMask(a)
    either |= b  # combines heads (a dict's |= would merge keys)
    assert either.removed == [("enc-self", 0, 1)]
    with pytest.raises(UserError, match="not a unit of this mask"):
        full.without(("enc-self", 5, 0))
    with pytest.raises(UserError, match="not a head id"):
        full.without("X:1:1")
    with pytest.raises(UserError, match="mask\\(prune=N\\) or mask\\(pct=P\\)"):
        model.scores("random").mask()


def test_a_procedure_from_python_writes_what_the_cli_writes(model, trained_run, evaluated_run, tmp_path):
    run = model.prune("fisher", tmp_path / "api", macs_budget=0.5, **{"calibration.sentences": 256, "export": False})
    cli("prune", "--method", "fisher", f"ckpt={trained_run}", "prune.macs_budget=0.5", "prune.calibration.sentences=256",
        "prune.export=false", f"hydra.run.dir={tmp_path / 'cli'}", *SMALL_DATA, "device=cpu")
    assert run.mask == json.loads((tmp_path / "cli" / "head_mask.json").read_text())
    assert (run.folder / "head_mask.json").is_file() and run.method == "fisher"
    cli_metrics = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    for key in ("bleu", "attention_macs_pct", "kept_enc_self", "kept_dec_self", "kept_dec_enc"):
        assert run.metrics[key] == cli_metrics[key], key
    assert run.metrics["attention_macs_pct"] <= 50
    recorded = RunDir(run.folder)  # a run as the CLI leaves one: hprune report reads it
    assert recorded.config()["prune"]["macs_budget"] == 0.5 and recorded.metrics() == run.metrics
    assert run.metrics["verb"] == "prune" and "prune=fisher" in recorded.resume_command()
    cli("report", str(tmp_path), f"hydra.run.dir={tmp_path / 'report'}")
    table = pd.read_csv(tmp_path / "report" / "runs.csv")
    pruned = table[table["verb"] == "prune"]
    assert sorted(pruned["method"]) == ["fisher", "fisher"] and pruned["bleu"].nunique() == 1
    # the search scaled the kept heads in place (its mask tuning): the model is put back as it was opened
    assert model.session.mask is None and model.evaluate().bleu == evaluated_run[1]["bleu"]


def test_an_analysis_from_python_is_the_clis(model, trained_run, tmp_path):
    half = model.mask().without(*[("enc-self", 0, h) for h in range(4)])
    found = model.analyze(tmp_path / "api", mask=half.save(tmp_path / "half.json"), lrp=False)
    cli("analyze", f"ckpt={trained_run}", f"mask={tmp_path / 'half.json'}", "lrp=false",
        f"hydra.run.dir={tmp_path / 'cli'}", *SMALL_DATA, "device=cpu")
    assert (tmp_path / "api" / "head_roles.csv").read_text() == (tmp_path / "cli" / "head_roles.csv").read_text()
    written = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert {k: v for k, v in found.items() if k in written} == {k: written[k] for k in found if k in written}
    assert pd.read_csv(tmp_path / "api" / "head_roles.csv").query("type == 'enc-self' and layer == 0")["alive"].sum() == 0


def test_settings_are_the_clis_and_a_bad_one_is_one_line(model, trained_run):
    assert model.config("prune", prune="fisher").prune.macs_budget == 0.5  # the method's yaml
    assert model.config("eval", **{"generation.beam": 2}).generation.beam == 2
    assert model.config("analyze").split == "valid"  # (generation.* of open() where the verb has it)
    with pytest.raises(UserError, match="no_such_key"):
        hprune.open(trained_run, no_such_key=1)
    with pytest.raises(UserError, match="device open the model: give them to hprune.open"):
        model.prune("fisher", "unused", device="cpu")  # (the model is opened once)
    with pytest.raises(UserError, match="given to each call"):
        hprune.open(trained_run, mask="head_mask.json")
    assert model._prune_settings({"optim.lr": 0.1, "generation.beam": 2, "tune": False}) == \
        {"prune.optim.lr": 0.1, "generation.beam": 2, "prune.tune": False}  # voita's optim is the method's
    encoder = model.scores("random", types=["enc-self"])  # the pool is prune.types', as the curve's
    assert len(encoder.table) == 12 and set(encoder.table["type"]) == {"enc-self"}
    assert [unit[0] for unit in encoder.mask(pct=50).removed] == ["enc-self"] * 6
    with pytest.raises(UserError, match="procedure, not an order"):
        model.scores("voita")
    assert hprune.api.hydra_value(["a'b", None, True, 1.5, Path("/x=y"), "4", "true", "runs/a-b.c", ".5",
                                   np.float64(0.5), np.int64(3), "C:\\data"]) == \
        "['a\\'b',null,true,1.5,'/x=y','4','true',runs/a-b.c,'.5',0.5,3,'C:\\data']"


def test_the_notebook_asks_the_demos_questions_and_its_answers_hold(trained_run, evaluated_run, tmp_path):
    """docs/api.ipynb run as a kernel would (scripts/run_notebook.py) on the tests' model: what it computed checked
    against the CLI's figures and the methods' own claims; its saved outputs are a demo model's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_notebook", ROOT / "scripts" / "run_notebook.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    saved = json.loads((ROOT / "docs" / "api.ipynb").read_text())
    assert all(cell["outputs"] for cell in saved["cells"] if cell["cell_type"] == "code" and
               "parameters" not in cell["metadata"].get("tags", []))  # each answer is on the page
    notebook, ns = runner.run(ROOT / "docs" / "api.ipynb",
                              {"CKPT": str(trained_run), "SETTINGS": SETTINGS, "OUT": str(tmp_path)})
    assert ns["unpruned"].bleu == evaluated_run[1]["bleu"]
    assert "BLEU" in notebook["cells"][4]["outputs"][0]["text"]
    curve = ns["curve"].pivot(index="pruned %", columns="order", values="BLEU")
    assert list(curve.index) == [25, 50, 75] and set(curve.columns) == {"michel", "random", "confidence"}
    assert curve["michel"][25] >= curve["michel"][75]
    assert all(bleu < ns["unpruned"].bleu for bleu in ns["by_type"].values())  # every type matters somewhat
    fisher = ns["fisher"]
    assert fisher.metrics["attention_macs_pct"] <= 50
    assert json.loads((tmp_path / "fisher" / "mask_copy.json").read_text()) == fisher.mask
    exported = ns["exported"]
    assert exported["translations_differ"] <= 0.05 * ns["unpruned"].sentences


def test_a_model_changed_in_place_is_put_back_and_one_whose_structure_changed_is_opened_again():
    """Model._unchanged, on a stand-in session: weights and mask put back; a model whose modules changed (a gated
    model's gates folded by an export) reopened from its checkpoint."""
    import torch

    class Stand:
        def __init__(self, gated: bool):
            self.model, self.mask, self.checkpoint, self.reopened = torch.nn.Linear(2, 2), None, Path("c.pt"), False
            if gated:
                self.model.gate = torch.nn.Parameter(torch.ones(1))

        def state(self):
            return {k: v.clone() for k, v in self.model.state_dict().items()}

        def load_state(self, state):
            self.model.load_state_dict(state)

        def set_mask(self, mask):
            self.mask = mask

        def reopen(self, ckpt):
            fresh = Stand(gated=True)
            fresh.reopened = ckpt
            return fresh

    model = hprune.Model(Stand(gated=False), None, {})
    before = model.session.state()
    with model._unchanged(True):
        model.session.model.weight.data.mul_(3)
        model.session.set_mask({"enc-self": [[0]]})
    assert torch.equal(model.session.model.weight, before["weight"]) and model.session.mask is None
    model = hprune.Model(Stand(gated=True), None, {})
    with model._unchanged(True):
        del model.session.model.gate  # folded
    assert model.session.reopened == Path("c.pt") and hasattr(model.session.model, "gate")


def test_a_parked_model_frees_its_weights_and_gets_them_back(model, tmp_path):
    """Session.parked (while fairseq-train runs in this process): every parameter and buffer emptied, then the
    same values back, tied weights still one tensor, the file it was parked in gone."""
    import torch
    session = model.session
    before = {name: t.detach().clone() for name, t in session.model.state_dict().items()}
    tied = [(a, b) for a, pa in session.model.named_parameters(remove_duplicate=False)
            for b, pb in session.model.named_parameters(remove_duplicate=False) if a < b and pa is pb]
    with session.parked(tmp_path):
        assert all(t.numel() == 0 for t in session.model.parameters())
    after = session.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    model_params = dict(session.model.named_parameters(remove_duplicate=False))
    assert all(model_params[a] is model_params[b] for a, b in tied) and not list(tmp_path.iterdir())
