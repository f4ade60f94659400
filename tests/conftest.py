"""Shared fixtures: a small synthetic data set and one small trained run, built once per session."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# sacreBLEU reads $SACREBLEU once, at import: point it at a private cache before anything imports it.
os.environ["SACREBLEU"] = tempfile.mkdtemp(prefix="hprune-sacrebleu-")
ROOT = Path(__file__).resolve().parents[1]
HPRUNE = [sys.executable, "-m", "hprune_cli.main"]
# A small corpus and a short schedule: the pipeline, not the translation quality, is under test here.
SMALL_DATA = ["data.params.n_train=2000", "data.params.n_valid=100", "data.params.n_test=100",
              "data.params.n_names=40"]
SMALL_TRAIN = SMALL_DATA + ["optim.max_update=150", "optim.max_tokens=2048", "optim.warmup_updates=50",
                            "save_interval_updates=25", "log_interval=25", "device=cpu"]


@pytest.fixture(scope="session", autouse=True)
def data_root(tmp_path_factory) -> Path:
    """Every test (and every hprune subprocess) shares one data cache."""
    root = tmp_path_factory.mktemp("data-bin")
    os.environ["HPRUNE_DATA_ROOT"] = str(root)
    return root


def hprune(*args: str, check: bool = True, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the hprune CLI as a user would."""
    proc = subprocess.run([*HPRUNE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and proc.returncode != 0:
        raise AssertionError(f"hprune {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("train") / "run"
    hprune("train", f"hydra.run.dir={run}", *SMALL_TRAIN)
    return run


@pytest.fixture(scope="session")
def evaluated_run(trained_run, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("eval") / "run"
    hprune("eval", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu")
    return out, json.loads((out / "metrics.json").read_text())
