"""fairseq's data parallelism on CPUs (gloo): two workers, started by torchrun, by a (simulated) SLURM step or by
hprune itself, reach the weights of one worker with update_freq 2 over the same batches; one run dir, written
by rank 0 alone; a killed worker ends the job in one line and the same command resumes it. Dropout is off: the
workers draw their own dropout masks, so only then are the two trainings the same computation."""
from __future__ import annotations

import json
import os
import signal
import subprocess as sp
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import HPRUNE, ROOT, SMALL_DATA, hprune, shared
from test_cli import assert_one_line_error

UPDATES = 20
# dropout off; small batches, so that 20 updates of two batches each cross into a second epoch
TRAIN = [*SMALL_DATA, f"optim.max_update={UPDATES}", "optim.max_tokens=1024", "model.dropout=0", "device=cpu",
         "save_interval_updates=5", "log_interval=5"]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # the reference's threads too


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, data_root) -> Path:
    """The reference: one worker, update_freq 2."""
    def build(run):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each worker below: summation order is part of the result
        try:
            hprune("train", f"hydra.run.dir={run}", *TRAIN, "optim.update_freq=2")
        finally:
            torch.set_num_threads(threads)
    return shared(tmp_path_factory, "ddp-reference", build)


def largest_difference(run: Path, reference: Path) -> float:
    ours, theirs = (torch.load(r / "checkpoints" / "checkpoint_last.pt", weights_only=False) for r in (run, reference))
    assert ours["optimizer_history"][-1]["num_updates"] == theirs["optimizer_history"][-1]["num_updates"] == UPDATES
    return max((ours["model"][k].double() - theirs["model"][k].double()).abs().max().item() for k in theirs["model"])


def the_one_run_dir(output_root: Path) -> Path:
    """The launched workers made one run dir, in which rank 0 alone wrote."""
    runs = [p for p in (output_root / "train").iterdir()]
    assert len(runs) == 1, runs
    run = runs[0]
    assert len(list(output_root.rglob("metrics.json"))) == 1
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["workers"] == 2 and metrics["train_tokens_per_s"] > 0
    log = (run / "train.log").read_text()
    assert "distributed init (rank 0)" in log and "(rank 1)" not in log  # Hydra's log file is rank 0's
    assert (run / ".hydra" / "config.yaml").exists()
    return run


def test_two_torchrun_workers_train_as_one_worker_with_update_freq_2(one_worker, tmp_path):
    out = tmp_path / "out"
    proc = sp.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "-m", "hprune_cli.main", "train", f"paths.output_root={out}", *TRAIN, "optim.update_freq=1"],
                  cwd=ROOT, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = the_one_run_dir(out)
    assert run.name.startswith("torchrun-")  # named after the job: the workers' clocks differ
    assert proc.stdout.count("trained 20 updates") == 1  # rank 1 says nothing
    assert largest_difference(run, one_worker) <= 1e-5


