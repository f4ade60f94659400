"""A plain wheel install works: the CLI answers and the configs ship inside the wheel."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import ROOT


def run(*cmd, cwd=None, env=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def test_wheel_install_runs_the_cli_and_composes(tmp_path):
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
        str(ROOT))
    wheel = next((tmp_path / "dist").glob("hprune-*.whl"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    py = venv / "bin" / "python"
    # the dependencies come from the project venv's site-packages, appended *after* the new venv's own, and
    # without running its .pth files (so the editable install of hprune there is not seen)
    site = run(str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = run(str(py), "-c", "import hprune, hprune_configs; print(hprune.__file__, hprune_configs.__file__)",
                cwd=tmp_path, env=env).stdout
    assert str(venv) in where and str(ROOT) not in where
    proc = run(str(venv / "bin" / "hprune"), "--help", cwd=tmp_path, env=env)
    assert "train" in proc.stdout
    proc = run(str(venv / "bin" / "hprune"), "train", "--cfg", "job", "model=transformer_big", cwd=tmp_path, env=env)
    assert "encoder_attention_heads: 16" in proc.stdout
