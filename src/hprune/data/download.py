"""Downloads that survive bad networks: resumed with HTTP ranges, verified by checksum, retried with backoff.

A file is written as `<dest>.part` and renamed to `<dest>` only once its checksum is right, so a file under its
final name is always complete. A verified file gets a `<dest>.verified` stamp (size, mtime, checksum) so the
next run does not hash gigabytes again. Two processes fetching one file (sweep jobs on a cold cache) take turns
through a lock file (`<dest>.lock`): the second finds the file complete. A terminal shows a progress bar.
"""
from __future__ import annotations

import errno
import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import console
from ..errors import UserError
from ..files import file_digest, locked

log = logging.getLogger(__name__)
CHUNK = 1 << 20


class RemoteMissing(UserError):
    """The server answered 404/410: the file is not there (callers probing for optional files catch this)."""


@dataclass(frozen=True)
class Remote:
    url: Optional[str]            # None: the file can only be downloaded by hand (e.g. a licence to accept)
    sha256: Optional[str] = None
    md5: Optional[str] = None     # sacreBLEU declares md5 for its test sets
    size: Optional[int] = None

    @property
    def checksum(self) -> tuple[str, str] | None:
        if self.sha256:
            return "sha256", self.sha256.lower()
        if self.md5:
            return "md5", self.md5.lower()
        return None


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def is_verified(path: Path, remote: Remote) -> bool:
    """True when `path` holds the remote's file (checked once, then remembered by size and mtime)."""
    if not path.is_file() or (remote.size is not None and path.stat().st_size != remote.size):
        return False
    expected = remote.checksum
    if expected is None:  # nothing to check against: a complete file is what we have
        return True
    stamp = _stamp(path)
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == [*_stat_key(path), *expected]:
                return True
        except (OSError, ValueError):
            pass
    if file_digest(path, expected[0]) != expected[1]:
        return False
    stamp.write_text(json.dumps([*_stat_key(path), *expected]))
    return True


def manual_hint(remote: Remote, dest: Path) -> str:
    return f"download {remote.url} by hand and place it at {dest}, then run again" if remote.url else \
        f"place the file at {dest}, then run again"


def fetch(remote: Remote, dest: Path, retries: int = 4, backoff_s: float = 2.0, timeout_s: float = 60.0) -> Path:
    """Make `dest` hold the remote file; returns dest. A checksum mismatch is downloaded once more, then fails."""
    dest = Path(dest)
    if is_verified(dest, remote):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with locked(dest):
        return _fetch(remote, dest, retries, backoff_s, timeout_s)


def _fetch(remote: Remote, dest: Path, retries: int, backoff_s: float, timeout_s: float) -> Path:
    if is_verified(dest, remote):  # another process fetched it while this one waited for the lock
        return dest
    if dest.exists():
        log.warning("%s does not match its checksum; downloading it again", dest)
        dest.unlink()
    if remote.url is None:
        raise UserError(f"{dest.name} cannot be downloaded automatically; {manual_hint(remote, dest)}")
    for attempt in (1, 2):
        part = _download(remote, dest, retries, backoff_s, timeout_s)
        expected = remote.checksum
        actual = file_digest(part, expected[0]) if expected else None
        if expected is None or actual == expected[1]:
            os.replace(part, dest)
            if expected:
                _stamp(dest).write_text(json.dumps([*_stat_key(dest), *expected]))
            return dest
        part.unlink()
        log.warning("%s: %s %s, expected %s (attempt %d of 2)", remote.url, expected[0], actual, expected[1], attempt)
    raise UserError(f"{remote.url} downloaded twice with the wrong {expected[0]} ({actual}, expected {expected[1]}); "
                    f"the server's file changed or the declared checksum is wrong: fix it in the data config, "
                    f"or {manual_hint(remote, dest)}")


def _download(remote: Remote, dest: Path, retries: int, backoff_s: float, timeout_s: float) -> Path:
    """Download into `<dest>.part`, resuming what is there; retries connection failures with backoff."""
    part = dest.with_name(dest.name + ".part")
    last_error: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            delay = backoff_s * 2 ** (attempt - 1)
            log.info("retrying %s in %.0f s (%s)", remote.url, delay, last_error)
            time.sleep(delay)
        try:
            if _download_once(remote, part, timeout_s):
                return part
            last_error = ConnectionError("the connection closed before the end of the file")
        except urllib.error.HTTPError as err:
            if err.code == 416:  # the range starts at or past the end: the part file is stale
                part.unlink(missing_ok=True)
                last_error = err
                continue
            if 400 <= err.code < 500:
                error = RemoteMissing if err.code in (404, 410) else UserError
                raise error(f"{remote.url} answered HTTP {err.code} ({err.reason}); "
                            f"{manual_hint(remote, dest)}") from None
            last_error = err
        except (OSError, http.client.HTTPException) as err:  # URLError, timeouts, resets, cut connections
            if getattr(err, "errno", None) == errno.ENOSPC:
                part.unlink(missing_ok=True)
                raise UserError(f"the disk is full while downloading {remote.url} to {dest.parent}; free space "
                                "or set paths.data_root=<a larger disk> (the partial file was removed)") from None
            last_error = err
    reason = getattr(last_error, "reason", None) or last_error
    raise UserError(f"cannot download {remote.url} ({reason}) after {retries + 1} tries; "
                    f"{manual_hint(remote, dest)}")


def _download_once(remote: Remote, part: Path, timeout_s: float) -> bool:
    """One request from where `part` ends. True when the file is complete."""
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(remote.url, headers={"User-Agent": "hprune"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        if have and response.status != 206:  # the server ignored the range: start again
            log.info("%s does not resume downloads; starting again", remote.url)
            have = 0
        total = _total_size(response, have)
        with open(part, "ab" if have else "wb") as out, console.progress(part.name[:-5], total, "B") as bar:
            bar.goto(have)
            while True:
                block = response.read(CHUNK)
                if not block:
                    break
                out.write(block)
                have += len(block)
                bar.goto(have)
    return total is None or have >= total


def _total_size(response, have: int) -> Optional[int]:
    content_range = response.headers.get("Content-Range")  # bytes 100-199/200
    if content_range and "/" in content_range and not content_range.endswith("/*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return have + int(length) if length is not None else None