def test_a_slurm_step_of_two_tasks_trains_as_one_worker(one_worker, tmp_path):
    """SLURM's variables as srun sets them for two tasks on one node, and a stand-in `scontrol` on PATH: fairseq
    reads the step itself. distributed.batch=total keeps update_freq=2 as the update's total."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n# scontrol show hostnames LIST\necho localhost\n")
    (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / "out"
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1",
            "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2"}
    tasks = [sp.Popen([*HPRUNE, "train", f"paths.output_root={out}", *TRAIN, "optim.update_freq=2",
                       "distributed.batch=total"], cwd=ROOT, stdout=sp.PIPE, stderr=sp.PIPE, text=True,
                      env={**ONE_THREAD, **step, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}) for rank in (0, 1)]
    outputs = [task.communicate(timeout=300) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    run = the_one_run_dir(out)
    assert run.name == "slurm-4242.0"
    assert outputs[1] == ("", "")  # rank 1: nothing on the terminal
    assert json.loads((run / "metrics.json").read_text())["update_freq"] == 1
    assert largest_difference(run, one_worker) <= 1e-5


def test_a_killed_worker_ends_the_training_in_one_line_and_the_same_command_resumes(one_worker, tmp_path):
    """hprune starts the two workers itself (distributed.world_size=2): kill -9 of one, then the same command."""
    run = tmp_path / "run"
    command = [*HPRUNE, "train", f"hydra.run.dir={run}", *TRAIN, "optim.update_freq=1", "distributed.world_size=2"]
    proc = sp.Popen(command, cwd=ROOT, env=ONE_THREAD, stdout=sp.PIPE, stderr=sp.PIPE, text=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "checkpoint_1_5.pt").exists() and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    rank_one = [pid for pid in _descendants(proc.pid) if _environment(pid).get("RANK") == "1"]
    assert len(rank_one) == 1
    os.kill(rank_one[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    line = assert_one_line_error(sp.CompletedProcess(command, proc.returncode, stdout, stderr),
                                 "worker 1 of 2 was killed by SIGKILL", "run the same command again")
    assert not (run / "metrics.json").exists(), line
    saved = max(int(p.stem.rsplit("_", 1)[1]) for p in (run / "checkpoints").glob("checkpoint_1_*.pt"))
    assert saved < UPDATES, "the kill came after the training had ended"
    again = sp.run(command, cwd=ROOT, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Loaded checkpoint {run / 'checkpoints' / 'checkpoint_last.pt'}" in (run / "train.log").read_text()
    assert largest_difference(run, one_worker) <= 1e-5  # the resumed run is the uninterrupted one


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children] + [d for c in children for d in _descendants(int(c))]


def _environment(pid: int) -> dict:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


# ------------------------------------------------------------------------------------ the plan, and bad input
def _plan(monkeypatch, gpus: int, env: dict | None = None, update_freq: int = 1, **distributed):
    from argparse import Namespace

    from hprune.backend.distributed import plan

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    args = Namespace(cpu=gpus == 0, update_freq=[update_freq], max_tokens=4096)
    return plan(OmegaConf.create(distributed), args)


def test_every_visible_gpu_by_default_and_the_batch_each_mode_makes(monkeypatch):
    eight = _plan(monkeypatch, gpus=8, update_freq=16)
    assert (eight.world_size, eight.starts_workers, eight.update_freq) == (8, True, 16)
    assert eight.max_tokens_per_update == 4096 * 16 * 8
    assert eight.flags[eight.flags.index("--distributed-backend") + 1] == "nccl"
    total = _plan(monkeypatch, gpus=8, update_freq=16, batch="total")
    assert (total.update_freq, total.max_tokens_per_update) == (2, 4096 * 16)
    cpu = _plan(monkeypatch, gpus=0)
    assert (cpu.world_size, cpu.starts_workers, cpu.flags) == (1, False, ["--distributed-world-size", "1",
                                                                          "--update-freq", "1"])
    limited = _plan(monkeypatch, gpus=8, world_size=2)
    assert limited.world_size == 2


def test_requests_the_machine_cannot_serve_are_one_clear_error(monkeypatch):
    from hprune.errors import UserError

    with pytest.raises(UserError, match=r"distributed.world_size=4 asks for more workers than this node's 2 GPU.*"
                                        r"hydra/launcher=slurm hydra.launcher.nodes=N"):
        _plan(monkeypatch, gpus=2, world_size=4)
    with pytest.raises(UserError, match="update_freq=3 over 2 workers"):
        _plan(monkeypatch, gpus=2, update_freq=3, batch="total")
    with pytest.raises(UserError, match="distributed.world_size=4, but torchrun started 2 workers"):
        _plan(monkeypatch, gpus=2, world_size=4, env={"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "RANK": "0",
                                                      "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(UserError, match="worker 2 of this node, which has 2 GPU"):
        _plan(monkeypatch, gpus=2, env={"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "RANK": "2",
                                        "WORLD_SIZE": "4", "LOCAL_RANK": "2"})
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1",
             "SLURM_PROCID": "0"}
    with pytest.raises(UserError, match="one task per node on 8 GPU.*one task per GPU"):
        _plan(monkeypatch, gpus=8, env=slurm)
    one_gpu_a_node = _plan(monkeypatch, gpus=1, env=slurm)  # fairseq's reading of one task per node then holds
    port = one_gpu_a_node.flags[one_gpu_a_node.flags.index("--distributed-port") + 1]
    assert port == _plan(monkeypatch, gpus=1, env={**slurm, "SLURM_PROCID": "1"}).flags[-1]  # alike on every task


def test_verbs_that_run_once_refuse_to_be_started_per_worker(monkeypatch, trained_run, tmp_path):
    for key, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "9"}.items():
        monkeypatch.setenv(key, value)
    proc = hprune("eval", f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'eval'}", *SMALL_DATA, "device=cpu",
                  check=False)
    assert_one_line_error(proc, "slurm started 2 copies of `hprune eval`", "start it once")
    monkeypatch.delenv("SLURM_PROCID")
    for key, value in {"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2",
                       "TORCHELASTIC_RUN_ID": "none"}.items():
        monkeypatch.setenv(key, value)
    proc = hprune("train", *TRAIN, check=False)
    assert_one_line_error(proc, "without a run id", "hydra.run.dir=<dir>", "--rdzv-id")
