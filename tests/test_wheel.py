"""A plain wheel install works: it holds every package and config of the source tree, and its CLI trains and
evaluates a model (the first model import is where a package left out of the wheel shows)."""
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from conftest import ROOT, SMALL_DATA


def run(*cmd, cwd=None, env=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def source_files() -> set:
    """What the wheel must hold: every module under src/ and cli/, every config under configs/, by installed name."""
    installed = {"src": "", "cli": "hprune_cli/", "configs": "hprune_configs/"}
    files = set()
    for folder, prefix in installed.items():
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                files.add(prefix + path.relative_to(ROOT / folder).as_posix())
    return files


def test_wheel_holds_every_package_and_trains_and_evaluates(tmp_path, data_root):
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
        str(ROOT))
    wheel = next((tmp_path / "dist").glob("hprune-*.whl"))
    missing = source_files() - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"the wheel leaves out {sorted(missing)}"

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))  # this venv's pip installs into it (--python)
    py = venv / "bin" / "python"
    # the dependencies come from the project venv's site-packages, appended *after* the new venv's own, and
    # without running its .pth files (so the editable install of hprune there is not seen)
    site = run(str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = run(str(py), "-c", "import hprune, hprune_configs, hprune_fairseq.heads; "
                "print(hprune.__file__, hprune_configs.__file__, hprune_fairseq.heads.__file__)", cwd=tmp_path, env=env).stdout
    assert where.count(str(venv)) == 3 and str(ROOT) not in where
    hprune = str(venv / "bin" / "hprune")
    assert "train" in run(hprune, "--help", cwd=tmp_path, env=env).stdout
    # a real verb from the wheel: a few updates on the shared small synthetic set, then eval of the model
    run(hprune, "train", "hydra.run.dir=run", *SMALL_DATA, "optim.max_update=4", "optim.warmup_updates=2",
        "optim.max_tokens=2048", "device=cpu", cwd=tmp_path, env=env)
    run(hprune, "eval", "ckpt=run", "hydra.run.dir=eval", *SMALL_DATA, "device=cpu", cwd=tmp_path, env=env)
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["sentences"] == 100 and 0 <= metrics["bleu"] <= 100
