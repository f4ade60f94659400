"""Shared fixtures: a small synthetic data set and one small trained run, built once per test run, for every
pytest-xdist worker (`make test` runs two): the first worker to need one builds it under a file lock, the others
wait and read it."""
from __future__ import annotations

import atexit
import contextlib
import copy
import io
import json
import os
import shutil
import subprocess as sp
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins

# A fresh `hprune` process composes its config before it imports fairseq, whose import fills Hydra's config
# store with fairseq's groups (model/transformer, ...). Test modules import fairseq while they are collected,
# so in-process runs compose against the store as it was before: Hydra's plugins (launchers) registered, no
# fairseq. Taken here, as conftest is imported before any test module.
Plugins.instance()
STORE_WITHOUT_FAIRSEQ = copy.deepcopy(ConfigStore.instance().repo)

# sacreBLEU reads $SACREBLEU once, at import: point it at a private cache before anything imports it.
os.environ["SACREBLEU"] = tempfile.mkdtemp(prefix="hprune-sacrebleu-")
atexit.register(shutil.rmtree, os.environ["SACREBLEU"], ignore_errors=True)  # not left behind in /tmp
ROOT = Path(__file__).resolve().parents[1]
HPRUNE = [sys.executable, "-m", "hprune_cli.main"]
# A small corpus and a short schedule: the pipeline, not the translation quality, is under test here.
SMALL_DATA = ["data.params.n_train=2000", "data.params.n_valid=100", "data.params.n_test=100",
              "data.params.n_names=40"]
SMALL_TRAIN = SMALL_DATA + ["optim.max_update=150", "optim.max_tokens=2048", "optim.warmup_updates=50",
                            "save_interval_updates=25", "log_interval=25", "device=cpu"]


if os.environ.get("PYTEST_XDIST_WORKER"):  # one core a worker: two workers on two cores, not four threads
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)


def shared(tmp_path_factory, name: str, build) -> Path:
    """`<the test run's temp root>/<name>`, built once by `build(path)` for all xdist workers."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    path = root / name
    with FileLock(f"{path}.lock"):
        if not (root / f"{name}.done").exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            (root / f"{name}.done").write_text("")
    return path


@pytest.fixture(scope="session", autouse=True)
def data_root(tmp_path_factory) -> Path:
    """Every test (and every hprune subprocess) shares one data cache (its builds are locked)."""
    root = shared(tmp_path_factory, "data-bin", lambda path: path.mkdir(parents=True))
    os.environ["HPRUNE_DATA_ROOT"] = str(root)
    return root


def hprune(*args: str, check: bool = True, timeout: float = 600, cwd: Path | None = None,
           subprocess: bool = False) -> sp.CompletedProcess:
    """Run the hprune CLI as a user would. By default in this process, through the console script's own entry
    point (`hprune_cli.main.main`: override checks, the verb's Hydra app, the verb), so the fairseq import and
    Hydra's start-up are paid once per test run; with subprocess=True (one test per verb and per class of bad
    input, or HPRUNE_TEST_SUBPROCESS=1 for all) as its own process. `timeout` applies to subprocesses only."""
    if subprocess or os.environ.get("HPRUNE_TEST_SUBPROCESS") == "1":
        proc = sp.run([*HPRUNE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
    else:
        proc = _in_process(list(args), cwd or ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"hprune {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _in_process(args: list[str], cwd: Path) -> sp.CompletedProcess:
    from hprune_cli.main import main

    import hprune.backend  # noqa: F401  (its snapshot of fairseq's config-store entries is taken from the full store)

    out, err = io.StringIO(), io.StringIO()
    argv, here = sys.argv, os.getcwd()
    store = ConfigStore.instance()
    full_repo, store.repo = store.repo, copy.deepcopy(STORE_WITHOUT_FAIRSEQ)
    code = 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(args)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if not isinstance(exit_.code, (int, type(None))):
                    print(exit_.code, file=sys.stderr)
            except Exception:  # as the interpreter would: a traceback on stderr, exit 1
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, store.repo = argv, full_repo
        os.chdir(here)
    return sp.CompletedProcess(["hprune", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, data_root) -> Path:
    # (the train verb as its own process: test_train_eval)
    return shared(tmp_path_factory, "train", lambda run: hprune("train", f"hydra.run.dir={run}", *SMALL_TRAIN))


@pytest.fixture(scope="session")
def evaluated_run(trained_run, tmp_path_factory) -> tuple[Path, dict]:
    out = shared(tmp_path_factory, "eval", lambda out: hprune("eval", f"ckpt={trained_run}", f"hydra.run.dir={out}",
                                                             *SMALL_DATA, "device=cpu", subprocess=True))
    return out, json.loads((out / "metrics.json").read_text())
