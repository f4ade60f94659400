"""fairseq's published translation models (the `hub_models()` of fairseq's Transformer), fetched and unpacked
into `<paths.models_root>/<name>/` with the data settings their papers evaluated them with (hprune.yaml, read
by data=pretrained).

fairseq publishes no checksums for these archives: the sha256 of the first complete download is recorded next
to it (`<archive>.sha256`, and in hprune.yaml) and every later download of that archive is checked against it.
Downloads resume and retry as the WMT corpora do (data/download.py); data.mirror replaces fairseq's base URL.
"""
from __future__ import annotations

import os
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..files import build_once, file_digest, write_atomic
from ..model_folder import SETTINGS_FILE, write_settings
from .corpora import ARCHIVE_ERRORS
from .download import Remote, fetch

BASE_URL = "https://dl.fbaipublicfiles.com/fairseq/models/"


@dataclass(frozen=True)
class Published:
    archive: str          # file name under BASE_URL
    settings: dict = field(default_factory=dict)  # hprune.yaml: test/valid/train sets, tokenizer, bpe


_NEWS_EN_FR = {"test_sets": ["wmt14/full", "wmt13"], "valid_sets": ["wmt12"],
               "train_sets": ["wmt09", "wmt10", "wmt11"]}


_NEWS_WMT19 = {"test_sets": ["wmt19", "wmt18"], "valid_sets": ["wmt17"], "train_sets": ["wmt14/full", "wmt13"]}


PUBLISHED = {
    # Ott et al. (2018), the model Michel et al. (2019) pruned: Moses + subword-nmt, joined dictionary
    "wmt14.en-fr.joined-dict.transformer": Published("wmt14.en-fr.joined-dict.transformer.tar.bz2", _NEWS_EN_FR),
    "wmt16.en-de.joined-dict.transformer": Published(
        "wmt16.en-de.joined-dict.transformer.tar.bz2",
        {"test_sets": ["wmt14/full"], "valid_sets": ["wmt13"], "train_sets": ["wmt12", "wmt11", "wmt10"]}),
    # Ng et al. (2019), WMT19: Moses + fastBPE; EN-RU with separate dictionaries. The single models, not the
    # ensembles (whose EN-RU archive shipped EN-DE's bpecodes: fairseq#2928)
    "wmt19.en-de.joined-dict.single_model": Published("wmt19.en-de.joined-dict.single_model.tar.gz", _NEWS_WMT19),
    "wmt19.de-en.joined-dict.single_model": Published("wmt19.de-en.joined-dict.single_model.tar.gz", _NEWS_WMT19),
    "wmt19.en-ru.single_model": Published("wmt19.en-ru.single_model.tar.gz", _NEWS_WMT19),
    "wmt19.ru-en.single_model": Published("wmt19.ru-en.single_model.tar.gz", _NEWS_WMT19),
}


def _published(name: Optional[str]) -> Published:
    if name not in PUBLISHED:
        raise UserError(f"unknown published model '{name}'; choose one of: {', '.join(PUBLISHED)} "
                        "(hprune data fetch published=NAME)")
    return PUBLISHED[name]


def _recorded(record: Path) -> Optional[str]:
    return record.read_text().split()[0] if record.is_file() else None


def fetch_published(name: str, models_root: Path, downloads: Path, mirror: Optional[str] = None,
                    retries: int = 4) -> Path:
    """The unpacked model folder `<models_root>/<name>/` (model.pt, dict.*.txt, codes, hprune.yaml); fetched,
    checked and unpacked unless there."""
    published = _published(name)
    folder = Path(models_root).expanduser().absolute() / name
    if (folder / SETTINGS_FILE).is_file():
        return folder
    if any(folder.glob("dict.*.txt")):  # unpacked by hand: it only lacks its settings
        write_settings(folder, published.settings)
        return folder
    url = (mirror or BASE_URL).rstrip("/") + "/" + published.archive
    archive = Path(downloads).expanduser().absolute() / published.archive
    record = archive.with_name(archive.name + ".sha256")
    recorded = _recorded(record)
    fetch(Remote(url=url, sha256=recorded), archive, retries=retries)
    sha256 = recorded or file_digest(archive, "sha256")
    if recorded is None:  # no public checksum: remember this download's, check every later one against it
        write_atomic(record, f"{sha256}  {archive.name}\n")

    def unpack(staging: Path) -> None:
        scratch = staging / ".unpacked"
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(scratch, filter="data")
        except ARCHIVE_ERRORS as err:
            raise UserError(f"{archive} is corrupt ({err}); delete it (and {record.name}) and run again") from None
        entries = list(scratch.iterdir())
        root = entries[0] if len(entries) == 1 and entries[0].is_dir() else scratch  # the archive's own folder
        for entry in root.iterdir():
            os.replace(entry, staging / entry.name)
        shutil.rmtree(scratch)
        write_settings(staging, {**published.settings,
                                  "source": {"url": url, "sha256": sha256, "sha256_source": "first download"}})

    build_once(folder, SETTINGS_FILE, unpack)
    return folder
