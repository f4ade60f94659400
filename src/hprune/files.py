"""File helpers: atomic writes, folders built once (staged, locked), the run dir, the code version."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import UserError


@contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """A temporary name beside `path` to write to, renamed onto `path` when the block ends (removed if it
    fails): readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        if disk_full(err, path.parent):
            raise UserError(f"the disk is full while writing {path.name} in {path.parent}; free space or write the "
                            "run to a larger disk (hydra.run.dir=...; nothing half-written was kept)") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def disk_full(err: BaseException, folder: Path) -> bool:
    """Whether a failed write failed for want of space: ENOSPC, or torch's zip writer's RuntimeError ("unexpected
    pos", "failed writing file"), which hides the errno, with the disk all but full when it is raised."""
    if isinstance(err, OSError):
        return err.errno == errno.ENOSPC
    try:
        return shutil.disk_usage(folder).free < FULL_BELOW
    except OSError:
        return False


FULL_BELOW = 64 << 20  # bytes free: a write that failed with less than this left failed for want of space


def write_atomic(path: str | Path, text: str) -> Path:
    with replaced_atomically(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def file_digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: str | Path, obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold `<folder>/.locks/<name>.lock` while the block runs: processes that fetch or build the same thing
    (sweep jobs on a cold cache) take turns, and the later ones find it done. (Lock files stay: removing one
    would race with a process about to take it.)"""
    from filelock import FileLock

    path = Path(path)
    (path.parent / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(path.parent / ".locks" / f"{path.name}.lock"):
        yield


STAGING = ".tmp-"  # <final>.tmp-<host>-<pid>: the folder a build fills before it is renamed <final>


def _host() -> str:
    import socket

    return "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname()) or "localhost"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process
        return True
    return True


def stale_staging(final: Path) -> list[Path]:
    """The staging folders of `final` left by processes of this host that are gone (killed by SIGKILL, a lost
    node's reboot, a power cut): nobody will finish them. Those of other hosts (a data_root shared by a cluster)
    are left alone: their processes may be alive, and this host cannot tell."""
    stale, host, prefix = [], _host(), f"{final.name}{STAGING}"
    try:
        entries = [path for path in final.parent.iterdir() if path.name.startswith(prefix)]
    except OSError:
        return []
    for path in entries:
        owner = path.name[len(prefix):]
        where, _, pid = owner.rpartition("-")
        if owner.isdigit():  # named by an older hprune, without the host
            where, pid = host, owner
        if where == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            stale.append(path)
    return stale


def _remove_stale(final: Path) -> None:
    for path in stale_staging(final):
        shutil.rmtree(path, ignore_errors=True)


def build_once(final: Path, done: str, build: Callable[[Path], Any]) -> Path:
    """The folder `final`, built by `build(staging)` unless `final/done` exists. The build fills a staging
    folder beside it (`<final>.tmp-<host>-<pid>`; it writes `done` last), renamed into place when complete: a
    folder under its final name is always whole, and an error, Ctrl-C or SIGTERM (a full disk is one line)
    leaves nothing half-built. One process at a time (locked): another that built it meanwhile is not repeated.
    The staging of a process of this host that died without cleaning up (SIGKILL) is removed by the next build.
    An incomplete `final` (altered by hand, or from an older layout) is replaced."""
    final = Path(final)
    if (final / done).exists():
        if stale_staging(final):  # a killed builder's leftovers beside a folder another process finished
            with contextlib.suppress(OSError), locked(final):
                _remove_stale(final)
        return final
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(locked(final))
        except OSError as err:
            raise UserError(f"cannot create {final.parent} ({err.strerror}); set paths.data_root=<a writable folder> "
                            "(or HPRUNE_DATA_ROOT), or paths.models_root for models") from None
        _remove_stale(final)  # (under the lock: no process of this host is building `final` now)
        if (final / done).exists():  # another process built it while this one waited
            return final
        staging = final.with_name(f"{final.name}{STAGING}{_host()}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
            build(staging)
            if not (staging / done).exists():
                raise RuntimeError(f"building {final} wrote no {done}")
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                raise UserError(f"the disk is full while writing {final.name} in {final.parent}; free space or "
                                "point paths.data_root (or paths.models_root) at a larger disk (nothing "
                                "half-written was kept)") from None
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        return final


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"
