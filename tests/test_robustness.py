"""Stopped work leaves nothing half-made (issue 50): Ctrl-C and SIGTERM end any verb in one line with the shell's
status (130, 143: the process ends by the signal once it has cleaned up) and remove the staging folder being
built; a build that SIGKILL ended is removed by the next build on the same host (files.build_once), not by
another host's (a data_root shared by a cluster)."""
from __future__ import annotations

import os
import signal
import subprocess as sp
import sys
import time
from pathlib import Path

import pytest

from conftest import HPRUNE, ROOT


def _default_signals() -> None:
    """As in a terminal's foreground job (a run started in the background of a script ignores Ctrl-C)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_data_prepare_is_one_line_and_leaves_nothing(signum, tmp_path):
    """Ctrl-C reaches the whole foreground process group (as a terminal sends it); SIGTERM the process alone (as
    `kill` or a scheduler sends it). Either while the data set is being built in its staging folder."""
    root = tmp_path / "data-bin"
    proc = sp.Popen([*HPRUNE, "data", "prepare", "data.params.n_train=300000", f"paths.data_root={root}",
                     f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, stdout=sp.PIPE, stderr=sp.PIPE, text=True,
                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 120  # until the corpus is being generated (torch is imported by then: a
        while not list(root.glob("toy-*.tmp-*/raw")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)                # Ctrl-C inside torch's C++ import code aborts any Python program)
        assert list(root.glob("toy-*.tmp-*/raw")), "the build never started"
        time.sleep(0.5)
        assert proc.poll() is None, "the build ended before it could be stopped"
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # ended by the signal itself once its line is said (a shell reports 128 + N: 130, 143; a script stops too)
    assert proc.returncode == -signum, (proc.returncode, err[-3000:])
    assert "Traceback" not in out + err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("hprune data:")]
    assert len(said) == 1 and ("Ctrl-C" if signum == signal.SIGINT else "SIGTERM") in said[0], err[-2000:]
    assert sorted(p.name for p in root.iterdir()) == [".locks"]  # no staging, no data set


def _dead_pid() -> int:
    child = sp.Popen(["true"])
    child.wait()
    return child.pid


def test_staging_left_by_a_killed_build_is_removed_by_the_next_build_on_its_host(tmp_path):
    from hprune import files

    host, dead = files._host(), _dead_pid()
    alive = sp.Popen(["sleep", "60"])
    try:
        final = tmp_path / "toy-0123456789ab"
        stale = [final.with_name(f"{final.name}.tmp-{host}-{dead}"), final.with_name(f"{final.name}.tmp-{dead}")]
        kept = [final.with_name(f"{final.name}.tmp-{host}-{alive.pid}"),  # a live builder (pid of this host)
                final.with_name(f"{final.name}.tmp-other-node-{dead}")]   # another host's: it cannot be told dead
        for folder in stale + kept:
            (folder / "bin").mkdir(parents=True)
            (folder / "bin" / "train.bin").write_bytes(b"\0" * 1000)

        def build(staging: Path) -> None:
            assert staging.name == f"{final.name}.tmp-{host}-{os.getpid()}"
            (staging / "READY").write_text("ok\n")

        files.build_once(final, "READY", build)
        assert (final / "READY").is_file()
        assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
        # beside a folder another process finished (the killed one's build never got it): removed too
        leftover = final.with_name(f"{final.name}.tmp-{host}-{dead}")
        leftover.mkdir()
        files.build_once(final, "READY", build)
        assert not leftover.exists() and all(p.exists() for p in kept)
    finally:
        alive.kill()
        alive.wait()


def test_a_pool_of_data_workers_ends_however_soon_after_it_starts(tmp_path):
    """While a verb runs, SIGTERM has a Python handler (the CLI's one line); a pool worker inherited it, and a
    pool that ended a worker before the worker's interpreter had finished forking lost that SIGTERM (Python
    clears the signals caught around a fork), so the pool waited for it forever: a CI run hung 90 minutes in
    `hprune data prepare`, and the old code hung here after 37 to 296 pools. Each file of a stage is one pool."""
    (tmp_path / "one.txt").write_text("A Line\n")
    script = ("import sys; from pathlib import Path\n"
              "from hprune.errors import signals_raise\n"
              "from hprune.data.processing import map_file\n"
              "with signals_raise():\n"
              "    for _ in range(400):\n"
              "        map_file('lowercase', 'en', Path('one.txt'), Path('out.txt'), workers=2)\n")
    proc = sp.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out.txt").read_text() == "a line\n"


def test_a_stop_in_a_training_launch_is_a_stop_not_an_error():
    """torch's elastic launcher turns SIGINT / SIGTERM into its SignalException (an Exception, which Hydra would
    print as a traceback): the runner's wrapper makes it the stop the CLI says in one line."""
    from hprune.errors import Interrupted, as_interrupted

    class SignalException(Exception):  # torch.distributed.elastic.multiprocessing.api's, as it is shaped
        def __init__(self, msg: str, sigval: signal.Signals):
            super().__init__(msg)
            self.sigval = sigval

    stop = as_interrupted(SignalException("Process 1 got signal: 15", signal.SIGTERM))
    assert isinstance(stop, Interrupted) and stop.exit_status == 143 and "SIGTERM" in stop.describe()
    assert as_interrupted(KeyboardInterrupt()).exit_status == 130
    assert as_interrupted(RuntimeError("a bug")) is None


