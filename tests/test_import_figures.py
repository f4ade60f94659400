"""The figures the model-import note states, on a converged stock model (400 updates, slow: `make test` skips it):
`.venv/bin/python -m pytest -m slow -s tests/test_import_figures.py` prints, for a stock fairseq-train
checkpoint, the same checkpoint as fairseq 0.6-0.9 wrote it, and a published-layout model with its own codes,
hprune eval's BLEU next to stock fairseq-generate's, and the largest log-probability difference."""
import json
from pathlib import Path

import pytest
import torch

from conftest import SMALL_DATA, hprune
from test_pretrained import hub, pretrained  # noqa: F401 (hub: a fixture)
from test_stock_fairseq import fairseq_generate, legacy_checkpoint, stock_argv


def logprob_diff(ckpt, data_bin, ref_ckpt=None):
    from fairseq import checkpoint_utils

    from hprune import backend
    ours = backend.load_model(ckpt, data_bin)
    if ref_ckpt is None:
        (stock,), _ = checkpoint_utils.load_model_ensemble([str(ckpt)], arg_overrides={"data": str(data_bin)})
        stock.eval()
    else:
        stock = backend.load_model(ref_ckpt, data_bin).model
    worst = 0.0
    for sample in backend.batches(ours, "test", 4000):
        with torch.no_grad():
            a = ours.model.get_normalized_probs(ours.model(**sample["net_input"]), log_probs=True)
            b = stock.get_normalized_probs(stock(**sample["net_input"]), log_probs=True)
        worst = max(worst, (a - b).abs().max().item())
    return worst


@pytest.mark.slow
def test_import_figures(trained_run, evaluated_run, hub, tmp_path):  # noqa: F811
    from hprune import backend
    from hprune.evaluation import score
    backend.train(stock_argv(trained_run / "fairseq-train.sh", tmp_path / "ck", updates=400))
    stock_ckpt = tmp_path / "ck" / "checkpoint_best.pt"
    data_bin = Path(evaluated_run[1]["data_bin"])
    refs = (data_bin.parent / "raw" / "test.tgt").read_text().splitlines()
    legacy = tmp_path / "model.pt"
    legacy_checkpoint(stock_ckpt, stock_argv(trained_run / "fairseq-train.sh", tmp_path / "unused", updates=30), legacy)
    from hprune_fairseq.safe_load import load_checkpoint
    modern = load_checkpoint(stock_ckpt)
    modern["model"] = {k: t.half().float() if t.is_floating_point() else t for k, t in modern["model"].items()}
    torch.save(modern, tmp_path / "rounded.pt")
    rows = {"legacy_vs_rounded_modern_logprob_diff": logprob_diff(legacy, data_bin, tmp_path / "rounded.pt")}
    for name, ckpt in (("stock", stock_ckpt), ("legacy", legacy)):
        out = tmp_path / name
        hprune("eval", f"ckpt={ckpt}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu")
        ours = json.loads((out / "metrics.json").read_text())["bleu"]
        theirs = score(fairseq_generate(data_bin, ckpt), refs).bleu
        rows[name] = {"hprune_bleu": ours, "fairseq_generate_bleu": theirs,
                      "max_abs_logprob_diff": logprob_diff(ckpt, data_bin) if name == "stock" else None}
    out = tmp_path / "hub"
    hprune("eval", f"ckpt={hub['dir'] / 'model.pt'}", f"hydra.run.dir={out}", *pretrained(hub), "device=cpu")
    m = json.loads((out / "metrics.json").read_text())
    theirs = score(fairseq_generate(hub["bin"], hub["dir"] / "model.pt", "--post-process", "subword_nmt"),
                   (hub["raw"] / "test.fr").read_text().splitlines()).bleu
    rows["pretrained_hub"] = {"hprune_bleu": m["bleu"], "fairseq_generate_bleu": theirs,
                              "max_abs_logprob_diff": logprob_diff(hub["dir"] / "model.pt", Path(m["data_bin"]))}
    print("FIGURES", json.dumps(rows, indent=1))
    for name in ("stock", "legacy", "pretrained_hub"):
        assert rows[name]["hprune_bleu"] == rows[name]["fairseq_generate_bleu"]
    assert rows["stock"]["max_abs_logprob_diff"] <= 1e-5 and rows["legacy_vs_rounded_modern_logprob_diff"] <= 1e-5
