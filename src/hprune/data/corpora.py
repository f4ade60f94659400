"""Parallel corpora out of downloaded archives: members found by name, both sides read in lock-step, UTF-8 checked.

A source is declared in the data config (see configs/data/wmt14_en_de.yaml):

    europarl_v7:
      url: https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz
      sha256: 0224c7c7...        # size and checksum, so a changed or truncated file is caught
      size: 657632379
      files: {en: training/europarl-v7.de-en.en, de: training/europarl-v7.de-en.de}   # members, one per language
    news_commentary_v14:
      url: https://data.statmt.org/news-commentary/v14/training/news-commentary-v14.en-ru.tsv.gz
      columns: {en: 0, ru: 1}    # or one tab-separated file (the download itself, or a member named by `file`)

Members ending in .gz are decompressed (giga-fren ships gzipped files inside a tar).
"""
from __future__ import annotations

import gzip
import itertools
import logging
import shutil
import tarfile
import zlib
from pathlib import Path
from typing import Iterator, Optional

from omegaconf import DictConfig

from ..errors import UserError
from .download import Remote

log = logging.getLogger(__name__)
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


def remote(source: DictConfig) -> Remote:
    return Remote(url=source.get("url"), sha256=source.get("sha256"), md5=source.get("md5"), size=source.get("size"))


def download_name(name: str, source: DictConfig) -> str:
    """The cache file name: the URL's basename (shared by data sets using the same archive), else the source name."""
    url = source.get("url")
    return source.get("filename") or (url.rstrip("/").rsplit("/", 1)[-1] if url else name)


def languages(source: DictConfig) -> set[str]:
    return set((source.get("files") or source.get("columns") or {}).keys())


class BadLines:
    """Counts (and reports) lines that are not UTF-8; `fail` stops at the first with its file and line."""

    def __init__(self, policy: str):
        if policy not in ("fail", "skip"):
            raise UserError(f"data.on_bad_utf8 must be fail or skip, not '{policy}'")
        self.policy, self.count, self.first = policy, 0, []

    def decode(self, raw: bytes, where: str, line_no: int) -> Optional[str]:
        try:
            return raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as err:
            if self.policy == "fail":
                raise UserError(f"{where} line {line_no} is not UTF-8 ({err.reason} at byte {err.start}); "
                                "set data.on_bad_utf8=skip to drop such sentence pairs") from None
            self.count += 1
            if len(self.first) < 5:
                self.first.append(f"{where} line {line_no}")
            return None

    def report(self) -> None:
        if self.count:
            log.warning("skipped %d sentence pairs with non-UTF-8 text (first: %s)", self.count, "; ".join(self.first))


def _copy_member(archive: Path, member: str, out: Path) -> None:
    with tarfile.open(archive, "r:*") as tar:
        try:
            info = tar.getmember(member)
        except KeyError:
            names = [m.name for m in tar.getmembers() if m.isfile()][:8]
            raise UserError(f"{archive.name} has no member '{member}' (it has e.g. {', '.join(names)}); "
                            "fix the member path in the data config") from None
        with tar.extractfile(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(gzip.GzipFile(fileobj=src) if member.endswith(".gz") else src, dst, 1 << 20)


def _unpack(archive: Path, member: Optional[str], scratch: Path) -> Path:
    """The plain-text file that `member` of `archive` (or the archive itself, when member is None) holds."""
    name = (member or archive.name).replace("/", "__")
    out = scratch / (name[:-3] if name.endswith(".gz") else name)
    try:
        if member is not None:
            _copy_member(archive, member, out)
        elif archive.name.endswith(".gz"):
            with gzip.open(archive, "rb") as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            return archive
    except ARCHIVE_ERRORS as err:
        out.unlink(missing_ok=True)
        raise UserError(f"{archive} is corrupt or truncated ({err}); delete it and run again "
                        "(if it keeps failing, the declared checksum in the data config is wrong)") from None
    return out


def read_pairs(name: str, source: DictConfig, archive: Path, src: str, tgt: str, scratch: Path,
               bad: BadLines) -> Iterator[tuple[str, str]]:
    """(source, target) sentence pairs of one corpus."""
    if source.get("files"):
        paths = [_unpack(archive, source.files[lang], scratch) for lang in (src, tgt)]
        pairs = _zip_lines(name, paths, bad)
    else:
        paths = [_unpack(archive, source.get("file"), scratch)]
        pairs = _tsv_pairs(name, paths[0], source.columns[src], source.columns[tgt], bad)
    try:
        yield from pairs
    finally:  # unpacked copies only: never the download itself
        for path in paths:
            if path != archive:
                path.unlink(missing_ok=True)


def _zip_lines(name: str, paths: list[Path], bad: BadLines) -> Iterator[tuple[str, str]]:
    with open(paths[0], "rb") as fs, open(paths[1], "rb") as ft:
        for line_no, (raw_s, raw_t) in enumerate(itertools.zip_longest(fs, ft), start=1):
            if raw_s is None or raw_t is None:
                raise UserError(f"corpus {name}: {paths[0].name} and {paths[1].name} differ in length (one ends "
                                f"at line {line_no - 1}); the archive or the member paths are wrong")
            s = bad.decode(raw_s, f"{name}:{paths[0].name}", line_no)
            t = bad.decode(raw_t, f"{name}:{paths[1].name}", line_no)
            if s is not None and t is not None:
                yield s, t


def _tsv_pairs(name: str, path: Path, col_s: int, col_t: int, bad: BadLines) -> Iterator[tuple[str, str]]:
    short = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line = bad.decode(raw, f"{name}:{path.name}", line_no)
            if line is None:
                continue
            cells = line.split("\t")
            if len(cells) <= max(col_s, col_t):
                short += 1
                continue
            yield cells[col_s], cells[col_t]
    if short:
        log.warning("corpus %s: skipped %d lines with fewer than %d tab-separated columns", name, short,
                    max(col_s, col_t) + 1)
