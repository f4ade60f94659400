"""fairseq checkpoints load under weights_only=True with exactly the allow-listed classes; anything else is refused."""
import argparse
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from hprune_fairseq.safe_load import SAFE_GLOBALS, CorruptCheckpointError, UnsafeCheckpointError, load_checkpoint


class RunsCommandOnLoad:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_allow_list_is_exactly_namespace_and_the_legacy_meters():
    """The legacy `args` and fairseq 0.6-0.9's three training meters, under the names they were pickled with."""
    from hprune_fairseq.safe_load import LegacyMeter
    assert SAFE_GLOBALS == [argparse.Namespace] + [(LegacyMeter, f"fairseq.meters.{name}")
                                                   for name in ("AverageMeter", "TimeMeter", "StopwatchMeter")]


def test_only_the_listed_legacy_names_load(tmp_path):
    """A legacy meter loads as plain data; another class under the same old module path is refused."""
    import sys
    import types

    legacy = types.ModuleType("fairseq.meters")
    for name in ("AverageMeter", "OtherThing"):
        setattr(legacy, name, type(name, (), {"__module__": "fairseq.meters"}))
    saved = sys.modules.get("fairseq.meters")
    sys.modules["fairseq.meters"] = legacy
    try:
        meter, other = legacy.AverageMeter(), legacy.OtherThing()
        meter.avg, meter.count = 2.5, 4
        torch.save({"model": {}, "extra_state": {"train_meters": {"train_loss": meter}}}, tmp_path / "old.pt",
                   _use_new_zipfile_serialization=False)
        torch.save({"model": {}, "x": other}, tmp_path / "other.pt", _use_new_zipfile_serialization=False)
    finally:
        sys.modules.pop("fairseq.meters")
        if saved is not None:
            sys.modules["fairseq.meters"] = saved
    loaded = load_checkpoint(tmp_path / "old.pt")["extra_state"]["train_meters"]["train_loss"]
    assert (loaded.avg, loaded.count) == (2.5, 4)
    with pytest.raises(UnsafeCheckpointError, match="fairseq.meters.OtherThing"):
        load_checkpoint(tmp_path / "other.pt")


def test_checkpoint_with_namespace_loads(tmp_path):
    path = tmp_path / "ok.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(arch="x"), "cfg": {"a": 1}}, path)
    state = load_checkpoint(path)
    assert state["args"].arch == "x" and torch.equal(state["model"]["w"], torch.ones(2))


def test_code_running_checkpoint_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCommandOnLoad(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system|refusing"):
        load_checkpoint(path)
    assert not marker.exists()
    # and the stock loader (what fairseq calls) refuses it too once the plugin is imported
    import hprune_fairseq  # noqa: F401
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_checkpoint_is_reported(tmp_path, damage):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.randn(1000)}}, path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"not a checkpoint", "empty": b""}[damage])
    with pytest.raises(CorruptCheckpointError, match="truncated or not a torch checkpoint|not a readable"):
        load_checkpoint(path)


def test_non_fairseq_file_is_reported(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(CorruptCheckpointError, match="no 'model' entry"):
        load_checkpoint(path)
    assert zipfile.is_zipfile(path)


def test_training_maps_the_model_it_starts_from_but_reads_its_own_resume_point(tmp_path):
    """backend.training.starting_model_mapped: a checkpoint outside the save dir is mapped (its pages in
    /proc/self/maps, not read into memory), one inside it read as before; the same tensors either way."""
    from hprune.backend.training import starting_model_mapped
    save_dir = tmp_path / "checkpoints"
    save_dir.mkdir()
    state = {"model": {"w": torch.arange(300_000, dtype=torch.float32)}}
    start, resume = tmp_path / "start.pt", save_dir / "checkpoint_last.pt"
    for path in (start, resume):
        torch.save(state, path)
    with starting_model_mapped(save_dir):
        with open(start, "rb") as f:  # as fairseq's load_checkpoint_to_cpu reads
            started = torch.load(f, map_location="cpu")
        with open(resume, "rb") as f:
            resumed = torch.load(f, map_location="cpu")
        maps = Path("/proc/self/maps").read_text()
    assert str(start) in maps and str(resume) not in maps
    assert torch.equal(started["model"]["w"], state["model"]["w"]) and torch.equal(resumed["model"]["w"], state["model"]["w"])
