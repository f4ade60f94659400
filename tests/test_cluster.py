"""What a cluster runs, checked the way it runs it, without a cluster: the sbatch file of every SLURM step of
every reproduction script and documented command, rendered by submitit under hprune's launcher and checked
against what sbatch accepts; the environments of SLURM steps, sbatch scripts and GPU-binding sites; the
rendezvous port; the threads a worker may use."""
from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from conftest import HPRUNE, ROOT, hprune

SCRIPTS = sorted(s for s in (ROOT / "scripts").glob("reproduce_*.sh") if s.stem != "reproduce_common")
SLURM_ARGS = "hydra.launcher.partition=gpu hydra.launcher.timeout_min=2880"


def script_steps(script) -> list[list[str]]:
    env = {**os.environ, "HPRUNE": "echo hprune", "LAUNCHER": "slurm", "SLURM_ARGS": SLURM_ARGS}
    out = subprocess.run(["bash", str(script), "/tmp/out"], env=env, capture_output=True, text=True, check=True)
    return [shlex.split(line)[1:] for line in out.stdout.splitlines()]


def documented_commands() -> list[list[str]]:
    """The SLURM commands README.md, docs/ and the launcher preset show (N nodes, G GPUs: 2 and 8)."""
    commands = []
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "configs/hydra/launcher/slurm.yaml"]:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # continued lines joined
        for line in re.findall(r"hprune [a-z]+ [^`\n|]*hydra/launcher=slurm[^`\n|]*", text):
            line = line.replace("=N ", "=2 ").replace("=G", "=8").replace("...", "")
            commands.append(shlex.split(line)[1:])
    assert len(commands) >= 4
    return commands


def sbatch(verb_and_args: list[str]) -> dict:
    """The #SBATCH options of the first job of a `hprune VERB ... -m hydra/launcher=slurm` command."""
    from hprune_cli.main import overrides
    from hydra import compose, initialize_config_module
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.utils import instantiate

    import hprune.launch  # noqa: F401  (its resolvers)
    verb, rest = verb_and_args[0], verb_and_args[1:]
    args = [a for a in overrides(verb, rest) if not a.startswith("-")]
    first_job = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)[0][0]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        cfg = compose(config_name=verb, overrides=list(first_job), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    text = instantiate(cfg.hydra.launcher).sbatch_text()
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(.*)$", text, flags=re.M))


def assert_sbatch_accepts(verb: str, options: dict) -> None:
    """Options as sbatch parses them (SLURM's slurm_opt.c: positive counts), and as hprune's workers need them:
    a training runs one task per GPU, every other verb one task."""
    tasks = int(options["ntasks-per-node"])
    assert tasks >= 1 and int(options["nodes"]) >= 1 and int(options["cpus-per-task"]) >= 1
    assert re.fullmatch(r"[1-9]\d*GB", options["mem"]) and int(options["time"]) >= 1
    gpus = int(options.get("gpus-per-node", 0))
    assert "gpus-per-node" not in options or gpus >= 1
    assert tasks == (max(gpus, 1) if verb == "train" else 1), (verb, options)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_every_slurm_step_of_the_reproduction_scripts_renders_an_sbatch_file_sbatch_accepts(script):
    steps = script_steps(script)
    for step in steps:
        assert "-m" in step and "hydra/launcher=slurm" in step and "hydra.launcher.partition=gpu" in step, step
        options = sbatch(step)
        assert_sbatch_accepts(step[0], options)
        if step[0] == "data":  # a CPU step: no GPU asked
            assert "gpus-per-node" not in options
    assert any(step[0] == "data" for step in steps)


def test_every_documented_slurm_command_renders_an_sbatch_file_sbatch_accepts():
    seen = set()
    for command in documented_commands():
        options = sbatch(command)
        assert_sbatch_accepts(command[0], options)
        seen.add((command[0], options["ntasks-per-node"], options.get("gpus-per-node")))
    assert ("train", "8", "8") in seen  # one training over 2 nodes x 8 GPUs: a task per GPU


def stand_in_slurm(tmp_path, **scripts: str):
    """A folder for PATH with stand-ins for SLURM's commands (`sbatch`, `srun`, `scontrol`)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_verbs_get_the_tasks_they_can_use_and_what_sbatch_refuses_is_one_line(tmp_path):
    for verb, extra, tasks in (("train", ["hydra.launcher.gpus_per_node=4"], "4"),
                               ("prune", ["--method", "voita", "ckpt=x", "hydra.launcher.gpus_per_node=4"], "1"),
                               ("eval", ["ckpt=x", "hydra.launcher.gpus_per_node=4"], "1"),
                               ("report", ["outputs", "hydra.launcher.gpus_per_node=0"], "1")):
        options = sbatch([verb, "-m", "hydra/launcher=slurm", *extra])
        assert options["ntasks-per-node"] == tasks
        assert options.get("gpus-per-node") == ("4" if extra[-1].endswith("=4") else None)
    for bad, expected in (("hydra.launcher.tasks_per_node=0", "tasks_per_node=0 must be a whole number >= 1"),
                          ("hydra.launcher.tasks_per_node=8", "8 tasks on 4 GPU(s) a node")):
        proc = subprocess.run([*HPRUNE, "train", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", bad,
                               f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, cwd=ROOT,
                              env=stand_in_slurm(tmp_path, sbatch="exit 1", srun="exit 1"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert expected in proc.stderr


def test_a_failed_task_ends_with_an_error_submitit_sees_not_status_0():
    """In a job, Hydra's run_job keeps a task's exception inside its return value (the task would exit 0, and
    SLURM's --kill-on-bad-exit would not stop the step's other tasks), and a UserError's sys.exit escapes
    submitit's wrapper (no result for the login node): hprune's launcher raises both."""
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.hprune_launchers import JobError, _Waiting

    class Returns:
        def __init__(self, outcome):
            self.outcome = outcome

        def __call__(self, *args, **kwargs):
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

    class Launcher(_Waiting, Returns):
        def __init__(self, outcome):
            Returns.__init__(self, outcome)
    failed = JobReturn(status=JobStatus.FAILED, _return_value=ValueError("a task's own error"))
    with pytest.raises(ValueError, match="a task's own error"):
        Launcher(failed)()
    with pytest.raises(JobError, match="ended with status 2"):
        Launcher(SystemExit(2))()
    done = JobReturn(status=JobStatus.COMPLETED, _return_value={"bleu": 1.0})
    assert Launcher(done)() is done


def test_the_launchers_config_prints_resolved():
    """`--cfg hydra --resolve`: Hydra resolves its node cut off from the keys it names (paths.output_root, verb);
    hprune resolves it within the whole config (it was an InterpolationKeyError traceback)."""
    proc = hprune("train", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", "paths.output_root=runs",
                  "--cfg", "hydra", "--resolve")
    assert proc.stdout.startswith("hydra:\n") and "${" not in proc.stdout, proc.stdout[:2000]
    for line in ("    tasks_per_node: 4", "    dir: runs/train/multirun/", "    name: train"):
        assert line in proc.stdout
    launcher = hprune("prune", "--method", "voita", "ckpt=x", "hydra/launcher=slurm", "--cfg", "hydra", "--resolve",
                      "--package", "hydra.launcher").stdout
    assert launcher.startswith("# @package hydra.launcher\n") and "tasks_per_node: 1\n" in launcher
