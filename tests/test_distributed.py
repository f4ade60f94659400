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


def free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_torchrun_agents_as_two_nodes_train_as_one_worker_with_update_freq_2(one_worker, tmp_path):
    """Two torchrun agents on this machine, one worker each, meeting through c10d's rendezvous as two nodes
    would: one run dir, one metrics.json, rank 0 alone speaking, the weights of one worker with update_freq 2."""
    out, port = tmp_path / "out", free_port()
    agents = [sp.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                        "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=two-nodes",
                        "-m", "hprune_cli.main", "train", f"paths.output_root={out}", *TRAIN, "optim.update_freq=1"],
                       cwd=ROOT, env=ONE_THREAD, stdout=sp.PIPE, stderr=sp.PIPE, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    run = the_one_run_dir(out)
    assert run.name == "torchrun-two-nodes"  # named after the job: the nodes' clocks differ
    assert sum(stdout.count("trained 20 updates") for stdout, _ in outputs) == 1  # rank 1 says nothing
    difference = largest_difference(run, one_worker)
    print(f"two torchrun agents: largest weight difference {difference:.1e}")
    assert difference <= 1e-5


def test_a_slurm_step_over_two_nodes_trains_as_one_worker(one_worker, tmp_path):
    """SLURM's variables as srun sets them for a step of two nodes with one task each (two processes here,
    SLURM_NODEID 0 and 1), and a stand-in `scontrol` naming the nodes' hosts: the first hosts the rendezvous.
    distributed.batch=total keeps update_freq=2 as the update's total."""
    from test_cluster import stand_in_slurm
    out = tmp_path / "out"
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]",
            "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0"}
    env = {**ONE_THREAD, "PATH": stand_in_slurm(tmp_path, scontrol="echo localhost; echo localhost")["PATH"]}
    tasks = [sp.Popen([*HPRUNE, "train", f"paths.output_root={out}", *TRAIN, "optim.update_freq=2",
                       "distributed.batch=total"], cwd=ROOT, stdout=sp.PIPE, stderr=sp.PIPE, text=True,
                      env={**env, **step, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank)}) for rank in (0, 1)]
    outputs = [task.communicate(timeout=300) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    run = the_one_run_dir(out)
    assert run.name == "slurm-4242.0"
    assert outputs[1] == ("", "")  # rank 1: nothing on the terminal
    assert json.loads((run / "metrics.json").read_text())["update_freq"] == 1
    difference = largest_difference(run, one_worker)
    print(f"a SLURM step over two nodes: largest weight difference {difference:.1e}")
    assert difference <= 1e-5


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
                                 "worker 1 of 2 was killed by SIGKILL", "run the same command again",
                                 status=3)  # a job that failed, not bad input
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
STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0"}  # an srun step: two nodes, one task each


def _plan(monkeypatch, gpus: int, env: dict | None = None, update_freq=1, max_tokens=4096, **distributed):
    from argparse import Namespace

    from hprune.backend.distributed import plan

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    frequencies = update_freq if isinstance(update_freq, list) else [update_freq]
    args = Namespace(cpu=gpus == 0, update_freq=frequencies, max_tokens=max_tokens, batch_size=None)
    return plan(OmegaConf.create(distributed), args)


def test_every_visible_gpu_by_default_and_the_batch_each_mode_makes(monkeypatch):
    eight = _plan(monkeypatch, gpus=8, update_freq=16)
    assert (eight.world_size, eight.starts_workers, eight.update_freq) == (8, True, [16])
    assert eight.max_tokens_per_update == 4096 * 16 * 8
    assert eight.flags[eight.flags.index("--distributed-backend") + 1] == "nccl"
    total = _plan(monkeypatch, gpus=8, update_freq=16, batch="total")
    assert (total.update_freq, total.max_tokens_per_update) == ([2], 4096 * 16)
    cpu = _plan(monkeypatch, gpus=0)
    assert (cpu.world_size, cpu.starts_workers, cpu.flags) == (1, False, ["--distributed-world-size", "1",
                                                                          "--update-freq", "1"])
    limited = _plan(monkeypatch, gpus=8, world_size=2)
    assert limited.world_size == 2
    # fairseq's per-epoch update_freq list is kept (per_worker) or spread entry by entry (total), not cut
    epochs = _plan(monkeypatch, gpus=2, update_freq=[8, 4])
    assert epochs.flags[epochs.flags.index("--update-freq") + 1] == "8,4"
    spread = _plan(monkeypatch, gpus=2, update_freq=[8, 4], batch="total")
    assert spread.flags[spread.flags.index("--update-freq") + 1] == "4,2"
    # more workers than update_freq: they split max_tokens, and an update holds what it holds on one worker
    split = _plan(monkeypatch, gpus=8, update_freq=4, max_tokens=4000, batch="total")
    assert (split.update_freq, split.max_tokens, split.max_tokens_per_update) == ([1], 2000, 16000)
    assert split.flags[split.flags.index("--max-tokens") + 1] == "2000"


