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
    from hprune.data.prepare import prepare
    return prepare(cfg.data, cfg.paths.data_root)


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text)]
