"""Prepared data sets live in a cache keyed by their parameters: `<data_root>/<name>-<hash>/{raw,bin}`.

`bin/` is the fairseq data-bin; `raw/<split>.<lang>` the untokenized text, whose target side is what BLEU is
computed against. A data set is built once per parameter set, into a temporary folder renamed into place when
complete, so a killed preparation never leaves a folder that looks ready. Kinds: `toy` (the embedded synthetic
task, data/toy.py), `wmt` (downloaded corpora, data/wmt.py), `pretrained` (text encoded with a model's own
codes and dictionaries, data/pretrained.py) and `databin` (a data-bin of your own, data/databin.py).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from . import databin, pretrained, wmt
from .toy import SRC, TGT, ToyParams, build_lexicon, write_corpus

log = logging.getLogger(__name__)
FORMAT_VERSION = 3  # bump when the generator or the binarization changes


def toy_params(data: DictConfig) -> ToyParams:
    params = OmegaConf.to_container(data.params, resolve=True)
    unknown = set(params) - set(ToyParams.__dataclass_fields__)
    if unknown:
        raise UserError(f"unknown toy data parameter(s) {sorted(unknown)}; "
                        f"valid ones: {', '.join(ToyParams.__dataclass_fields__)}")
    least = {"n_train": 1, "n_valid": 1, "n_noun_classes": 1, "nouns_per_class": 1, "n_adjectives": 1, "n_verbs": 1,
             "n_adverbs": 1, "n_names": 1, "name_min_count": 1, "n_stems": 1, "n_endings": 1}  # others may be 0
    probabilities = ("p_adverb", "p_object_first")
    for key, value in params.items():
        if key == "seed" or key in probabilities:
            continue
        if not isinstance(value, int) or value < least.get(key, 0):
            raise UserError(f"data.params.{key}={value} must be a whole number >= {least.get(key, 0)}; "
                            f"e.g. data.params.{key}={getattr(ToyParams, key)}")
    if params.get("name_max_count", ToyParams.name_max_count) < params.get("name_min_count", ToyParams.name_min_count):
        raise UserError("data.params.name_max_count must be >= data.params.name_min_count")
    for key in probabilities:
        if not isinstance(params.get(key, 0), (int, float)) or not 0 <= params.get(key, 0) <= 1:
            raise UserError(f"data.params.{key}={params[key]} is a probability; use 0..1")
    toy = ToyParams(**params)
    try:
        build_lexicon(toy)  # a few milliseconds: refuses inventories too small for the words asked for
    except ValueError as err:
        raise UserError(f"data.params: {err}") from None
    if toy.n_names * toy.name_max_count > 2 * toy.n_train:
        raise UserError(f"data.params.n_train={toy.n_train} has too few noun phrases for n_names x name_max_count "
                        f"= {toy.n_names * toy.name_max_count} name occurrences; raise n_train or lower n_names")
    return toy


KINDS = ("toy", "wmt", "pretrained", "databin")


def _check_kind(data: DictConfig) -> None:
    if data.kind not in KINDS:
        raise UserError(f"unknown data kind '{data.kind}'; use one of {', '.join(KINDS)} (see configs/data/)")


def bind(data: DictConfig, checkpoint: Optional[Path] = None,
         languages: tuple[Optional[str], Optional[str]] = (None, None)) -> DictConfig:
    """The data config for one model: a model's own data (pretrained, databin) completes its settings from the
    model's folder or the data-bin (languages as the checkpoint records them); toy and wmt are as given."""
    _check_kind(data)
    if data.kind == "pretrained":
        return pretrained.bind(data, checkpoint, languages)
    if data.kind == "databin":
        return databin.bind(data)
    return data


