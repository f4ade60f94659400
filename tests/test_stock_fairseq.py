"""Models people already have: a checkpoint of stock `fairseq-train --arch transformer` is evaluated, pruned
(Michel with export, Voita) and measured like hprune's own, as an hprune_transformer with the same parameters."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import HPRUNE, SMALL_DATA, hprune

pytest.importorskip("fairseq")


def stock_argv(hprune_script: Path, save_dir: Path, updates: int) -> list[str]:
    """The fairseq-train command line of an hprune run, as stock fairseq trains it: no plugin, the stock
    Transformer and criterion, the same data, dimensions and optimizer."""
    argv, out, i = shlex.split(hprune_script.read_text())[1:], [], 0
    replace = {"--arch": "transformer", "--criterion": "label_smoothed_cross_entropy", "--max-update": str(updates),
               "--save-dir": str(save_dir)}
    while i < len(argv):
        if argv[i] == "--user-dir":
            i += 2
            continue
        out.append(argv[i])
        if argv[i] in replace:
            out.append(replace[argv[i]])
            i += 1
        i += 1
    return out


def fairseq_generate(data_bin: Path, ckpt: Path) -> list[str]:
    from hprune.backend import PLUGIN_DIR
    cmd = [os.path.join(os.path.dirname(HPRUNE[0]), "fairseq-generate"), str(data_bin), "--path", str(ckpt),
           "--gen-subset", "test", "--beam", "5", "--lenpen", "1.0", "--max-len-a", "1.2", "--max-len-b", "10",
           "--batch-size", "128", "--cpu", "--required-batch-size-multiple", "1"]
    proc = subprocess.run(cmd + ["--user-dir", PLUGIN_DIR], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hyps = dict(re.findall(r"^D-(\d+)\t[^\t]*\t(.*)$", proc.stdout, flags=re.M))
    return [hyps[str(i)] for i in range(len(hyps))]


@pytest.fixture(scope="module")
def stock_ckpt(trained_run, tmp_path_factory) -> Path:
    from hprune import backend
    save = tmp_path_factory.mktemp("stock") / "checkpoints"
    backend.train(stock_argv(trained_run / "fairseq-train.sh", save, updates=30))
    return save / "checkpoint_best.pt"


def test_a_stock_checkpoint_is_evaluated_pruned_and_exported_as_stock_fairseq_reads_it(stock_ckpt, evaluated_run,
                                                                                         tmp_path):
    from hprune import backend
    from hprune_fairseq.safe_load import load_checkpoint
    data_bin = Path(evaluated_run[1]["data_bin"])
    assert load_checkpoint(stock_ckpt)["cfg"]["model"].arch == "transformer"

    # eval: the same translations as stock fairseq-generate running the stock TransformerModel (the plugin folder
    # is passed only for its weights_only allow-list: fairseq-fixed's own torch.load can open no checkpoint on
    # torch >= 2.6 without one); the same log-probabilities as the stock model
    out = tmp_path / "eval"
    hprune("eval", f"ckpt={stock_ckpt}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["imported_from"] == "transformer"
    assert (out / "hypotheses.test.txt").read_text().splitlines() == fairseq_generate(data_bin, stock_ckpt)
    ours = backend.load_model(stock_ckpt, data_bin)
    assert type(ours.model).__name__ == "HpruneTransformerModel" and ours.imported_from == "transformer"
    from fairseq import checkpoint_utils
    (stock,), _ = checkpoint_utils.load_model_ensemble([str(stock_ckpt)], arg_overrides={"data": str(data_bin)})
    stock.eval()
    assert type(stock).__name__ == "TransformerModel"
    sample = next(backend.batches(ours, "valid", 1000, 1))
    with torch.no_grad():
        theirs = stock.get_normalized_probs(stock(**sample["net_input"]), log_probs=True)
        mine = ours.model.get_normalized_probs(ours.model(**sample["net_input"]), log_probs=True)
    assert (mine - theirs).abs().max().item() < 1e-5

    # Michel's curve with export: the export is an hprune checkpoint that says where it came from
    out = tmp_path / "prune"
    hprune("prune", "--method", "michel", f"ckpt={stock_ckpt}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.step_pct=25", "prune.target_pct=25", "prune.export=true")
    pruned = json.loads((out / "metrics.json").read_text())
    assert pruned["imported_from"] == "transformer" and pruned["export_same_translations"]
    export = Path(pruned["export_checkpoint"])
    model_cfg = load_checkpoint(export)["cfg"]["model"]
    assert (model_cfg.arch, model_cfg.imported_from) == ("hprune_transformer", "transformer")
    hprune("eval", f"ckpt={export}", f"hydra.run.dir={out / 'eval'}", *SMALL_DATA, "device=cpu")
    assert json.loads((out / "eval" / "metrics.json").read_text())["bleu"] == pruned["export_bleu"]
    assert fairseq_generate(data_bin, export) == (out / "eval" / "hypotheses.test.txt").read_text().splitlines()

    # Voita's gates continue training the stock checkpoint as an hprune_transformer
    out = tmp_path / "voita"
    hprune("prune", "--method", "voita", f"ckpt={stock_ckpt}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           "prune.optim.max_update=10", "prune.optim.warmup_updates=0", "prune.optim.log_interval=5")
    gated = json.loads((out / "metrics.json").read_text())
    assert gated["imported_from"] == "transformer" and gated["heads_pool"] == 12 and gated["bleu"] == gated["bleu_gates"]
