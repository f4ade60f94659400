"""Recovery (recovery.py): a pruned model trained on with the references, the teacher's distribution or the
teacher's translations lowers that loss; what was removed stays removed; the recovered model exports to
CTranslate2 with parity; a killed recovery resumes to the weights of one never interrupted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import HPRUNE, ROOT, SMALL_DATA, hprune

pytest.importorskip("fairseq")

UPDATES = 12
RECOVERY = [f"recovery.updates={UPDATES}", "recovery.optim.save_interval_updates=6", "recovery.optim.max_tokens=2048",
            "recovery.optim.lr=5e-4", "significance.resamples=200"]
FISHER = ["--method", "fisher", *SMALL_DATA, "device=cpu", "prune.calibration.sentences=128", "prune.macs_budget=0.5",
          "prune.units=[heads,neurons]"]


@pytest.fixture(scope="module")
def pruned(trained_run, tmp_path_factory) -> Path:
    """Kwon et al.'s heads and neurons at half the MACs, recovered with cross-entropy as the run's last stage."""
    out = tmp_path_factory.mktemp("recovery") / "fisher"
    hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={out}", *FISHER, "recovery.loss=ce", *RECOVERY)
    return out


def recover(trained_run, pruned, out: Path, loss: str, *extra, check=True, popen=False):
    args = ["recover", f"ckpt={trained_run}", f"mask={pruned}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
            f"recovery.loss={loss}", *RECOVERY, *extra]
    if popen:
        return subprocess.Popen([*HPRUNE, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hprune(*args, check=check)
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def word(trained_run, pruned, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("recovery") / "word"
    return out, recover(trained_run, pruned, out, "word")


def objective(ckpt: Path, data_bin: Path, criterion: dict) -> float:
    """The mean per-token training objective of a checkpoint on its training split, as fairseq-train computes it."""
    from hprune import backend

    loaded = backend.load_model(ckpt, data_bin)
    settings = {"_name": "hprune", "label_smoothing": 0.1, "sentence_avg": False, **criterion}
    return backend.split_loss(loaded, loaded.task.build_criterion(OmegaConf.create(settings)), "train", 4096)["loss"]


def test_each_loss_lowers_its_own_objective(trained_run, pruned, word, tmp_path):
    ce = json.loads((pruned / "metrics.json").read_text())
    word_dir, word_metrics = word
    sequence = recover(trained_run, pruned, tmp_path / "sequence", "sequence", "recovery.beam=2")
    start = pruned / "checkpoints" / "checkpoint_pruned.pt"
    data_bin = Path(ce["data_bin"])
    distilled = next((Path(os.environ["HPRUNE_DATA_ROOT"]) / "distilled").glob(f"{data_bin.parent.name}-*"))
    teacher = {"_name": "hprune_distill", "teacher": ce["checkpoint"], "teacher_weight": 0.5}
    runs = {"ce": (ce, data_bin, {}), "word": (word_metrics, data_bin, teacher), "sequence": (sequence, distilled, {})}
    for loss, (metrics, data, criterion) in runs.items():
        assert metrics["recovery_loss"] == loss and metrics["recovery_updates"] == UPDATES
        before, after = objective(start, data, criterion), objective(Path(metrics["recovery_checkpoint"]), data, criterion)
        print(f"{loss}: objective {before:.4f} -> {after:.4f} bits/token; BLEU {metrics['bleu_before_recovery']:.2f} "
              f"-> {metrics['bleu_recovered']:.2f} (unpruned {metrics['bleu_recovered'] - metrics['delta_bleu_recovered']:.2f})")
        assert after < before - 0.01, loss
        assert metrics["bleu_before_recovery"] == ce["bleu"]  # the start is the method's pruned model
        assert 0 <= metrics["p_recovered_vs_pruned"] <= 1 and 0 <= metrics["p_recovered_vs_unpruned"] <= 1
    # the teacher's translations differ from the references somewhere (this young model is no perfect teacher), and
    # the sequence-level data holds them: what it trained on is not the references
    from fairseq.data.indexed_dataset import MMapIndexedDataset
    own, taught = (MMapIndexedDataset(str(d / "train.src-tgt.tgt")) for d in (data_bin, distilled))
    assert len(own) == len(taught) and sum(not torch.equal(own[i], taught[i]) for i in range(len(own))) > 10
    log = (word_dir / "recover.log").read_text()
    assert "distill_kl" in log  # the word-level loss logs how far the student is from the teacher


def test_what_was_removed_stays_removed(pruned):
    from hprune import backend

    metrics = json.loads((pruned / "metrics.json").read_text())
    start = backend.read_checkpoint(pruned / "checkpoints" / "checkpoint_pruned.pt")
    recovered = backend.read_checkpoint(Path(metrics["recovery_checkpoint"]))
    assert recovered.cfg.model.kept_heads == start.cfg.model.kept_heads
    assert recovered.cfg.model.kept_neurons == start.cfg.model.kept_neurons
    mask = json.loads((pruned / "head_mask.json").read_text())
    for key, weights in (("encoder.layers.{}.fc1.weight", mask["enc-ffn"]), ("decoder.layers.{}.fc1.weight", mask["dec-ffn"])):
        for layer, row in enumerate(weights):  # every tensor has the pruned shape: nothing could grow back
            assert recovered.state["model"][key.format(layer)].shape[0] == max(int(sum(row)), 1)
    heads = json.loads(recovered.cfg.model.kept_heads)
    assert [len(ids) for ids in heads["enc-self"]] == [int(sum(row)) for row in mask["enc-self"]]
    assert metrics["kept_heads"] < 36 and metrics["kept_neurons"] < 1536


def test_the_recovered_model_exports_to_ctranslate2_with_parity(word, tmp_path):
    pytest.importorskip("ctranslate2")
    _, metrics = word
    out = tmp_path / "export"
    hprune("export", f"ckpt={metrics['recovery_checkpoint']}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu")
    exported = json.loads((out / "metrics.json").read_text())
    assert exported["parity_max_log_prob_diff"] < 1e-4
    assert exported["parity_ended_differ"] == exported["parity_ended_differ_min_len"] + exported["parity_ended_differ_tie"]
    assert exported["bleu_hprune"] == metrics["bleu_recovered"] and abs(exported["bleu"] - exported["bleu_hprune"]) < 1


def test_a_killed_recovery_resumes_to_the_weights_of_one_never_interrupted(trained_run, pruned, word, tmp_path):
    out = tmp_path / "killed"
    proc = recover(trained_run, pruned, out, "word", popen=True)
    deadline = time.time() + 300
    while not list((out / "recovery" / "checkpoints").glob("checkpoint_*_6.pt")) and time.time() < deadline:
        assert proc.poll() is None, "the recovery ended before it could be interrupted"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "metrics.json").exists()
    recover(trained_run, pruned, out, "word")  # the same command again
    resumed = torch.load(out / "recovery" / "checkpoints" / "checkpoint_last.pt", weights_only=False)
    reference = torch.load(word[1]["recovery_checkpoint"], weights_only=False)
    assert resumed["optimizer_history"][-1]["num_updates"] == UPDATES
    for name, tensor in reference["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, atol=1e-5, rtol=0, msg=name)