def model_languages(data: DictConfig, checkpoint) -> tuple[str, str]:
    """The languages of a checkpoint that records none (fairseq-train without -s/-t; fairseq infers them at run
    time from the data-bin's file names). In this order: the data settings (for data=databin, its data-bin's
    file names), the file names of the data-bin the checkpoint was trained on, and the two dictionaries beside
    the checkpoint, whose sizes against the embeddings' say which side is which. `checkpoint`: a
    backend.Checkpoint."""
    _check_kind(data)
    given = databin.bind(data) if data.kind == "databin" else data
    if given.get("src_lang") and given.get("tgt_lang"):
        return given.src_lang, given.tgt_lang
    trained_on = databin.language_pairs(checkpoint.trained_on) if checkpoint.trained_on is not None else []
    if len(trained_on) == 1:
        return trained_on[0]
    folder = Path(data.model_dir) if data.get("model_dir") else checkpoint.path.parent
    sizes = {path.name[5:-4]: 4 + sum(1 for line in path.open(encoding="utf-8") if line.strip())  # + fairseq's 4 specials
             for path in sorted(folder.glob("dict.*.txt"))}
    matching = [(a, b) for a in sizes for b in sizes if a != b and (sizes[a], sizes[b]) == checkpoint.vocabulary_sizes]
    if len(sizes) == 2 and len(matching) == 1:
        return matching[0]
    beside = ", ".join(f"dict.{lang}.txt" for lang in sizes) or "no dict.<lang>.txt"
    raise UserError(f"{checkpoint.path} records no languages (trained without -s/-t), and neither the data settings, "
                    f"its data-bin nor the dictionaries beside it ({beside}) say which they are; pass "
                    "data.src_lang=<source> data.tgt_lang=<target>")


def dataset_dir(data: DictConfig, data_root: str | Path) -> Path:
    _check_kind(data)
    if data.kind == "toy":
        key = json.dumps({"kind": data.kind, "params": asdict(toy_params(data)), "format": FORMAT_VERSION},
                         sort_keys=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    else:
        digest = {"wmt": wmt.config_key, "pretrained": pretrained.config_key, "databin": databin.config_key}[data.kind](data)
    return Path(data_root).expanduser().absolute() / f"{data.name}-{digest}"


def bin_dir(data: DictConfig, data_root: str | Path) -> Path:
    """The fairseq data-bin folder of a data set (it exists once `prepare` has run)."""
    return dataset_dir(bind(data), data_root) / "bin"


def prepare(data: DictConfig, data_root: str | Path) -> Path:
    """Build the data set if needed; returns its data-bin folder."""
    data = bind(data)
    root = dataset_dir(data, data_root)
    if (root / "READY").exists():
        return root / "bin"
    if data.kind == "wmt":
        wmt.check_wmt(data)  # before anything is created or downloaded
    elif data.kind == "pretrained":
        pretrained.check(data)
    elif data.kind == "databin":
        databin.splits(data)
    log.info("preparing %s data in %s", data.name, root)
    staging = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
    except OSError as err:
        raise UserError(f"cannot create the data folder {root.parent} ({err.strerror}); "
                        "set paths.data_root=<a writable folder> or HPRUNE_DATA_ROOT") from None
    try:
        if data.kind == "wmt":
            wmt.build(data, Path(data_root).expanduser().absolute(), staging)
        elif data.kind == "pretrained":
            pretrained.build(data, staging)
        elif data.kind == "databin":
            databin.build(data, staging)
        else:
            from .. import backend  # fairseq is needed only to build

            write_corpus(toy_params(data), staging / "raw", staging / "pieces")
            backend.binarize(staging / "pieces", staging / "bin", SRC, TGT)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            raise UserError(f"the disk is full while writing {root.name} in {root.parent}; free space or set "
                            "paths.data_root=<a larger disk> (nothing half-written was kept)") from None
        raise
    (staging / "READY").write_text("ok\n")
    if root.exists():  # an incomplete folder from an older layout or a crash
        shutil.rmtree(root)
    try:
        os.replace(staging, root)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return root / "bin"


def test_set_of(data_bin: Path, split: str) -> str | None:
    """The sacreBLEU test set behind a split of a prepared WMT data set (e.g. test -> wmt14/full), else None."""
    summary = Path(data_bin).parent / "data.json"
    return json.loads(summary.read_text()).get("test_sets", {}).get(split) if summary.exists() else None
