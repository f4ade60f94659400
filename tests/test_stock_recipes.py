"""Checkpoints as fairseq's common recipes train them, by stock fairseq-train (no plugin), run as
hprune_transformer models: the log-probabilities of the stock TransformerModel, the translations of stock
fairseq-generate, and every method, exports included, without a traceback.

  iwslt              fairseq's examples/translation IWSLT14 recipe: transformer_iwslt_de_en without -s/-t (the
                     checkpoint records no languages: fairseq infers them from the data-bin), post-norm, label
                     smoothing, the decoder's input and output embeddings shared
  default_criterion  fairseq-train's default criterion, cross_entropy (whose logs have no nll_loss), pre-norm
  learned_pos        learned positions with layernorm_embedding, label smoothing, all embeddings shared

`make test` compares the IWSLT recipe with stock fairseq and runs every method on one recipe at least; the slow
tests compare every recipe and run every method on every recipe.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import SMALL_DATA, hprune
from test_stock_fairseq import fairseq_generate

pytest.importorskip("fairseq")

RECIPES = {
    "iwslt": ["--arch", "transformer_iwslt_de_en", "--share-decoder-input-output-embed",
              "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
    "default_criterion": ["-s", "src", "-t", "tgt", "--arch", "transformer", "--share-all-embeddings",
                          "--encoder-normalize-before", "--decoder-normalize-before"],
    "learned_pos": ["-s", "src", "-t", "tgt", "--arch", "transformer", "--share-all-embeddings",
                    "--encoder-learned-pos", "--decoder-learned-pos", "--layernorm-embedding",
                    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
}
# small, and enough updates that translations depend on the input (a random model repeats one token)
COMMON = ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--encoder-layers", "2",
          "--encoder-attention-heads", "4", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
          "--decoder-layers", "2", "--decoder-attention-heads", "4", "--dropout", "0.1",
          "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.005", "--lr-scheduler", "inverse_sqrt",
          "--warmup-updates", "30", "--max-tokens", "2048", "--max-update", "120", "--disable-validation",
          "--no-epoch-checkpoints", "--num-workers", "0", "--seed", "1", "--cpu", "--log-format", "simple"]
METHODS = {
    "michel": ["prune.step_pct=25", "prune.target_pct=25", "prune.export=true"],
    "lrp": ["prune.step_pct=50", "prune.importance.max_batches=1"],
    "fisher": ["prune.macs_budget=0.5", "prune.calibration.sentences=64"],
    "voita": ["prune.optim.max_update=8", "prune.optim.warmup_updates=0", "prune.export=true"],
    "dsp": ["prune.head_budget=12", "prune.optim.max_update=8", "prune.cooldown=4", "prune.export=true"],
}
# make test: every method on a stock checkpoint; the inferred languages through an order and a training method
LEAN = [("iwslt", "michel"), ("iwslt", "voita"), ("default_criterion", "fisher"), ("default_criterion", "dsp"),
        ("learned_pos", "lrp")]
FULL = [(recipe, method) for recipe in RECIPES for method in METHODS if (recipe, method) not in LEAN]


@pytest.fixture(scope="module")
def data_bin(evaluated_run) -> Path:
    return Path(evaluated_run[1]["data_bin"])


@pytest.fixture(scope="module")
def recipe_ckpt(data_bin, tmp_path_factory):
    """recipe name -> its checkpoint, trained on first use by stock fairseq-train (in this process)."""
    from hprune import backend
    trained = {}

    def get(name: str) -> Path:
        if name not in trained:
            save = tmp_path_factory.mktemp(name)
            backend.train([str(data_bin), *RECIPES[name], *COMMON, "--save-dir", str(save)])
            trained[name] = save / "checkpoint_last.pt"
        return trained[name]
    return get


# make test: the IWSLT recipe (15 s each); the other two recipes' checkpoints run methods there (LEAN)
@pytest.mark.parametrize("recipe", [r if r == "iwslt" else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_a_recipe_checkpoint_computes_and_translates_as_stock_fairseq(recipe, recipe_ckpt, data_bin, tmp_path):
    from fairseq import checkpoint_utils

    from hprune import backend
    ckpt = recipe_ckpt(recipe)
    arch = RECIPES[recipe][RECIPES[recipe].index("--arch") + 1]
    recorded = torch.load(ckpt, weights_only=False)["cfg"]
    assert (recorded["task"]["source_lang"] is None) == (recipe == "iwslt")
    assert recorded["criterion"]["_name"] == ("cross_entropy" if recipe == "default_criterion"
                                              else "label_smoothed_cross_entropy")

    out = tmp_path / "eval"
    hprune("eval", f"ckpt={ckpt}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu")
    metrics = json.loads((out / "metrics.json").read_text())
    hypotheses = (out / "hypotheses.test.txt").read_text().splitlines()
    assert metrics["imported_from"] == arch
    assert len(set(hypotheses)) >= 20  # of 100: translations that depend on the input
    assert hypotheses == fairseq_generate(data_bin, ckpt)

    # the same log-probabilities as the stock model, and the loss of the checkpoint's own criterion
    ours = backend.load_model(ckpt, data_bin, languages=("src", "tgt"))
    (stock,), _ = checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"data": str(data_bin)})
    stock.eval()
    assert type(ours.model).__name__ == "HpruneTransformerModel" and type(stock).__name__ == "TransformerModel"
    sample = next(backend.batches(ours, "valid", 1000, 1))
    with torch.no_grad():
        theirs = stock.get_normalized_probs(stock(**sample["net_input"]), log_probs=True)
        mine = ours.model.get_normalized_probs(ours.model(**sample["net_input"]), log_probs=True)
        assert (mine - theirs).abs().max().item() < 1e-5
        recorded_criterion = ours.task.build_criterion(ours.cfg.criterion)  # fairseq's own
        loss, size, _ = backend.build_criterion(ours)(ours.model, sample)
        stock_loss, stock_size, _ = recorded_criterion(ours.model, sample)
    assert size == stock_size and abs(loss.item() - stock_loss.item()) <= 1e-4 * abs(stock_loss.item())

    # the CTranslate2 export (post-norm, learned positions, layernorm_embedding, separate output embedding)
    from test_export import largest_log_prob_difference
    hprune("export", f"ckpt={ckpt}", f"hydra.run.dir={tmp_path / 'ct2'}", *SMALL_DATA, "device=cpu")
    assert largest_log_prob_difference(ours, tmp_path / "ct2" / "ctranslate2", "valid", None) < 1e-4


def run_method(recipe_ckpt, recipe: str, method: str, out: Path) -> dict:
    hprune("prune", "--method", method, f"ckpt={recipe_ckpt(recipe)}", f"hydra.run.dir={out}", *SMALL_DATA,
           "device=cpu", *METHODS[method])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["imported_from"] and metrics["method"] == method and 0 <= metrics["bleu"] <= 100
    if method != "lrp":  # the physically pruned export: an hprune model that records what it translates
        assert metrics["export_same_translations"]
        model_cfg, task = (torch.load(metrics["export_checkpoint"], weights_only=False)["cfg"][key]
                           for key in ("model", "task"))
        assert (model_cfg.arch, model_cfg.imported_from) == ("hprune_transformer", metrics["imported_from"])
        assert (task["source_lang"], task["target_lang"]) == ("src", "tgt")
    return metrics


@pytest.mark.parametrize("recipe,method", LEAN)
def test_every_method_runs_on_recipe_checkpoints(recipe, method, recipe_ckpt, data_bin, tmp_path):
    metrics = run_method(recipe_ckpt, recipe, method, tmp_path / "run")
    if method == "michel":  # stock fairseq-generate reads the export and translates as hprune eval does
        export = Path(metrics["export_checkpoint"])
        hprune("eval", f"ckpt={export}", f"hydra.run.dir={tmp_path / 'eval'}", *SMALL_DATA, "device=cpu")
        assert (tmp_path / "eval" / "hypotheses.test.txt").read_text().splitlines() == fairseq_generate(data_bin, export)


@pytest.mark.slow
@pytest.mark.parametrize("recipe,method", FULL)
def test_every_method_on_every_recipe(recipe, method, recipe_ckpt, tmp_path):
    run_method(recipe_ckpt, recipe, method, tmp_path / "run")


def test_languages_are_inferred_as_fairseq_infers_them(tmp_path):
    """In order: the data settings, the data-bin the checkpoint was trained on, the two dictionaries beside it
    (which is the source: the one the encoder's embedding has as many rows as)."""
    from hprune.data.prepare import model_languages
    from hprune.errors import UserError

    folder, trained_on = tmp_path / "model", tmp_path / "data-bin"
    folder.mkdir()
    trained_on.mkdir()
    (folder / "dict.de.txt").write_text("".join(f"w{i} 1\n" for i in range(12)))  # 16 words with the 4 specials
    (folder / "dict.en.txt").write_text("".join(f"w{i} 1\n" for i in range(20)))  # 24
    checkpoint = SimpleNamespace(path=folder / "model.pt", trained_on=trained_on, vocabulary_sizes=(16, 24))
    pretrained = OmegaConf.create({"kind": "pretrained", "model_dir": None, "src_lang": None, "tgt_lang": None})
    assert model_languages(pretrained, checkpoint) == ("de", "en")
    assert model_languages(pretrained, SimpleNamespace(**{**vars(checkpoint), "vocabulary_sizes": (24, 16)})) == ("en", "de")
    (trained_on / "train.fr-en.fr.bin").write_bytes(b"")
    assert model_languages(pretrained, checkpoint) == ("fr", "en")  # the data-bin it was trained on says
    toy = OmegaConf.create({"kind": "toy", "src_lang": "src", "tgt_lang": "tgt"})
    assert model_languages(toy, checkpoint) == ("src", "tgt")  # the data settings say
    (trained_on / "train.fr-en.fr.bin").unlink()
    (folder / "dict.en.txt").write_text((folder / "dict.de.txt").read_text())  # a joined dictionary
    with pytest.raises(UserError, match="data.src_lang=<source> data.tgt_lang=<target>"):
        model_languages(pretrained, checkpoint)
