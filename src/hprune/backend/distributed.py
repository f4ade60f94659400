"""Data-parallel training is fairseq's own: this module only decides how many workers there are and gives
fairseq the flags that say so, and starts this node's workers when no launcher started hprune.

Three ways a training gets its workers (docs/scaling.md):
  * one worker: this process trains (`--distributed-world-size 1`, so fairseq never spawns on its own);
  * a launcher started hprune once per worker (torchrun, or srun: a multi-task SLURM job): this process is one
    of them; torchrun's variables become fairseq's env:// flags, a SLURM step is read by fairseq itself
    (`--distributed-port`, `scontrol show hostnames`);
  * several workers asked on one node (every visible GPU by default): this process starts them with torch's
    elastic launcher, torchrun's engine, each running `python -m hprune.worker`, and waits.
On CPUs the workers talk through gloo, with fairseq's legacy_ddp (torch's DistributedDataParallel refuses the
device ids fairseq passes for a CPU model); on GPUs through NCCL with torch's DistributedDataParallel.
"""
from __future__ import annotations

import contextlib
import importlib.resources
import json
import logging
import os
import random
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from ..console import is_verbose, log_file, to_log_file_only
from ..errors import JobFailed, UserError
from ..launch import Workers, launched, worker_threads

log = logging.getLogger(__name__)
DEFAULTS = OmegaConf.load(importlib.resources.files("hprune_configs") / "distributed" / "default.yaml")  # callers
# without a composed config (tests, scripts) get the config group's defaults
BATCH_MODES = ("per_worker", "total")


@dataclass(frozen=True)
class Plan:
    """How one training runs: its workers and the fairseq flags every worker adds to the command line."""
    world_size: int
    starts_workers: bool  # this process starts the node's workers (no launcher started it)
    update_freq: List[int]  # each worker's (fairseq's per-epoch list: one value, or one per epoch)
    max_tokens: Optional[int]  # each worker's batch
    flags: List[str]

    @property
    def max_tokens_per_update(self) -> Optional[int]:
        """The cap on the tokens of one update (the first epoch's): max_tokens a batch (fairseq bounds a batch's
        sentences times its longest padded side), update_freq batches a worker, summed over the workers."""
        return None if self.max_tokens is None else self.max_tokens * self.update_freq[0] * self.world_size


def plan(distributed: Optional[DictConfig], args) -> Plan:
    """The workers of a training whose fairseq arguments are `args`, under `distributed` (world_size, batch,
    port, timeout) and the launcher that started this process."""
    cfg = OmegaConf.merge(DEFAULTS, distributed or {})
    workers, cpu = launched(), bool(args.cpu)
    gpus = 0 if cpu else torch.cuda.device_count()
    world = _world_size(cfg.world_size, workers, cpu, gpus)
    if cfg.batch not in BATCH_MODES:
        raise UserError(f"distributed.batch={cfg.batch} is not one of {', '.join(BATCH_MODES)}")
    update_freq, max_tokens = [int(n) for n in args.update_freq], args.max_tokens
    if cfg.batch == "total":
        update_freq, max_tokens = _spread(update_freq, max_tokens, getattr(args, "batch_size", None), world)
    flags = ["--distributed-world-size", str(world), "--update-freq", ",".join(map(str, update_freq))]
    if max_tokens != args.max_tokens:
        flags += ["--max-tokens", str(max_tokens)]
    if world > 1:
        # each worker reads the checkpoint it resumes from: fairseq's broadcast of rank 0's copy unpickles its
        # config objects, which torch's weights-only loading (rightly) refuses
        flags += ["--distributed-no-spawn", "--distributed-backend", "gloo" if cpu else "nccl",
                  "--ddp-backend", "legacy_ddp" if cpu else "pytorch_ddp", "--load-checkpoint-on-all-dp-ranks"]
        if workers.launcher == "slurm":
            flags += ["--distributed-port", str(_slurm_port(cfg.port, gpus))]
    return Plan(world, world > 1 and not workers.launcher, update_freq, max_tokens, flags)


