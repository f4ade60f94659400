"""Prepared data is cached by its parameters: built once, rebuilt only when a parameter changes."""
import json

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from hprune.errors import UserError

pytest.importorskip("fairseq")
from hprune.data.prepare import prepare  # noqa: E402


def data_cfg(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        cfg = compose(config_name="data", overrides=["data.params.n_train=600", "data.params.n_valid=20",
                                                     "data.params.n_test=20", "data.params.n_names=20", *overrides])
    GlobalHydra.instance().clear()
    return cfg.data


def test_built_once_and_rebuilt_only_on_change(tmp_path):
    first = prepare(data_cfg(), tmp_path)
    assert (first / "train.src-tgt.src.bin").is_file() and (first / "dict.src.txt").is_file()
    ready = first.parent / "READY"
    stamp = ready.stat().st_mtime_ns
    assert prepare(data_cfg(), tmp_path) == first and ready.stat().st_mtime_ns == stamp
    other = prepare(data_cfg("data.params.seed=7"), tmp_path)
    assert other != first and other.parent.name.startswith("toy-")
    assert json.loads((other.parent / "raw" / "params.json").read_text())["seed"] == 7
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".locks") == sorted([first.parent.name, other.parent.name])


def test_incomplete_folder_is_rebuilt(tmp_path):
    built = prepare(data_cfg(), tmp_path)
    (built.parent / "READY").unlink()  # as if killed before the end
    (built / "train.src-tgt.src.bin").write_bytes(b"")
    rebuilt = prepare(data_cfg(), tmp_path)
    assert (rebuilt / "train.src-tgt.src.bin").stat().st_size > 0


def test_unknown_parameter_is_named(tmp_path):
    with pytest.raises(UserError, match="unknown toy data parameter"):
        prepare(data_cfg("+data.params.n_verb=3"), tmp_path)
