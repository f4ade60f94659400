"""A data-bin of your own (data=databin data.path=DIR): the binarized splits a model was trained and tested on,
as `fairseq-preprocess` wrote them, used as they are.

The data set folder links to the data-bin's files (bin/) and holds the references BLEU is computed against
(raw/): the files in data.references (`<split>.<tgt>`, untokenized), or else each split's binarized targets
turned back into text as fairseq-generate prints them (BPE removed with data.post_process, detokenized with
data.tokenizer). The languages are read from the file names unless given.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from omegaconf import DictConfig, open_dict

from ..errors import UserError
from ..files import write_json
from .kinds import DataKind, register_kind
from .processing import read_lines

SPLIT_FILE = re.compile(r"^(?P<split>[a-z]+\d*)\.(?P<src>[\w-]+?)-(?P<tgt>[\w-]+)\.(?P<lang>[\w-]+)\.bin$")


def _folder(data: DictConfig) -> Path:
    if not data.get("path"):
        raise UserError("data=databin needs the data-bin folder: data.path=<the folder fairseq-preprocess wrote>")
    folder = Path(data.path).expanduser().absolute()
    if not folder.is_dir():
        raise UserError(f"data.path={folder} is not a folder; pass the folder fairseq-preprocess wrote")
    return folder


def _split_files(folder: Path) -> list[re.Match]:
    return [m for m in (SPLIT_FILE.match(p.name) for p in sorted(folder.iterdir())) if m]


def language_pairs(folder: Path) -> list[tuple[str, str]]:
    """The (source, target) pairs a data-bin's file names spell, as fairseq reads them."""
    return sorted({(m["src"], m["tgt"]) for m in _split_files(folder)}) if folder.is_dir() else []


def bind(data: DictConfig) -> DictConfig:
    """The config with the data-bin's languages filled in (from its file names) where left null."""
    folder = _folder(data)
    pairs = language_pairs(folder)
    data = data.copy()
    with open_dict(data):
        data.path = str(folder)
        if not (data.src_lang and data.tgt_lang):
            if len(pairs) != 1:
                found = ", ".join(f"{s}-{t}" for s, t in pairs) or "no binarized splits (<split>.<src>-<tgt>.<lang>.bin)"
                raise UserError(f"{folder} has {found}; set data.src_lang and data.tgt_lang")
            data.src_lang, data.tgt_lang = data.src_lang or pairs[0][0], data.tgt_lang or pairs[0][1]
    return data


def splits(data: DictConfig) -> list[str]:
    folder = _folder(data)
    names = sorted({m["split"] for m in _split_files(folder)
                    if (m["src"], m["tgt"], m["lang"]) == (data.src_lang, data.tgt_lang, data.tgt_lang)})
    missing = [f"dict.{lang}.txt" for lang in (data.src_lang, data.tgt_lang) if not (folder / f"dict.{lang}.txt").is_file()]
    if missing or not names:
        raise UserError(f"{folder} is not a {data.src_lang}-{data.tgt_lang} data-bin (it lacks "
                        f"{', '.join(missing) or 'binarized splits'}); pass the folder fairseq-preprocess wrote")
    return names


def config_key(data: DictConfig) -> str:
    """The data-bin's identity: its folder, its files (by size and time) and how references are made."""
    folder = _folder(data)
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir()) if p.is_file()}
    key = {"path": str(folder), "files": files, "langs": [data.src_lang, data.tgt_lang],
           "references": data.get("references"), "post_process": data.post_process, "tokenizer": data.tokenizer,
           "format": 2}  # 2: references read as read_lines reads them (no byte-order mark)
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def build(data: DictConfig, staging: Path) -> dict:
    from .. import backend

    folder, src, tgt = _folder(data), data.src_lang, data.tgt_lang
    names = splits(data)
    (staging / "bin").mkdir()
    (staging / "raw").mkdir()
    for path in folder.iterdir():
        if path.is_file() and (path.name.startswith("dict.") or SPLIT_FILE.match(path.name) or path.suffix == ".idx"):
            os.symlink(path, staging / "bin" / path.name)
    references = Path(data.references).expanduser() if data.get("references") else None
    decoded = []
    for split in names:
        given = references / f"{split}.{tgt}" if references is not None else None
        if given is not None and given.is_file():
            lines = read_lines(given)
        else:
            lines = backend.split_targets(folder, split, src, tgt, data.post_process, data.tokenizer)
            decoded.append(split)
        (staging / "raw" / f"{split}.{tgt}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    summary = {"name": data.name, "pair": f"{src}-{tgt}", "path": str(folder), "splits": names,
               "references_decoded_from_bin": decoded}
    write_json(staging / "data.json", summary)
    return summary


register_kind(DataKind("databin", key=config_key, check=splits, build=lambda data, root, staging: build(data, staging),
                        bind=lambda data, checkpoint, languages: bind(data)))