def test_ctrl_c_before_the_verb_starts_is_one_line_too(monkeypatch):
    """While the command line is checked and the verb's modules imported (torch, fairseq: seconds), a Ctrl-C is
    the same one line."""
    import hprune_cli.main

    from conftest import hprune

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(hprune_cli.main, "overrides", interrupted)
    proc = hprune("report", "outputs", check=False)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("hprune report: interrupted (Ctrl-C)")


@pytest.mark.slow  # about 30 s: two training workers started, then stopped
def test_ctrl_c_in_a_training_with_two_workers_is_one_line(tmp_path, data_root):
    """Ctrl-C reaches the launching process and both workers (one process group, as a terminal sends it): the
    launching process says it in one line; the workers end without a traceback of their own."""
    from conftest import SMALL_TRAIN
    run = tmp_path / "run"
    proc = sp.Popen([*HPRUNE, "train", f"hydra.run.dir={run}", *SMALL_TRAIN, "optim.max_update=100000",
                     "optim.update_freq=1", "distributed.world_size=2"], cwd=ROOT, stdout=sp.PIPE, stderr=sp.PIPE,
                    text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 180  # until both workers train (their first updates are logged)
        while proc.poll() is None and time.monotonic() < deadline and not (
                (run / "train.log").exists() and "epoch 001" in (run / "train.log").read_text()):
            time.sleep(0.5)
        assert proc.poll() is None, "the training ended before it could be stopped"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGINT and "Traceback" not in out + err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("hprune train:")]
    assert len(said) == 1 and "Ctrl-C" in said[0], err[-2000:]


def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """ENOSPC, or torch's zip writer's RuntimeError (which hides the errno) with the disk all but full: one line
    naming the file and the fix, no half-written file; a RuntimeError with room left is not taken for it."""
    import errno
    import shutil
    from collections import namedtuple

    import torch

    from hprune import files
    from hprune.backend.training import save_checkpoint_atomic
    from hprune.errors import UserError

    def full(tmp):
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(UserError, match=r"^the disk is full while writing metrics.json in .*; free space"):
        with files.replaced_atomically(tmp_path / "metrics.json") as tmp:
            full(tmp)
    assert list(tmp_path.iterdir()) == []

    def torch_save(state, path):  # as torch.save fails on a full disk: part of the zip written, then its check
        Path(path).write_bytes(b"PK half a checkpoint")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 906161344 vs 906161232")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(torch, "save", torch_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(100 << 30, (100 << 30) - 4096, 4096))
    with pytest.raises(UserError, match="the disk is full while writing checkpoint_pruned.pt"):
        save_checkpoint_atomic({"model": {}}, tmp_path / "checkpoints" / "checkpoint_pruned.pt")
    assert list((tmp_path / "checkpoints").iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(100 << 30, 0, 100 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # room left: another failure, reported as it is
        save_checkpoint_atomic({"model": {}}, tmp_path / "checkpoints" / "checkpoint_pruned.pt")