@pytest.mark.parametrize("preset", ["voita2019", "moa2022"])
def test_paper_presets_keep_their_tokens_per_update_on_any_number_of_gpus(preset, monkeypatch):
    """A preset that reproduces a paper fixes the tokens per update (distributed.batch: total): composed, and
    planned on 1, 2 and 8 GPUs, the cap on an update's tokens is the same (Voita: 4,000 x 4 GPUs; MoA: run.sh's
    8,192 x update-freq 32)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={preset}"])
    assert cfg.distributed.batch == "total"
    caps = {gpus: _plan(monkeypatch, gpus=gpus, update_freq=cfg.optim.update_freq, max_tokens=cfg.optim.max_tokens,
                        **cfg.distributed).max_tokens_per_update for gpus in (1, 2, 8)}
    assert set(caps.values()) == {cfg.optim.max_tokens * cfg.optim.update_freq}, caps


def test_requests_the_machine_cannot_serve_are_one_clear_error(monkeypatch):
    from hprune.errors import UserError

    with pytest.raises(UserError, match=r"distributed.world_size=4 asks for more workers than this node's 2 GPU.*"
                                        r"hydra/launcher=slurm hydra.launcher.nodes=N"):
        _plan(monkeypatch, gpus=2, world_size=4)
    with pytest.raises(UserError, match="update_freq=3 over 2 workers"):
        _plan(monkeypatch, gpus=2, update_freq=3, batch="total")
    with pytest.raises(UserError, match="update_freq=8,3 over 2 workers"):
        _plan(monkeypatch, gpus=2, update_freq=[8, 3], batch="total")
    with pytest.raises(UserError, match="distributed.world_size=4, but torchrun started 2 workers"):
        _plan(monkeypatch, gpus=2, world_size=4, env={"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "RANK": "0",
                                                      "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(UserError, match="worker 2 of this node, which has 2 GPU"):
        _plan(monkeypatch, gpus=2, env={"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "RANK": "2",
                                        "WORLD_SIZE": "4", "LOCAL_RANK": "2"})
    with pytest.raises(UserError, match="one task per node on 8 GPUs.*one task per GPU"):
        _plan(monkeypatch, gpus=8, env=STEP)
    with pytest.raises(UserError, match="distributed.timeout=0 is not a number of seconds"):
        from hprune.backend.distributed import init_timeout
        init_timeout(OmegaConf.create({"timeout": 0}))


def test_the_rendezvous_port_is_alike_on_every_task_distinct_per_step_and_below_the_ephemeral_ports(monkeypatch):
    from hprune.backend.distributed import PORTS

    def port(**env):
        plan_ = _plan(monkeypatch, gpus=1, env={**STEP, **env})
        return int(plan_.flags[plan_.flags.index("--distributed-port") + 1])
    first = port()
    assert first == port(SLURM_PROCID="1")  # every task of the step
    assert first != port(SLURM_STEP_ID="1")  # a second step of the job (srun twice in one allocation)
    assert all(PORTS[0] <= port(SLURM_JOB_ID=str(job)) < 32768 for job in range(1000, 1050))
    assert port(SLURM_JOB_ID="3") == port(SLURM_JOB_ID="3", SLURM_STEP_ID="0")


def test_a_task_that_sees_one_gpu_uses_it(monkeypatch, tmp_path):
    """Sites that bind one GPU to each task (--gpus-per-task=1, --gpu-bind): SLURM_LOCALID runs 0..7 while each
    task sees one GPU, device 0; torchrun workers likewise."""
    from hprune.backend.distributed import join_slurm_step, rank_flags
    from test_cluster import stand_in_slurm
    bound = {**STEP, "SLURM_NNODES": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS_PER_NODE": "8",
             "SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_STEP_NODELIST": "node1"}
    assert _plan(monkeypatch, gpus=1, env=bound).world_size == 8  # (with 2 GPUs seen, worker 3 has none: refused)
    monkeypatch.setenv("PATH", stand_in_slurm(tmp_path, scontrol="echo gpu-node-1")["PATH"])
    cfg = OmegaConf.create({"distributed_port": 23456, "device_id": 0, "distributed_rank": 0,
                            "distributed_world_size": 8, "distributed_init_method": None, "distributed_no_spawn": False})
    join_slurm_step(cfg, cpu=False)
    assert (cfg.distributed_init_method, cfg.distributed_rank, cfg.device_id) == ("tcp://gpu-node-1:23456", 3, 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # a task that sees the node's 8 GPUs: its own
    join_slurm_step(cfg, cpu=False)
    assert cfg.device_id == 3
    for key, value in {"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "RANK": "5", "WORLD_SIZE": "8",
                       "LOCAL_RANK": "5"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_flags(cpu=False)[-2:] == ["--device-id", "0"]


def test_threads_come_from_the_cpus_this_process_may_use():
    from hprune.launch import cpus_available, worker_threads
    mine = len(os.sched_getaffinity(0))
    assert cpus_available({}) == mine and cpus_available({"SLURM_CPUS_PER_TASK": "1"}) == 1
    assert worker_threads(2, {}) == max(1, mine // 2)
    assert worker_threads(None, {"LOCAL_WORLD_SIZE": str(mine * 4)}) == 1


def test_verbs_that_run_once_refuse_to_be_started_per_worker(monkeypatch, trained_run, tmp_path):
    for key, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "9"}.items():
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


def test_a_training_in_an_sbatch_script_without_srun_is_one_line(monkeypatch, tmp_path):
    """An sbatch script of 4 tasks has SLURM_NTASKS=4 and SLURM_PROCID=0 but no step of several tasks: the one
    process must not wait for 3 peers that never start. Other verbs run there as usual."""
    from hprune.launch import launched
    script = {"SLURM_JOB_ID": "11", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_NNODES": "1"}
    assert launched(script).world_size == 1 and launched({**script, "SLURM_STEP_NUM_TASKS": "4"}).world_size == 4
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in script.items():
        monkeypatch.setenv(key, value)
    proc = hprune("train", f"hydra.run.dir={tmp_path / 'run'}", *TRAIN, check=False)
    assert_one_line_error(proc, "this SLURM job has 4 tasks", "`srun hprune train ...`")
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------------------------ two gloo processes here
def _gloo(rank: int, world: int, init: str, job, result: str, timeout: float) -> None:
    import datetime
    import pickle
    import traceback

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, world_size=world, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        outcome = ("ok", job(rank))
    except Exception as err:  # noqa: BLE001 - reported to the test
        outcome = ("error", f"{type(err).__name__}: {err}", traceback.format_exc())
    Path(f"{result}.{rank}").write_bytes(pickle.dumps(outcome))


def on_two_workers(tmp_path, job, timeout: float = 30) -> list:
    """`job(rank)` on two processes of a gloo group; each one's ("ok", value) or ("error", message, traceback)."""
    import pickle

    import torch.multiprocessing as mp
    tmp_path.mkdir(parents=True, exist_ok=True)
    init, result = f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "result")
    mp.spawn(_gloo, args=(2, init, job, result, timeout), nprocs=2, join=True)
    return [pickle.loads(Path(f"{result}.{rank}").read_bytes()) for rank in range(2)]