def _spread(update_freq: List[int], max_tokens: Optional[int], max_sentences: Optional[int],
            world: int) -> tuple:
    """distributed.batch=total: each worker's update_freq (and, where the workers outnumber it, a share of
    max_tokens), so that an update holds at most what it holds on one worker."""
    if all(n % world == 0 for n in update_freq):
        return [n // world for n in update_freq], max_tokens
    asked = ",".join(map(str, update_freq))
    if len(update_freq) == 1 and world % update_freq[0] == 0 and max_tokens and not max_sentences:
        share = max_tokens * update_freq[0] // world  # the workers split one update's batches
        return [1], share
    raise UserError(f"distributed.batch=total spreads update_freq={asked} over {world} workers, which does not "
                    f"divide it; set update_freq to a multiple of {world} (or, with max_tokens and no batch size, "
                    "a divisor of it: the workers then split max_tokens), or distributed.batch=per_worker (each "
                    "worker's update_freq, fairseq's meaning)")


def _world_size(asked, workers: Workers, cpu: bool, gpus: int) -> int:
    if asked != "auto" and (not isinstance(asked, int) or asked < 1):
        raise UserError(f"distributed.world_size={asked} is not a number of workers; give auto (every visible "
                        "GPU, or the launcher's workers) or a whole number >= 1")
    if workers.launcher:
        if asked != "auto" and asked != workers.world_size:
            raise UserError(f"distributed.world_size={asked}, but {workers.launcher} started {workers.world_size} "
                            f"workers; drop the setting (the launcher decides) or start {asked} workers")
        # a task that sees one GPU uses it (a site that binds a GPU to each task: --gpus-per-task, --gpu-bind)
        if not cpu and gpus != 1 and workers.local_rank >= gpus:
            raise UserError(f"{workers.launcher} started worker {workers.local_rank} of this node, which has "
                            f"{gpus} GPU(s): start one worker per GPU (torchrun --nproc-per-node={gpus}, or "
                            f"hydra.launcher.tasks_per_node={gpus})")
        return workers.world_size
    world = max(gpus, 1) if asked == "auto" else asked
    if not cpu and world > gpus:
        raise UserError(f"distributed.world_size={world} asks for more workers than this node's {gpus} GPU(s); "
                        f"use distributed.world_size={gpus} (or auto), or train across nodes: hprune train -m "
                        "hydra/launcher=slurm hydra.launcher.nodes=N hydra.launcher.gpus_per_node=G, or torchrun "
                        "on every node (docs/scaling.md)")
    return world


# the kernel hands out ephemeral ports from 32768 (Linux's default ip_local_port_range): below it, a derived port
# does not collide with a connection's own
PORTS = (20000, 32767)


def _slurm_port(port, gpus: int) -> int:
    """The rendezvous port of a SLURM step, alike on every task: distributed.port, or derived from the job and
    step ids (two steps of one job get two ports). A node's tasks must match its GPUs: one task per node on a
    node of several GPUs would leave all but one idle."""
    tasks_per_node = int(os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_NTASKS_PER_NODE", "0"))
                         .split("(")[0] or 0) or launched().world_size // int(os.environ.get("SLURM_NNODES", "1"))
    if tasks_per_node == 1 and gpus > 1:
        raise UserError(f"this SLURM job runs one task per node on {gpus} GPUs; run one task per GPU "
                        "(hydra.launcher.tasks_per_node = gpus_per_node)")
    if port != "auto":
        return int(port)
    job = f"{os.environ.get('SLURM_JOB_ID', '0')}.{os.environ.get('SLURM_STEP_ID', '0')}"
    return random.Random(job).randint(*PORTS)


def init_timeout(cfg: Optional[DictConfig]) -> float:
    """distributed.timeout, in seconds: how long a collective waits for a peer before the job ends."""
    timeout = OmegaConf.merge(DEFAULTS, cfg or {}).timeout
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise UserError(f"distributed.timeout={timeout} is not a number of seconds; e.g. distributed.timeout=1800")
    return float(timeout)


@contextlib.contextmanager
def process_group_timeout(seconds: float) -> Iterator[None]:
    """fairseq opens the process group without a timeout (torch's defaults: NCCL 10 minutes, gloo 30): give it
    this one, and turn NCCL's asynchronous error handling on, so that a dead or hung peer ends every worker in
    bounded time (the watchdog aborts the process) instead of leaving them waiting."""
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    opened = dist.init_process_group

    def with_timeout(*args, **kwargs):
        kwargs.setdefault("timeout", datetime.timedelta(seconds=seconds))
        return opened(*args, **kwargs)
    dist.init_process_group = with_timeout
    try:
        yield
    finally:
        dist.init_process_group = opened


def device_id(workers: Workers, cpu: bool) -> int:
    """The CUDA device a launched worker uses: its local rank, or the one GPU a task sees where the site binds a
    GPU to each task (SLURM's --gpus-per-task or --gpu-bind, CUDA_VISIBLE_DEVICES per task)."""
    return 0 if cpu or torch.cuda.device_count() == 1 else workers.local_rank


def rank_flags(cpu: bool) -> List[str]:
    """A torchrun worker's place as fairseq flags (fairseq's own reading of torchrun divides by the GPU count,
    which is 0 on a CPU)."""
    workers = launched()
    if workers.launcher != "torchrun":
        return []
    return ["--distributed-init-method", "env://", "--distributed-rank", str(workers.rank),
            "--device-id", str(device_id(workers, cpu))]


def _root_cause(err, workers: int) -> str:
    """The failure that ended a local launch: a worker killed by a signal (the others then fail on the lost
    connection, or are stopped by the agent's SIGTERM), else the first to fail, with the reason it recorded."""
    def order(item):
        failure = item[1]
        return (failure.exitcode == -signal.SIGTERM, failure.exitcode >= 0, failure.timestamp)

    rank, failure = min(err.failures.items(), key=order)
    if failure.exitcode < 0:
        return f"worker {rank} of {workers} was killed by {failure.signal_name()}"
    reason = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
    return f"worker {rank} of {workers} failed ({reason or f'exit code {failure.exitcode}'})"


def join_slurm_step(cfg: DictConfig, cpu: bool) -> None:
    """This task's place in a multi-task SLURM step, into the config's distributed_training: the rendezvous on
    the first host of `scontrol show hostnames` (at distributed_port), rank SLURM_PROCID of the step's tasks,
    device SLURM_LOCALID (0 on a CPU, or where the task sees one GPU). Read here, as fairseq's own reading does,
    but for any number of tasks a node (fairseq's would spawn a process per GPU on a node of one task) and
    without selecting a CUDA device on a CPU."""
    import subprocess

    workers = launched()
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    try:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", nodes or ""], text=True).split()
    except FileNotFoundError:
        raise UserError("this is a task of a multi-task SLURM job, but `scontrol` is not on PATH to name its nodes; "
                        "run hprune where SLURM's commands are, or start the workers with torchrun instead") from None
    if not hosts:
        raise UserError(f"`scontrol show hostnames {nodes}` named no host for this SLURM step's rendezvous")
    cfg.distributed_init_method = f"tcp://{hosts[0]}:{cfg.distributed_port}"
    cfg.distributed_rank, cfg.distributed_world_size = workers.rank, workers.world_size
    cfg.device_id, cfg.distributed_no_spawn = device_id(workers, cpu), True


def start_workers(argv: List[str], workers: int, label: str, timeout: float) -> dict:
    """Train with `workers` processes on this node under torch's elastic launcher (what `torchrun --standalone
    --nproc-per-node` runs), each `python -m hprune.worker`; waits for them. Rank 0 logs to this run's
    log file and draws the progress bar. Returns its training speed. A worker that dies ends them all: one line,
    and the same command resumes from the last checkpoint."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = os.environ.get("OMP_NUM_THREADS") or str(worker_threads(workers))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    log.info("%s: %d workers on this node (torch's elastic launcher)", label, workers)
    with tempfile.TemporaryDirectory(prefix="hprune-workers-") as tmp:
        speed = Path(tmp) / "speed.json"
        worker_args = ["-m", "hprune.worker", "--label", label, "--threads", threads, "--timeout", str(timeout),
                       "--speed-file", str(speed),
                       *(["--log-file", log_file()] if log_file() else []), *(["--verbose"] if is_verbose() else []),
                       "--", *argv]
        try:
            with to_log_file_only("torch.distributed.elastic"):
                elastic_launch(config, sys.executable)(*worker_args)
        except ChildFailedError as err:
            raise JobFailed(f"{_root_cause(err, workers)}, which ended the training; the checkpoints are kept: run "
                            "the same command again (same hydra.run.dir) to resume from the last one") from None
        return json.loads(speed.read_text()) if speed.exists() else {}
