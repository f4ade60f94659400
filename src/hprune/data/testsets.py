"""Test sets through sacreBLEU, so BLEU is computed against the pristine references (not a detokenized copy of
the tokenized, BPE'd data-bin targets: fairseq#4362).

sacreBLEU keeps its data in `$SACREBLEU` (default ~/.sacrebleu). We download its archives ourselves (resumed,
md5-checked, with the manual-download message on failure), extract them where sacreBLEU expects them, and
let sacreBLEU turn the SGML/XML into text. A pre-seeded cache is used as it is.
"""
from __future__ import annotations

import logging
import tarfile
from pathlib import Path

from ..errors import UserError
from .corpora import ARCHIVE_ERRORS
from .download import Remote, fetch

log = logging.getLogger(__name__)


def _dataset(name: str):
    from sacrebleu.dataset import DATASETS

    if name not in DATASETS:
        wmt = ", ".join(k for k in DATASETS if k.startswith("wmt"))
        raise UserError(f"unknown sacreBLEU test set '{name}'; choose from: {wmt}")
    return DATASETS[name]


def check_test_sets(names: list[str], src: str, tgt: str) -> None:
    for name in names:
        dataset = _dataset(name)
        if f"{src}-{tgt}" not in dataset.langpairs:
            pairs = ", ".join(sorted(p for p in dataset.langpairs if src in p.split("-") or tgt in p.split("-")))
            raise UserError(f"sacreBLEU test set {name} has no {src}-{tgt} (it has: {pairs or 'other pairs'}); "
                            "set data.test_sets to sets of this language pair")


def _ensure_raw(dataset, langpair: str) -> None:
    """Download and extract the test set's archive unless its files are there."""
    raw = Path(dataset._rawdir)
    members = dataset.langpairs[langpair]  # the archive members holding this pair's source and references
    if all((raw / m).exists() for m in members):
        return
    md5s = dataset.md5 or [None] * len(dataset.data)
    for url, md5 in zip(dataset.data, md5s):
        archive = raw / dataset._get_tarball_filename(url)
        if not archive.exists():  # a pre-seeded archive is trusted, as sacreBLEU itself does
            fetch(Remote(url=url, md5=md5), archive)
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(raw, filter="data")
        except ARCHIVE_ERRORS as err:
            raise UserError(f"{archive} is corrupt ({err}); delete it and run again") from None


def load(name: str, src: str, tgt: str) -> tuple[list[str], list[str]]:
    """(sources, references) of a sacreBLEU test set, one reference per sentence (the first)."""
    dataset = _dataset(name)
    langpair = f"{src}-{tgt}"
    files = [Path(dataset._get_txt_file_path(langpair, field)) for field in dataset.fieldnames(langpair)]
    if not all(f.exists() for f in files):
        _ensure_raw(dataset, langpair)
    sources = Path(dataset.get_source_file(langpair)).read_text(encoding="utf-8").splitlines()
    references = Path(dataset.get_reference_files(langpair)[0]).read_text(encoding="utf-8").splitlines()
    if len(sources) != len(references):
        raise UserError(f"sacreBLEU test set {name} {langpair}: {len(sources)} sources but {len(references)} "
                        f"references; delete {Path(dataset._outdir)} and run again")
    return sources, references
