"""Prepared data sets live in a cache keyed by their parameters: `<data_root>/<name>-<hash>/{raw,bin}`.

`bin/` is the fairseq data-bin; `raw/<split>.<lang>` the untokenized text, whose target side is what BLEU is
computed against. A data set is built once per parameter set, into a staging folder renamed into place when
complete (files.build_once: one process at a time), so a killed preparation never leaves a folder that looks
ready. Kinds (data/kinds.py, one module each): `toy` (the embedded synthetic task, data/toy.py), `wmt`
(downloaded corpora, data/wmt.py), `text` (your own parallel text, data/text.py), `iwslt14` (fairseq's IWSLT14
recipe, data/iwslt14.py), `bible_alignments` (the Greek NT -> English with manual alignments,
data/bible_alignments.py), `pretrained` (text encoded with a model's own codes and dictionaries,
data/pretrained.py) and `databin` (a data-bin of your own, data/databin.py); the text kinds share
data/stages.py's cached stages and data/processing.py's tokenizers and BPE.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from omegaconf import DictConfig

from ..errors import UserError
from ..files import build_once, write_atomic
from ..model_folder import LANGUAGES, SETTINGS_FILE, folder_of, read_settings
from . import databin
from .kinds import DataKind, get_kind

log = logging.getLogger(__name__)


def bind(data: DictConfig, checkpoint: Optional[Path] = None,
         languages: tuple[Optional[str], Optional[str]] = (None, None)) -> DictConfig:
    """The data config for one model: a model's own data (pretrained, databin) completes its settings from the
    model's folder or the data-bin (languages as the checkpoint records them); toy and wmt are as given."""
    return get_kind(data).bound(data, checkpoint, languages)


def prefixes(data: DictConfig) -> tuple[Optional[str], Optional[str]]:
    """The tokens put before each source and each target sentence (a multilingual model's language tokens: the
    data kind binds them), or None."""
    return tuple(None if data.get(key) in (None, "auto") else str(data[key]) for key in ("source_prefix", "target_prefix"))


def multilingual_needs_languages(folder, tokens: dict) -> str:
    codes = list(tokens)
    return (f"{folder} holds a multilingual model: say which pair to translate, e.g. data.src_lang={codes[0]} "
            f"data.tgt_lang={codes[min(1, len(codes) - 1)]} (its {len(codes)} language codes are in "
            f"{Path(folder) / SETTINGS_FILE})")


def model_languages(data: DictConfig, checkpoint, kind: Optional[DataKind] = None) -> tuple[str, str]:
    """The languages of a checkpoint that records none (fairseq-train without -s/-t; fairseq infers them at run
    time from the data-bin's file names). In this order: the data settings (for data=databin, its data-bin's
    file names), the file names of the data-bin the checkpoint was trained on, and the two dictionaries beside
    the checkpoint, whose sizes against the embeddings' say which side is which. `checkpoint`: a
    backend.Checkpoint; `kind`: the data's kind, where the caller resolved it already."""
    kind = kind or get_kind(data)
    given = data if kind.from_model else kind.bound(data)
    if given.get("src_lang") and given.get("tgt_lang"):
        return given.src_lang, given.tgt_lang
    trained_on = databin.language_pairs(checkpoint.trained_on) if checkpoint.trained_on is not None else []
    if len(trained_on) == 1:
        return trained_on[0]
    folder = Path(data.model_dir) if data.get("model_dir") else folder_of(checkpoint.path)
    tokens = read_settings(folder).get(LANGUAGES)
    if tokens:
        raise UserError(multilingual_needs_languages(folder, tokens))
    sizes = {path.name[5:-4]: 4 + sum(1 for line in path.open(encoding="utf-8") if line.strip())  # + fairseq's 4 specials
             for path in sorted(folder.glob("dict.*.txt"))}
    matching = [(a, b) for a in sizes for b in sizes if a != b and (sizes[a], sizes[b]) == checkpoint.vocabulary_sizes]
    if len(sizes) == 2 and len(matching) == 1:
        return matching[0]
    beside = ", ".join(f"dict.{lang}.txt" for lang in sizes) or "no dict.<lang>.txt"
    raise UserError(f"{checkpoint.path} records no languages (trained without -s/-t), and neither the data settings, "
                    f"its data-bin nor the dictionaries beside it ({beside}) say which they are; pass "
                    "data.src_lang=<source> data.tgt_lang=<target>")


def dataset_dir(data: DictConfig, data_root: str | Path, kind: Optional[DataKind] = None) -> Path:
    """The cache folder of a bound data config; the kind's check runs first (its key may read what it checks)."""
    kind = kind or get_kind(data)
    kind.check(data)  # before anything is created or downloaded
    return Path(data_root).expanduser().absolute() / f"{data.name}-{kind.key(data)}"


def bin_dir(data: DictConfig, data_root: str | Path) -> Path:
    """The fairseq data-bin folder of a bound data set (it exists once `prepare` has run)."""
    return dataset_dir(data, data_root) / "bin"


def prepare(data: DictConfig, data_root: str | Path, kind: Optional[DataKind] = None) -> Path:
    """Build the data set of a bound data config (`bind`) if needed; returns its data-bin folder. `kind`: the
    data's kind, where the caller resolved it already."""
    kind = kind or get_kind(data)
    root = dataset_dir(data, data_root, kind)
    if (root / "READY").exists():
        return root / "bin"

    def build(staging: Path) -> None:
        log.info("preparing %s data in %s", data.name, root)
        kind.build(data, Path(data_root).expanduser().absolute(), staging)
        write_atomic(staging / "READY", "ok\n")

    return build_once(root, "READY", build) / "bin"


def test_set_of(data_bin: Path, split: str) -> str | None:
    """The sacreBLEU test set behind a split of a prepared WMT data set (e.g. test -> wmt14/full), else None."""
    summary = Path(data_bin).parent / "data.json"
    return json.loads(summary.read_text()).get("test_sets", {}).get(split) if summary.exists() else None


@dataclass(frozen=True)
class PreparedData:
    """A prepared data set as the verbs read it beside a model: its raw text, the test sets it holds, and what
    turns a user's text into the model's tokens (the data kind's)."""
    settings: DictConfig  # the data config, bound to the model
    bin_dir: Path
    kind: DataKind

    def raw_file(self, name: str) -> Path:
        """A file of the raw/ folder: `<split>.<lang>` (the references are the target side's), and what a kind
        writes beside them (`<split>.align`, `<split>.arcs.jsonl`)."""
        return self.bin_dir.parent / "raw" / name

    def test_set(self, split: str) -> Optional[str]:
        return test_set_of(self.bin_dir, split)

    def subword_files(self) -> List[Path]:
        """The files that turn text into the model's tokens (a published or imported model's codes or
        sentencepiece models, the BPE codes or sentencepiece model hprune learnt for a WMT data set; data sets
        prepared before issue 27 lack the copy: prepare them again); none for the other kinds."""
        return [] if self.kind.subwords is None else self.kind.subwords(self.settings, self.bin_dir.parent)

    def text_step(self) -> Optional[str]:
        """What the kind does to a line of text before its subwords (data/processing.py's step), or None."""
        return self.kind.text_step(self.settings) if self.kind.text_step else None
