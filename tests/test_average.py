"""Checkpoint averaging (train.average_last): the mean of the last N epoch checkpoints' parameters."""
import pytest
import torch

pytest.importorskip("fairseq")
from hprune import backend  # noqa: E402
from hprune.checkpoint_ref import resolve  # noqa: E402
from hprune.errors import UserError  # noqa: E402


def save(path, weight, steps):
    torch.save({"model": {"w": weight, "steps": torch.tensor(steps)}, "cfg": None, "extra_state": {},
                "last_optimizer_state": {"state": 1}}, path)


def test_last_epochs_averaged_in_epoch_order_and_used_by_run_dirs(tmp_path):
    save_dir = tmp_path / "run" / "checkpoints"
    save_dir.mkdir(parents=True)
    weights = {1: torch.randn(3, 4), 2: torch.randn(3, 4), 10: torch.randn(3, 4)}
    for epoch, w in weights.items():
        save(save_dir / f"checkpoint{epoch}.pt", w, epoch)
    save(save_dir / "checkpoint_best.pt", torch.zeros(3, 4), 0)
    assert resolve(str(tmp_path / "run")).checkpoint.name == "checkpoint_best.pt"
    dest = backend.average_checkpoints(save_dir, 2)  # epochs 2 and 10 (not 1 and 10, as a text sort would give)
    state = torch.load(dest, weights_only=True)
    torch.testing.assert_close(state["model"]["w"], torch.stack([weights[2], weights[10]]).mean(0))
    assert state["model"]["steps"].item() == 10  # integers are not averaged: the last checkpoint's
    assert state["last_optimizer_state"] is None
    assert state["extra_state"]["averaged_checkpoints"] == ["checkpoint2.pt", "checkpoint10.pt"]
    assert resolve(str(tmp_path / "run")).checkpoint == dest


def test_nothing_to_average_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no epoch checkpoints"):
        backend.average_checkpoints(tmp_path, 10)


def test_published_directories_resolve_to_their_model_and_ensembles_name_a_member(tmp_path):
    """fairseq's published tarballs unpack to model.pt (or model1.pt ... for an ensemble, which must say which)."""
    single = tmp_path / "wmt14.en-fr.joined-dict.transformer"
    single.mkdir()
    save(single / "model.pt", torch.zeros(1), 0)
    assert resolve(single).checkpoint == single / "model.pt"
    ensemble = tmp_path / "wmt19.en-ru.ensemble"
    ensemble.mkdir()
    for i in (1, 2, 3, 4, 10):
        save(ensemble / f"model{i}.pt", torch.zeros(1), 0)
    with pytest.raises(UserError, match=r"ensemble of 5 models \(model1.pt, model2.pt, model3.pt, model4.pt, "
                                        r"model10.pt\); .* pass one of them, e.g. ckpt=.*model1.pt"):
        resolve(ensemble)
    assert resolve(ensemble / "model2.pt").checkpoint == ensemble / "model2.pt"
