"""The reproduction scripts chain hprune commands that Hydra accepts (checked on their printed plan:
`HPRUNE="echo hprune"`), and each step reads the previous step's output dir. Their SLURM plans, the same steps
with the launcher's overrides, are composed and rendered to sbatch files in test_cluster."""
from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from hprune_cli.checks import check_overrides
from hprune_cli.main import overrides

from conftest import ROOT

SCRIPTS = sorted(s for s in (ROOT / "scripts").glob("reproduce_*.sh") if s.stem != "reproduce_common")


def plan(script) -> list[list[str]]:
    env = {**os.environ, "HPRUNE": "echo hprune", "LAUNCHER": "local"}
    out = subprocess.run(["bash", str(script), "/tmp/out"], env=env, capture_output=True, text=True, check=True)
    return [shlex.split(line)[1:] for line in out.stdout.splitlines()]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_every_step_composes(script):
    steps = plan(script)
    # a model is trained, or a published one fetched: every later ckpt reads one of them
    assert steps[0][:2] == ["data", "prepare"] and steps[1][0] == "train" or steps[0][:2] == ["data", "fetch"]
    outputs = {"${paths.models_root}"} if steps[0][:2] == ["data", "fetch"] else set()
    outputs |= {a.split("=", 1)[1] for a in steps[0] if a.startswith("hf=")}  # a Hub id, fetched into the cache
    for args in steps:
        verb, rest = args[0], args[1:]
        problem = check_overrides(verb, overrides(verb, rest))
        assert problem is None, (args, problem)
        ckpts = [a.split("=", 1)[1] for a in rest if a.startswith("ckpt=")]
        for ckpt in ckpts:  # reads a run written by an earlier step
            assert all(any(c == o or c.startswith(o + "/") for o in outputs) for c in ckpt.split(","))
        outputs |= {a.split("=", 1)[1] for a in rest if a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))}
        assert ("-m" in rest) == ("hydra.sweep.dir" in " ".join(rest))


def test_the_scripts_find_hprune_without_an_activated_venv(tmp_path):
    """`bash scripts/study_methods.sh` right after `make demo`, in a shell where the venv is not activated: the
    scripts run the hprune `make install` made (they stopped on 'hprune: command not found')."""
    common = ROOT / "scripts" / "reproduce_common.sh"
    if not (ROOT / ".venv" / "bin" / "hprune").exists():
        pytest.skip("no venv made by `make install` here")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", "-c", f"source {common} && echo $HPRUNE"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == str(ROOT / ".venv" / "bin" / "hprune"), out.stderr
    env["HPRUNE"] = "echo hprune"  # as given
    out = subprocess.run(["bash", "-c", f"source {common} && echo $HPRUNE"], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "echo hprune"