class _Checks:
    """What the tests below need of two gloo workers, in one start (each start costs seconds): the gate noise
    each draws, the resume points they agree on (their own save dirs), and how long a hung peer leaves the
    other waiting (last: it leaves the group broken)."""

    def __init__(self, shared: str, local: str):
        self.shared, self.local = shared, local

    def __call__(self, rank: int) -> dict:
        import time as clock

        from hprune.backend.training import _updates, agree_on_resume_point
        from hprune_fairseq.mechanisms.gates import uniform_per_worker
        from hprune_fairseq.safe_load import load_checkpoint
        out = {}
        torch.manual_seed(5)  # fairseq seeds every worker alike
        out["noise"] = (uniform_per_worker(torch.zeros(6)), torch.rand(3))  # and what the stream gives next
        zero = _updates(load_checkpoint(Path(self.shared) / "checkpoint_last.pt"))
        for case, mine in (("differ", self.local if rank else self.shared), ("same", self.shared)):
            try:
                agree_on_resume_point(Path(mine), zero)
                out[case] = "ok"
            except Exception as err:  # noqa: BLE001 - reported to the test
                out[case] = f"{type(err).__name__}: {err}"
        if rank == 1:
            clock.sleep(7)  # alive, but never joins the collective
            return out
        started = clock.perf_counter()
        try:
            torch.distributed.barrier()
        except RuntimeError:
            out["waited"] = clock.perf_counter() - started
        return out


