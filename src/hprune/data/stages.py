"""A data set's preparation as cached stages, and the steps the text-based kinds (wmt, text, iwslt14,
bible_alignments) share.

Each stage lives in `<data_root>/stages/<name>/<stage>-<key>/`, where the key hashes the stage's parameters and
its inputs' keys: a stage whose inputs did not change is skipped, and changing, say, the BPE size reruns only
BPE and what follows. A stage is built under a temporary name and renamed when complete (files.build_once).

`build_from_text` is the chain from text splits to a data set, as fairseq's recipes run it:

    <split>.<lang> -> tokenize (Moses, or normalisation only, or nothing; lowercased if asked) -> learn joint BPE
        on train -> apply BPE -> clean train and valid (clean-corpus-n on BPE tokens) -> binarize
    the references BLEU uses: the split's target side as it was read (pristine), or what the kind put in raw/
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..files import build_once, write_json
from .processing import MAX_WORD_LENGTH, keep_pair, learn_sentencepiece, learn_subword_nmt, map_file

log = logging.getLogger(__name__)
STAGE_VERSION = 1  # bump when a stage's output changes for the same inputs
BPE_KINDS = ("subword_nmt", "sentencepiece")
SUBWORD_FILES = {"subword_nmt": "bpecodes", "sentencepiece": "spm.model"}  # in the data set folder, beside bin/
NOT_IDENTITY = ("workers", "download_retries", "bleu_tokenize")  # how a data set is built or scored, not what it is
# what changed the text kinds' output since STAGE_VERSION 1 without changing every stage: part of every data set's
# identity (a data set built before is built again, its unchanged stages reused); `read` is data=text's reading
READS = {"max_word_length": MAX_WORD_LENGTH, "read": 2}


def key_of(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def config_key(data: DictConfig, extra: Optional[dict] = None) -> str:
    """The data set's identity: every setting except how many workers build it (and `extra`, e.g. the
    identity of files it reads)."""
    params = OmegaConf.to_container(data, resolve=True)
    for key in NOT_IDENTITY:
        params.pop(key, None)
    return key_of({"params": params, "version": STAGE_VERSION, "reads": READS, **({"files": extra} if extra else {})})


def key_with_file(data: DictConfig, name: str, given: Optional[str]) -> str:
    """config_key, plus the identity of a file of the user's (`given`: its path, or None): a changed file is
    another data set."""
    return config_key(data, {name: file_identity(Path(given).expanduser().absolute())} if given else None)


def file_identity(path: Path) -> list:
    """A local file as a stage input: its path, size and modification time (a changed file is a new input)."""
    st = Path(path).stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def run_stage(stages: Path, name: str, inputs: dict, build: Callable[[Path], Optional[dict]]) -> Path:
    """The folder of a stage's outputs, built by `build(folder)` unless a complete one with these inputs exists."""
    final = stages / f"{name}-{key_of({'inputs': inputs, 'version': STAGE_VERSION})}"
    if (final / "DONE").exists():
        log.info("%s: cached (%s)", name, final)
        return final
    start = time.perf_counter()

    def stage(staging: Path) -> None:
        info = build(staging) or {}
        write_json(staging / "DONE", {"inputs": inputs, "seconds": round(time.perf_counter() - start, 2), **info})

    build_once(final, "DONE", stage)
    log.info("%s: built in %.1f s (%s)", name, time.perf_counter() - start, final)
    return final


def stage_info(stage: Path) -> dict:
    return json.loads((stage / "DONE").read_text())


def write_lines(path: Path, lines) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def map_files(step_of_lang: Callable[[str], tuple[str, str]], splits: Sequence[str], langs: Sequence[str],
              src_dir: Path, out: Path, workers: int) -> dict:
    """Apply a line function (chosen per language) to `<split>.<lang>` of every split."""
    lines = {}
    for split in splits:
        for lang in langs:
            step, arg = step_of_lang(lang)
            name = f"{split}.{lang}"
            lines[name] = map_file(step, arg, src_dir / name, out / name, workers)
    return {"lines": lines}


