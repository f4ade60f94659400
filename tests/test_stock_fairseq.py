"""Models people already have: a checkpoint written as fairseq 0.6-0.9 wrote them opens and computes what its
modern equivalent computes. (Checkpoints of today's stock fairseq-train, by fairseq's common recipes, are
evaluated and pruned in test_stock_recipes.py.)"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import zipfile
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


def fairseq_generate(data_bin: Path, ckpt: Path, *extra: str) -> list[str]:
    """Stock fairseq-generate's detokenized hypotheses (D- lines, BPE removed as the toy data's post_process)."""
    from hprune.backend import PLUGIN_DIR
    cmd = [os.path.join(os.path.dirname(HPRUNE[0]), "fairseq-generate"), str(data_bin), "--path", str(ckpt),
           "--gen-subset", "test", "--beam", "5", "--lenpen", "1.0", "--max-len-a", "1.2", "--max-len-b", "10",
           "--batch-size", "128", "--cpu", "--required-batch-size-multiple", "1", "--post-process", "subword_nmt"]
    proc = subprocess.run(cmd + ["--user-dir", PLUGIN_DIR, *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hyps = dict(re.findall(r"^D-(\d+)\t[^\t]*\t(.*)$", proc.stdout, flags=re.M))
    return [hyps[str(i)] for i in range(len(hyps))]


@pytest.fixture(scope="module")
def stock_ckpt(trained_run, tmp_path_factory) -> Path:
    from hprune import backend
    save = tmp_path_factory.mktemp("stock") / "checkpoints"
    backend.train(stock_argv(trained_run / "fairseq-train.sh", save, updates=30))
    return save / "checkpoint_best.pt"


def legacy_checkpoint(modern: Path, argv: list[str], dest: Path) -> None:
    """`modern` as fairseq 0.6-0.9 wrote checkpoints: the legacy (non-zip) serialization, only an
    argparse.Namespace `args` (no `cfg`), fp16 weights, fused in_proj_weight/in_proj_bias, the encoder's
    layer_norms.0/1, version entries, and fairseq.meters objects in extra_state["train_meters"]."""
    import sys
    import types

    from fairseq import options

    from hprune_fairseq.safe_load import load_checkpoint
    weights = {name: t.half() if t.is_floating_point() else t for name, t in load_checkpoint(modern)["model"].items()}
    for prefix in sorted({name.rsplit(".q_proj.", 1)[0] for name in weights if ".q_proj." in name}):
        for kind in ("weight", "bias"):
            weights[f"{prefix}.in_proj_{kind}"] = torch.cat([weights.pop(f"{prefix}.{p}_proj.{kind}") for p in "qkv"])
    for name in [n for n in weights if n.startswith("encoder.layers.")]:
        weights[name.replace(".self_attn_layer_norm.", ".layer_norms.0.").replace(".final_layer_norm.", ".layer_norms.1.")] = \
            weights.pop(name)
    assert "encoder.version" in weights and "decoder.version" in weights
    meters = types.ModuleType("fairseq.meters")  # the module fairseq 0.6-0.9 pickled its meters from
    for name in ("AverageMeter", "TimeMeter", "StopwatchMeter"):
        setattr(meters, name, type(name, (), {"__module__": "fairseq.meters"}))
    train_meters = {"train_loss": meters.AverageMeter(), "wps": meters.TimeMeter(), "wall": meters.StopwatchMeter()}
    train_meters["train_loss"].__dict__.update(val=3.2, avg=3.4, sum=102.0, count=30)
    state = {"args": options.parse_args_and_arch(options.get_training_parser(), argv), "model": weights,
             "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                                    "lr_scheduler_state": {"best": 3.1}, "num_updates": 30}],
             "extra_state": {"train_meters": train_meters, "train_iterator": {"epoch": 3, "iterations_in_epoch": 0},
                             "val_loss": 3.1},
             "last_optimizer_state": None}
    saved = sys.modules.get("fairseq.meters")
    sys.modules["fairseq.meters"] = meters
    try:
        torch.save(state, dest, _use_new_zipfile_serialization=False)
    finally:
        sys.modules["fairseq.meters"] = saved


def test_a_checkpoint_written_as_fairseq_0_6_to_0_9_did_equals_its_modern_equivalent(stock_ckpt, trained_run,
                                                                                       evaluated_run, tmp_path):
    """The old layout is upgraded by fairseq's own upgrade functions, loaded under weights_only with the meter
    classes allow-listed, and computes what the same (fp16-rounded) weights saved today compute."""
    from hprune import backend
    from hprune_fairseq.safe_load import load_checkpoint
    data_bin = Path(evaluated_run[1]["data_bin"])
    legacy = tmp_path / "model.pt"
    legacy_checkpoint(stock_ckpt, stock_argv(trained_run / "fairseq-train.sh", tmp_path / "unused", updates=30), legacy)
    assert not zipfile.is_zipfile(legacy)
    modern = load_checkpoint(stock_ckpt)
    modern["model"] = {name: t.half().float() if t.is_floating_point() else t for name, t in modern["model"].items()}
    torch.save(modern, tmp_path / "rounded.pt")

    old, new = backend.load_model(legacy, data_bin), backend.load_model(tmp_path / "rounded.pt", data_bin)
    assert old.imported_from == "transformer" and old.cfg.model.encoder_layers == 3
    sample = next(backend.batches(new, "valid", 1000, 1))
    with torch.no_grad():
        a = old.model.get_normalized_probs(old.model(**sample["net_input"]), log_probs=True)
        b = new.model.get_normalized_probs(new.model(**sample["net_input"]), log_probs=True)
    assert (a - b).abs().max().item() <= 1e-5
    # and through the CLI, inside a Hydra app, where the legacy `args` must still become a config
    for name in ("model.pt", "rounded.pt"):
        hprune("eval", f"ckpt={tmp_path / name}", f"hydra.run.dir={tmp_path / name}-eval", *SMALL_DATA, "device=cpu")
    assert (tmp_path / "model.pt-eval" / "hypotheses.test.txt").read_text() == \
        (tmp_path / "rounded.pt-eval" / "hypotheses.test.txt").read_text()
