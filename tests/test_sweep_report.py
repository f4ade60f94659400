"""Sweeps with parallel jobs lose nothing, and a killed job shows up in the report as incomplete."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd

from conftest import HPRUNE, ROOT, SMALL_DATA, SMALL_TRAIN, hprune


def test_parallel_sweep_rows_arrive_intact_and_a_killed_job_is_listed(trained_run, tmp_path):
    parallel = tmp_path / "parallel"
    hprune("eval", "-m", f"ckpt={trained_run}", *SMALL_DATA, "device=cpu", "hydra/launcher=local",
           "hydra.launcher.n_jobs=2", "generation.beam=1,2,3,4", f"hydra.sweep.dir={parallel}",
           subprocess=True)  # joblib's worker processes
    jobs = {str(i): json.loads((parallel / str(i) / "metrics.json").read_text()) for i in range(4)}

    killed = tmp_path / "killed"
    proc = subprocess.Popen([*HPRUNE, "train", "-m", *SMALL_TRAIN, "optim.max_update=100000", "seed=1,2",
                             f"hydra.sweep.dir={killed}"], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    deadline = time.time() + 300
    while not (killed / "0" / "checkpoints").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # as a node failure or `scancel` would
    proc.wait()
    assert (killed / "0" / ".hydra").is_dir() and not (killed / "0" / "metrics.json").exists()

    out = tmp_path / "report"
    result = hprune("report", str(parallel), str(killed), f"hydra.run.dir={out}",
                    "columns=[run,generation.beam,bleu,chrf,sentences]")
    runs = pd.read_csv(out / "runs.csv")
    assert sorted(runs["run"]) == [f"parallel/{i}" for i in range(4)]
    for row in runs.itertuples():
        job = jobs[row.run.split("/")[1]]
        assert (row.bleu, row.chrf, row.sentences) == (job["bleu"], job["chrf"], job["sentences"])
    assert sorted(runs["generation.beam"]) == [1, 2, 3, 4]  # each job's own settings, not another's
    assert "incomplete runs (1): killed/0 (no metrics.json" in result.stdout
    assert (out / "incomplete.txt").read_text().startswith("killed/0: no metrics.json")


def test_submitit_runs_sweep_jobs_as_on_slurm_and_a_failed_job_is_one_line(trained_run, tmp_path):
    """submitit's local executor pickles and runs the jobs as its SLURM executor does (no cluster needed), under
    hprune's launcher: a job that fails (generation.beam=0, refused inside the job) is one line naming it and its
    log, the other job completes and is collected, and the sweep exits with status 3."""
    sweep = tmp_path / "submitit"
    proc = hprune("eval", "-m", f"ckpt={trained_run}", *SMALL_DATA, "device=cpu", "hydra/launcher=submitit_local",
                  "hydra.launcher._target_=hydra_plugins.hprune_launchers.LocalSubmititLauncher", "generation.beam=1,0,2",
                  f"hydra.sweep.dir={sweep}", subprocess=True, check=False)  # submitit's job processes
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hprune eval: error: job ")]
    assert len(errors) == 1 and errors[0].startswith("hprune eval: error: job 1 (generation.beam=0, submitit job ")
    assert ") failed: generation.beam=0 must be a whole number" in errors[0]
    log = Path(errors[0].rsplit("its log: ", 1)[1])
    assert log.exists() and "generation.beam=0 must be" in log.read_text()
    table = pd.read_csv(sweep / "sweep.csv")  # the jobs that completed, collected as usual
    assert table["generation.beam"].tolist() == [1, 2]
    assert table["bleu"].tolist() == [json.loads((sweep / str(i) / "metrics.json").read_text())["bleu"]
                                      for i in (0, 2)]
    assert not (sweep / "1" / "metrics.json").exists()
    assert list((sweep / ".submitit").iterdir())  # the jobs went through submitit