def learn_bpe(bpe: str, size: int, files: Sequence[Path], out: Path) -> dict:
    """Joint subwords learnt on `files` (the training sides), written to out/codes or out/spm.model."""
    if bpe == "subword_nmt":
        learn_subword_nmt(list(files), out / "codes", size)
    else:
        learn_sentencepiece(list(files), out / "spm", size)
    return {}


def subword_model(learned: Path, bpe: str) -> Path:
    return learned / ("codes" if bpe == "subword_nmt" else "spm.model")


def clean_splits(data: DictConfig, bpe: Path, references: Path, out: Path, splits=("train", "valid")) -> dict:
    """clean-corpus-n on train and valid (BPE tokens, as the recipes; its word-length limit too), streamed; each
    split's references (`references/<split>.{src,tgt}`, the untokenized text) follow their pairs into
    `<split>.raw.<lang>`. Test sets are never filtered."""
    src, tgt = data.src_lang, data.tgt_lang
    kept = {}
    for split in splits:
        names = (f"{split}.{src}", f"{split}.{tgt}", f"{split}.raw.{src}", f"{split}.raw.{tgt}")
        inputs = [bpe / names[0], bpe / names[1], references / f"{split}.{src}", references / f"{split}.{tgt}"]
        ins = [open(path, encoding="utf-8") for path in inputs]
        outs = [open(out / name, "w", encoding="utf-8") for name in names]
        try:
            kept[split] = 0
            for row in zip(*ins):
                if keep_pair(row[0], row[1], int(data.min_len), int(data.max_len), float(data.max_ratio)):
                    for f, line in zip(outs, row):
                        f.write(line)
                    kept[split] += 1
        finally:
            for f in ins + outs:
                f.close()
    return {"kept": kept}


def binarize_into(staging: Path, data: DictConfig, texts: dict[str, Path], raws: dict[str, Path],
                  subwords: Optional[Path], test_splits: Sequence[str]) -> None:
    """bin/ (fairseq-preprocess of the BPE'd `texts[split]/<split>.<lang>`) and raw/ (each split's references,
    `raws[split]/<split>.<lang>` copied as `raw/<split>.<lang>`) of a data set folder; the subword model beside
    them (what a deployed model encodes with)."""
    from .. import backend  # fairseq is needed only to binarize

    text, raw = staging / "text", staging / "raw"
    text.mkdir()
    raw.mkdir(exist_ok=True)
    for lang in (data.src_lang, data.tgt_lang):  # the binarizer wants every split under one prefix: link, don't copy
        for split, folder in texts.items():
            os.symlink(folder / f"{split}.{lang}", text / f"{split}.{lang}")
        for split, (folder, name) in raws.items():
            shutil.copyfile(folder / name.format(lang=lang), raw / f"{split}.{lang}")
    if subwords is not None:
        shutil.copyfile(subwords, staging / SUBWORD_FILES[data.bpe])
    backend.binarize(text, staging / "bin", data.src_lang, data.tgt_lang, workers=int(data.workers),
                     joined=bool(data.joined_dictionary), test_splits=list(test_splits))
    shutil.rmtree(text)


def subword_files(data: DictConfig, folder: Path) -> list:
    """The files that turn text into a deployed model's tokens (the kinds' `subwords`)."""
    return [folder / name for name in SUBWORD_FILES.values() if (folder / name).is_file()]


def check_processing(data: DictConfig, tokenizers: Sequence) -> None:
    """The settings of the text chain, refused before anything is read."""
    if data.src_lang == data.tgt_lang:
        raise UserError(f"data.src_lang and data.tgt_lang are both '{data.src_lang}'; set two different languages")
    if data.bpe not in BPE_KINDS:
        raise UserError(f"data.bpe must be one of {', '.join(BPE_KINDS)}, not '{data.bpe}'")
    if data.tokenizer not in tokenizers:
        raise UserError(f"data.tokenizer must be one of {', '.join('null' if t is None else t for t in tokenizers)}, "
                        f"not '{data.tokenizer}'")
