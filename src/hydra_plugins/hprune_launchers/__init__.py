"""hprune's Hydra launchers for SLURM (`hydra/launcher=slurm`), submitit's launchers with two changes:

* in the job, a task that fails ends with a non-zero status and leaves its error where submitit reads it: a
  UserError's `sys.exit` (which would escape submitit's wrapper, that catches Exception only, leaving no result)
  and an exception that Hydra's `run_job` keeps inside its return value (the task would exit 0, and SLURM's
  --kill-on-bad-exit would not stop the step's other tasks) both become an exception of the task;
* on the login node, the sweep waits for every job: a job that fails is one line naming it and the path of its
  log (kept in FAILED), the others complete and are collected as usual, and the CLI then exits with status 3
  (a job failed; 2 is bad input).

`sbatch_text()` renders a job's sbatch file without SLURM, for checks (tests/test_cluster.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from omegaconf import OmegaConf

FAILED: List[str] = []  # this process's failed jobs, one line each


class JobError(RuntimeError):
    """A job's task failed; its own one line (or traceback) is in the task's log."""


class _Waiting:
    """The changes, over one of submitit's launcher classes."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        if not self.params.get("gpus_per_node"):  # a CPU job: no GPU option at all (sbatch reads 0 as a count)
            self.params.pop("gpus_per_node", None)
        problem = _check(self.params)
        if problem:  # before anything is submitted, in one line (Hydra would print a stack)
            print(f"hprune: error: {problem}", file=sys.stderr)
            sys.exit(2)

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        try:
            result = super().__call__(*args, **kwargs)
        except SystemExit as exit_:  # hprune's one line is already on this task's stderr
            if exit_.code in (0, None):
                raise
            raise JobError(f"the task ended with status {exit_.code}") from None
        if result.status == JobStatus.FAILED:
            raise result._return_value
        return result

    def executor(self):
        """submitit's executor with this launcher's parameters, as the plugin maps them."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        generic = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{key if key in generic else f"{self._EXECUTOR}_{key}": value
                                      for key, value in self.params.items()
                                      if key not in ("submitit_folder", "max_num_timeout")})
        return executor

    def sbatch_text(self, command: str = "python -u -m submitit.core._submit FOLDER") -> str:
        """The sbatch file a job of this launcher gets, rendered by submitit as the executor would render it, with
        no SLURM needed (submitit's executor insists on finding srun)."""
        from submitit.slurm import slurm

        names = slurm.SlurmExecutor._equivalence_dict()
        params = {names.get(key, key): value for key, value in self.params.items()
                  if key not in ("submitit_folder", "max_num_timeout")}
        if "mem" in params:
            params["mem"] = slurm._convert_mem(params["mem"])
        return slurm._make_sbatch_string(command=command, folder=self.params["submitit_folder"], **params)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        arguments = [(list(overrides), "hydra.sweep.dir", initial_job_idx + n, f"job_id_for_{initial_job_idx + n}",
                      Singleton.get_state()) for n, overrides in enumerate(job_overrides)]
        jobs = self.executor().map_array(self, *zip(*arguments))
        results: List[JobReturn] = []
        shared = set.intersection(*(set(filter_overrides(o)) for o in job_overrides))
        for n, (job, overrides) in enumerate(zip(jobs, job_overrides)):
            try:
                results.append(job.results()[0])
            except Exception:  # noqa: BLE001 - submitit's FailedJobError / UncompletedJobError, or anything else
                log = Path(job.paths.stderr)
                own = " ".join(o for o in filter_overrides(overrides) if o not in shared)
                FAILED.append(f"job {initial_job_idx + n} ({own + ', ' if own else ''}submitit job {job.job_id}) failed: "
                              f"{_last_error(log)}; its log: {log}")
                print(f"hprune {self.config.get('verb', '')}: error: {FAILED[-1]}", file=sys.stderr)
        return results  # the jobs that completed, for Hydra's callbacks (sweep.csv); the CLI exits with status 3


def _check(params: dict) -> Optional[str]:
    """What sbatch would refuse, or what would leave a task without a GPU, as one line."""
    for key in ("tasks_per_node", "nodes", "cpus_per_task", "gpus_per_node", "timeout_min", "mem_gb"):
        value = params.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"hydra.launcher.{key}={value} must be a whole number >= 1 (sbatch refuses anything else)"
    tasks, gpus = params.get("tasks_per_node", 1), params.get("gpus_per_node")
    if gpus and tasks > gpus:
        return (f"hydra.launcher.tasks_per_node={tasks} tasks on {gpus} GPU(s) a node: each task of a training is "
                f"a worker on its own GPU; ask for hydra.launcher.gpus_per_node={tasks} or fewer tasks")
    return None


def _last_error(log: Path) -> str:
    """The line of a task's log that says what went wrong: hprune's own one line, else the exception's."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log was written (the job did not start, or was killed before it began)"
    ours = [line for line in lines if line.startswith("hprune ") and ": error: " in line]
    if ours:
        return ours[-1].split(": error: ", 1)[1]
    raised = [line for line in lines if not line.startswith(("File ", "^", "Traceback", "submitit ", "["))]
    return raised[-1][:300] if raised else "see its log"


class SlurmLauncher(_Waiting, submitit_launcher.SlurmLauncher):
    pass


class LocalSubmititLauncher(_Waiting, submitit_launcher.LocalLauncher):
    """The same on this machine (submitit's local executor): what the tests run."""
