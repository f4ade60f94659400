"""Shared helpers for the benchmarks: compose a config, prepare the data, run fairseq CLIs."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

BIN = Path(sys.executable).parent
logging.basicConfig(level=logging.WARNING)  # fairseq's import-time logging is noise here


def config(name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def prepared_data(cfg) -> Path:
    from hprune.data.prepare import bind, prepare
    return prepare(bind(cfg.data), cfg.paths.data_root)


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text)]


def demo_checkpoint(tmp: str) -> Path:
    """outputs/demo's model (from `make demo`) when present, else a short training run in tmp."""
    demo = Path("outputs/demo/checkpoints/checkpoint_best.pt")
    if demo.exists():
        return demo
    run([str(BIN / "hprune"), "train", f"hydra.run.dir={tmp}/train", "optim.max_update=300", "device=cpu"])
    return Path(tmp) / "train" / "checkpoints" / "checkpoint_best.pt"


def base_checkpoint() -> Path:
    """A transformer_base-sized model (Vaswani et al. dimensions, 8 heads) on the synthetic task's vocabulary,
    for speed measurements that should not be dominated by Python overhead. Its weights barely matter (one
    update), so it is built once and kept in outputs/bench/."""
    out = Path("outputs/bench/transformer_base")
    ckpt = out / "checkpoints" / "checkpoint_last.pt"
    if not ckpt.exists():
        run([str(BIN / "hprune"), "train", f"hydra.run.dir={out}", "model=transformer_base", "optim.max_update=1",
             "optim.max_tokens=1024", "device=cpu"])
    return ckpt