@pytest.fixture(scope="module")
def two_gloo_workers(one_worker, tmp_path_factory) -> list:
    """distributed.timeout 3 s for the group, as process_group_timeout gives fairseq's."""
    tmp = tmp_path_factory.mktemp("gloo")
    (tmp / "node-local").mkdir()
    outcomes = on_two_workers(tmp, _Checks(str(one_worker / "checkpoints"), str(tmp / "node-local")), timeout=3)
    assert [outcome[0] for outcome in outcomes] == ["ok", "ok"], outcomes
    return [value for _, value in outcomes]


def test_every_worker_draws_its_own_gate_noise_and_the_stream_stays_in_step(two_gloo_workers):
    """Voita's Hard Concrete and DSP's Gumbel draws: each of W workers its own (one worker with update_freq W
    draws W too), the rows a single draw of the W workers' noise would give, and the random stream advanced
    alike on every worker; one worker draws exactly what torch.rand draws."""
    from hprune_fairseq.mechanisms.gates import uniform_per_worker
    (mine, after_0), (theirs, after_1) = (outcome["noise"] for outcome in two_gloo_workers)
    assert not torch.equal(mine, theirs) and torch.equal(after_0, after_1)
    torch.manual_seed(5)
    both = torch.rand(2, 6)
    assert torch.equal(mine, both[0]) and torch.equal(theirs, both[1])
    torch.manual_seed(5)
    alone = uniform_per_worker(torch.zeros(6))
    torch.manual_seed(5)
    assert torch.equal(alone, torch.rand(6))


def test_workers_that_see_different_resume_points_stop_in_one_line_on_every_rank(two_gloo_workers):
    """Rank 1 reads another save dir (a node-local disk) without rank 0's checkpoint_last.pt: both stop, saying
    what each sees, before anything is trained; seeing the same one, they go on."""
    for outcome in two_gloo_workers:
        assert outcome["differ"].startswith("UserError: the workers see different resume points"), outcome["differ"]
        assert f"rank 0 checkpoint_last.pt at {UPDATES} updates, rank 1 no checkpoint_last.pt" in outcome["differ"]
        assert outcome["same"] == "ok"


def test_a_hung_peer_ends_the_wait_within_the_timeout(two_gloo_workers):
    """distributed.timeout reaches the process group fairseq opens (process_group_timeout): a peer that hangs
    leaves the others waiting that long (here 3 s), not torch's default 30 minutes. On CPUs (gloo); NCCL's
    watchdog on a GPU, which aborts the process, is untested here."""
    import datetime

    import torch.distributed as dist

    from hprune.backend.distributed import process_group_timeout
    opened = []

    def record(*args, **kwargs):
        opened.append(kwargs.get("timeout"))
        raise RuntimeError("recorded")
    dist_init = dist.init_process_group
    try:
        dist.init_process_group = record
        with process_group_timeout(4), pytest.raises(RuntimeError):
            dist.init_process_group(backend="gloo")  # as fairseq's distributed_init calls it: no timeout
    finally:
        dist.init_process_group = dist_init
    assert opened == [datetime.timedelta(seconds=4)] and dist.init_process_group is dist_init
    waited = two_gloo_workers[0].get("waited")
    assert waited is not None and 2 <= waited < 7, waited


def test_a_failing_worker_writes_its_traceback_and_its_one_line_names_it(monkeypatch, tmp_path, evaluated_run):
    """Worker 1 of 2 (torchrun's variables) fails with an error of its own: its traceback goes to
    worker-1.traceback beside the save dir, and its one line (exit status 3: a job failed) names that file."""
    from fairseq import distributed_utils

    from hprune.backend.training import run_worker
    from hprune.errors import JobFailed

    def fails(cfg, main, **kwargs):
        raise ValueError("a worker's own failure, not a lost peer")
    monkeypatch.setattr(distributed_utils, "call_main", fails)
    for key, value in {"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2",
                       "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    save = tmp_path / "run" / "checkpoints"
    argv = [evaluated_run[1]["data_bin"], "--arch", "transformer", "--save-dir", str(save), "--cpu",
            "--distributed-world-size", "2", "--task", "translation", "-s", "src", "-t", "tgt"]
    with pytest.raises(JobFailed, match=r"worker 1 of 2 stopped \(a worker's own failure.*its traceback: ") as failed:
        run_worker(argv, "train", 30)
    written = tmp_path / "run" / "worker-1.traceback"
    assert str(written) in str(failed.value) and failed.value.exit_status == 3
    assert "ValueError: a worker's own failure" in written.read_text()
