"""Which worker of which job this process is, read in one place from the environment of the launcher that
started it: torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID) or a
multi-task SLURM step's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_ID). No launcher: one worker.

A SLURM job's tasks are workers only inside a step that srun started (SLURM_STEP_NUM_TASKS): an sbatch script
has SLURM_NTASKS and SLURM_PROCID too, but runs one process, which must not wait for peers that never start.

Every worker of a `hprune train` started by torchrun or srun runs the verb. They share one run dir, named after
the job (`torchrun-<run id>`, `slurm-<job id>.<step>`: the clock differs between them, the job does not), and
only rank 0 writes in it: Hydra's `.hydra/` and log file (through the resolvers below) and hprune's files;
fairseq's own checkpoint handling writes the checkpoints from rank 0 too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from omegaconf import OmegaConf

from .errors import UserError

TORCHRUN_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")  # fairseq's test for a torchrun worker


@dataclass(frozen=True)
class Workers:
    """This process's place in its job."""
    launcher: str  # "torchrun" | "slurm" | "" (started by hand, or by hprune's own local launch)
    world_size: int
    rank: int
    local_rank: int
    job: str  # the name every worker of the job reads alike; "" without a launcher

    @property
    def rank_zero(self) -> bool:
        return self.rank == 0


def launched(environ: Optional[dict] = None) -> Workers:
    env = os.environ if environ is None else environ
    if all(key in env for key in TORCHRUN_KEYS) and int(env["WORLD_SIZE"]) > 1:
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        return Workers("torchrun", int(env["WORLD_SIZE"]), int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])),
                       "" if run_id == "none" else f"torchrun-{run_id}")
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))  # a step's tasks; an sbatch script's SLURM_NTASKS is not one
    if "SLURM_PROCID" in env and tasks > 1:
        return Workers("slurm", tasks, int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")),
                       f"slurm-{env.get('SLURM_JOB_ID', 'job')}.{env.get('SLURM_STEP_ID', '0')}")
    return Workers("", 1, 0, 0, "")


def unstarted_slurm_tasks(environ: Optional[dict] = None) -> int:
    """The tasks of a SLURM allocation that run no copy of this process: an sbatch script with several tasks
    (SLURM_NTASKS) that started hprune itself, not through srun (no step). 0 otherwise."""
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" not in env:
        return max(int(env.get("SLURM_NTASKS", "1")) - 1, 0)
    return 0


def cpus_available(environ: Optional[dict] = None) -> int:
    """The CPUs this process may use: its affinity (a SLURM task's or a container's cpuset), at most
    SLURM_CPUS_PER_TASK where SLURM sets it; not os.cpu_count(), the machine's."""
    env = os.environ if environ is None else environ
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        cpus = min(cpus, int(env["SLURM_CPUS_PER_TASK"]))
    return max(cpus, 1)


def worker_threads(workers_here: Optional[int] = None, environ: Optional[dict] = None) -> int:
    """Torch's threads for one training worker: the CPUs this process may use, shared with the other workers
    started on this node (`workers_here`; default: torchrun's LOCAL_WORLD_SIZE, or 1 for a SLURM task, which has
    CPUs of its own)."""
    env = os.environ if environ is None else environ
    here = workers_here or int(env.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cpus_available(env) // max(here, 1))


def slurm_tasks(verb: str, gpus_per_node) -> int:
    """The tasks a SLURM job of `verb` runs on each node (hydra/launcher=slurm): a training, one per GPU (each a
    fairseq worker); every other verb, one (a method that trains starts its workers itself, on the node's GPUs)."""
    return max(int(gpus_per_node or 0), 1) if verb == "train" else 1


def is_rank_zero() -> bool:
    return launched().rank_zero


def check_verb(verb: str) -> None:
    """Only `hprune train` runs as one worker of many; the other verbs run once (their trainings start their
    own workers on this node). A training in an sbatch script of several tasks must be started by srun."""
    unstarted = unstarted_slurm_tasks()
    if verb == "train" and unstarted:
        raise UserError(f"this SLURM job has {unstarted + 1} tasks, but `hprune train` was started once, not by srun, "
                        f"so {unstarted} of them would never start; run it as `srun hprune train ...` in the sbatch "
                        "script (or ask for one task)")
    workers = launched()
    if workers.world_size > 1 and verb != "train":
        raise UserError(f"{workers.launcher} started {workers.world_size} copies of `hprune {verb}`, which runs as one "
                        f"process (its trainings use every GPU of the node); start it once, e.g. one SLURM task "
                        f"(hydra.launcher.tasks_per_node=1) or without torchrun")


def check_run_dir(overrides: list[str]) -> Optional[str]:
    """A torchrun job without a run id (its static rendezvous) gives the workers no name to agree on: they
    need the run dir on the command line."""
    workers = launched()
    if workers.launcher == "torchrun" and not workers.job and not any(o.startswith("hydra.run.dir=") for o in overrides):
        return ("torchrun started this worker without a run id, so its workers cannot agree on a run dir; pass "
                "hydra.run.dir=<dir> (the same on every node), or start torchrun with --rdzv-id=<name> or --standalone")
    return None


def _run_name(pattern: str) -> str:
    """The run dir's last part: the job's name under a launcher, else the time stamp."""
    return launched().job or datetime.now().strftime(pattern)


def _rank_zero_only(value):
    """`value` on rank 0; None (Hydra's `output_subdir`: no .hydra/) elsewhere."""
    return value if is_rank_zero() else None


def _rank_zero_file(path: str) -> str:
    """Rank 0's log file; the other workers' logs go nowhere (their errors still reach stderr)."""
    return path if is_rank_zero() else os.devnull


OmegaConf.register_new_resolver("hprune.run_name", _run_name, use_cache=True, replace=True)
OmegaConf.register_new_resolver("hprune.rank_zero_only", _rank_zero_only, replace=True)
OmegaConf.register_new_resolver("hprune.rank_zero_file", _rank_zero_file, replace=True)
OmegaConf.register_new_resolver("hprune.slurm_tasks", slurm_tasks, replace=True)
