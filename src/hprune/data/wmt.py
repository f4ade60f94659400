"""WMT data sets the way fairseq's prepare-wmt14en2{de,fr}.sh build them, plus EN-RU, as cached stages.

    fetch -> extract (+ subsample, valid = every 100th pair) -> tokenize (Moses) -> learn BPE -> apply BPE
          -> clean (length 1-250, ratio 1.5) -> binarize (fairseq-preprocess)
    test sets from sacreBLEU -> tokenize -> apply BPE (the codes learnt above); pristine references kept for BLEU.

Each stage lives in `<data_root>/stages/<name>/<stage>-<key>/`, where the key hashes the stage's parameters and
its inputs' keys: a stage whose inputs did not change is skipped, and changing, say, the BPE size reruns only
BPE and what follows. A stage is built under a temporary name and renamed when complete.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..files import build_once, write_json
from . import testsets
from .corpora import BadLines, download_name, languages, read_pairs, remote
from .download import fetch
from .kinds import DataKind, register_kind
from .text import keep_pair, learn_sentencepiece, learn_subword_nmt, map_file

log = logging.getLogger(__name__)
STAGE_VERSION = 1  # bump when a stage's output changes for the same inputs
BPE_KINDS = ("subword_nmt", "sentencepiece")
SUBWORD_FILES = {"subword_nmt": "bpecodes", "sentencepiece": "spm.model"}  # in the data set folder, beside bin/
TOKENIZERS = ("moses", None)
NOT_IDENTITY = ("workers", "download_retries")  # how a data set is built, not what it is


def key_of(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def config_key(data: DictConfig) -> str:
    """The data set's identity: every setting except how many workers build it."""
    params = OmegaConf.to_container(data, resolve=True)
    for key in NOT_IDENTITY:
        params.pop(key, None)
    return key_of({"params": params, "version": STAGE_VERSION})


def check_wmt(data: DictConfig) -> None:
    """Reject a data config that cannot work before anything is downloaded."""
    src, tgt = data.src_lang, data.tgt_lang
    if src == tgt:
        raise UserError(f"data.src_lang and data.tgt_lang are both '{src}'; set two different languages")
    if not data.sources:
        raise UserError(f"data set {data.name} declares no sources; add them under data.sources")
    for name, source in data.sources.items():
        missing = {src, tgt} - languages(source)
        if missing:
            have = "-".join(sorted(languages(source))) or "none"
            raise UserError(f"language pair {src}-{tgt} is not in data set {data.name}: its source {name} has "
                            f"{have}; use a data config of that pair (data=wmt14_en_de, wmt14_en_fr or wmt_en_ru)")
    if data.bpe not in BPE_KINDS:
        raise UserError(f"data.bpe must be one of {', '.join(BPE_KINDS)}, not '{data.bpe}'")
    if data.tokenizer not in TOKENIZERS:
        raise UserError(f"data.tokenizer must be moses or null, not '{data.tokenizer}'")
    if data.on_bad_utf8 not in ("fail", "skip"):
        raise UserError(f"data.on_bad_utf8 must be fail or skip, not '{data.on_bad_utf8}'")
    if data.subsample is not None and int(data.subsample) <= 0:
        raise UserError(f"data.subsample must be a positive number of sentence pairs or null, not {data.subsample}")
    testsets.check_test_sets(list(data.test_sets), src, tgt)


# --------------------------------------------------------------------------------------------- stages
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


def _write_lines(path: Path, lines) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def _source_identity(data: DictConfig, downloads: dict[str, Path]) -> dict:
    out = {}
    for name, source in data.sources.items():
        ident = OmegaConf.to_container(source, resolve=True)
        if source.get("sha256") or source.get("md5"):  # the checksum names the file, whatever mirror served it
            ident.pop("url", None)
        else:  # no checksum: the file itself is the identity
            st = downloads[name].stat()
            ident["file"] = [st.st_size, st.st_mtime_ns]
        out[name] = ident
    return out


def _fetch_all(data: DictConfig, data_root: Path) -> dict[str, Path]:
    cache = data_root / "downloads"
    retries = int(data.get("download_retries", 4))
    return {name: fetch(remote(source), cache / download_name(name, source), retries=retries)
            for name, source in data.sources.items()}


def _extract(data: DictConfig, downloads: dict[str, Path], out: Path) -> dict:
    """All corpora, concatenated, optionally subsampled; every `valid_every`-th pair goes to valid."""
    src, tgt = data.src_lang, data.tgt_lang
    bad = BadLines(data.on_bad_utf8)
    scratch = out / "scratch"
    scratch.mkdir()
    all_s, all_t = out / f"all.{src}", out / f"all.{tgt}"
    counts, n = {}, 0
    with open(all_s, "w", encoding="utf-8") as fs, open(all_t, "w", encoding="utf-8") as ft:
        for name, source in data.sources.items():
            before = n
            for s, t in read_pairs(name, source, downloads[name], src, tgt, scratch, bad):
                fs.write(" ".join(s.split()) + "\n")  # one line per sentence, whatever whitespace it had
                ft.write(" ".join(t.split()) + "\n")
                n += 1
            counts[name] = n - before
    bad.report()
    shutil.rmtree(scratch)
    keep = None
    if data.subsample is not None and int(data.subsample) < n:
        rng = np.random.default_rng(int(data.subsample_seed))
        keep = np.zeros(n, dtype=bool)
        keep[rng.choice(n, size=int(data.subsample), replace=False)] = True
    kept = _split_valid(all_s, all_t, out, src, tgt, int(data.valid_every), keep)
    all_s.unlink()
    all_t.unlink()
    return {"pairs": counts, "skipped_non_utf8": bad.count, **kept}


def _split_valid(all_s: Path, all_t: Path, out: Path, src: str, tgt: str, every: int, keep) -> dict:
    counts = {"train": 0, "valid": 0}
    files = {split: [open(out / f"{split}.{lang}", "w", encoding="utf-8") for lang in (src, tgt)]
             for split in counts}
    try:
        with open(all_s, encoding="utf-8") as fs, open(all_t, encoding="utf-8") as ft:
            kept = 0
            for i, (s, t) in enumerate(zip(fs, ft)):
                if keep is not None and not keep[i]:
                    continue
                kept += 1
                split = "valid" if kept % every == 0 else "train"  # awk 'NR%100 == 0' of the recipes
                files[split][0].write(s)
                files[split][1].write(t)
                counts[split] += 1
    finally:
        for pair in files.values():
            for f in pair:
                f.close()
    return counts


def _test_sets(data: DictConfig, out: Path) -> dict:
    names = {}
    for split, name in zip(_test_splits(data), data.test_sets):
        sources, references = testsets.load(name, data.src_lang, data.tgt_lang)
        _write_lines(out / f"{split}.{data.src_lang}", sources)
        _write_lines(out / f"{split}.{data.tgt_lang}", references)
        names[split] = {"test_set": name, "sentences": len(sources)}
    return {"splits": names}


def _test_splits(data: DictConfig) -> list[str]:
    """fairseq-preprocess --testpref a,b,c names the splits test, test1, test2."""
    return ["test" if i == 0 else f"test{i}" for i in range(len(data.test_sets))]


def _map_files(step_of_lang: Callable[[str], tuple[str, str]], splits: list[str], data: DictConfig,
               src_dir: Path, out: Path) -> dict:
    """Apply a line function (chosen per language) to `<split>.<lang>` of every split."""
    lines = {}
    for split in splits:
        for lang in (data.src_lang, data.tgt_lang):
            step, arg = step_of_lang(lang)
            name = f"{split}.{lang}"
            lines[name] = map_file(step, arg, src_dir / name, out / name, int(data.workers))
    return {"lines": lines}


def _learn_bpe(data: DictConfig, tok: Path, out: Path) -> dict:
    files = [tok / f"train.{data.src_lang}", tok / f"train.{data.tgt_lang}"]
    if data.bpe == "subword_nmt":
        learn_subword_nmt(files, out / "codes", int(data.bpe_size))
    else:
        learn_sentencepiece(files, out / "spm", int(data.bpe_size))
    return {}


def _clean(data: DictConfig, bpe: Path, extracted: Path, out: Path) -> dict:
    """clean-corpus-n on train and valid (BPE tokens, as the recipes); the valid references follow their pairs.
    (Test sets are never filtered.) Streamed: the corpora can be far larger than memory."""
    src, tgt = data.src_lang, data.tgt_lang
    kept = {}
    for split in ("train", "valid"):
        names = (f"{split}.{src}", f"{split}.{tgt}", f"{split}.raw.{src}", f"{split}.raw.{tgt}")
        inputs = [bpe / names[0], bpe / names[1], extracted / f"{split}.{src}", extracted / f"{split}.{tgt}"]
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


def prepare_text(data: DictConfig, data_root: Path) -> dict[str, Path]:
    """Every stage up to BPE'd text. The training side and the test side are separate chains, so adding a test
    set does not re-tokenize the training corpus. Returns the stage folders: train (clean), test (BPE'd test
    sets), and raw_test (their untokenized sources and pristine references); and subwords, the BPE codes or
    sentencepiece model learnt."""
    check_wmt(data)
    stages = data_root / "stages" / data.name
    downloads = _fetch_all(data, data_root)
    langs = {"src": data.src_lang, "tgt": data.tgt_lang}
    tokenizer = lambda lang: (data.tokenizer or "normalize", lang)  # noqa: E731
    extracted = run_stage(stages, "extract", {
        **langs, "sources": _source_identity(data, downloads), "subsample": data.subsample,
        "subsample_seed": data.subsample_seed, "valid_every": data.valid_every, "on_bad_utf8": data.on_bad_utf8,
    }, lambda out: _extract(data, downloads, out))
    tokenized = run_stage(stages, "tokenize", {"extract": extracted.name, "tokenizer": data.tokenizer},
                          lambda out: _map_files(tokenizer, ["train", "valid"], data, extracted, out))
    learned = run_stage(stages, "learn_bpe", {"tokenize": tokenized.name, "bpe": data.bpe, "size": data.bpe_size},
                        lambda out: _learn_bpe(data, tokenized, out))
    model = str(learned / ("codes" if data.bpe == "subword_nmt" else "spm.model"))
    segment = lambda lang: (data.bpe, model)  # noqa: E731
    applied = run_stage(stages, "apply_bpe", {"learn_bpe": learned.name, "tokenize": tokenized.name},
                        lambda out: _map_files(segment, ["train", "valid"], data, tokenized, out))
    cleaned = run_stage(stages, "clean", {"apply_bpe": applied.name, "min_len": data.min_len,
                                          "max_len": data.max_len, "max_ratio": data.max_ratio},
                        lambda out: _clean(data, applied, extracted, out))
    tests = run_stage(stages, "testsets", {**langs, "test_sets": list(data.test_sets)},
                      lambda out: _test_sets(data, out))
    splits = _test_splits(data)
    tests_tok = run_stage(stages, "tokenize_test", {"testsets": tests.name, "tokenizer": data.tokenizer},
                          lambda out: _map_files(tokenizer, splits, data, tests, out))
    tests_bpe = run_stage(stages, "apply_bpe_test", {"learn_bpe": learned.name, "tokenize_test": tests_tok.name},
                          lambda out: _map_files(segment, splits, data, tests_tok, out))
    return {"train": cleaned, "test": tests_bpe, "raw_test": tests, "subwords": Path(model)}


def build(data: DictConfig, data_root: Path, staging: Path) -> dict:
    """Fill a data set folder: bin/ (fairseq data-bin) and raw/ (untokenized text; the references BLEU uses)."""
    from .. import backend  # fairseq is needed only to binarize

    stages = prepare_text(data, data_root)
    text, raw = staging / "text", staging / "raw"
    text.mkdir()
    raw.mkdir()
    src, tgt = data.src_lang, data.tgt_lang
    for lang in (src, tgt):  # the binarizer wants every split under one prefix folder: link, don't copy
        for split in ("train", "valid"):
            os.symlink(stages["train"] / f"{split}.{lang}", text / f"{split}.{lang}")
        shutil.copyfile(stages["train"] / f"valid.raw.{lang}", raw / f"valid.{lang}")
        for split in _test_splits(data):
            os.symlink(stages["test"] / f"{split}.{lang}", text / f"{split}.{lang}")
            shutil.copyfile(stages["raw_test"] / f"{split}.{lang}", raw / f"{split}.{lang}")
    shutil.copyfile(stages["subwords"], staging / SUBWORD_FILES[data.bpe])  # what a deployed model encodes with
    backend.binarize(text, staging / "bin", src, tgt, workers=int(data.workers),
                     joined=bool(data.joined_dictionary), test_splits=_test_splits(data))
    shutil.rmtree(text)
    test_info = json.loads((stages["raw_test"] / "DONE").read_text())["splits"]
    summary = {"name": data.name, "pair": f"{src}-{tgt}", "stages": {k: str(v) for k, v in stages.items()
                                                                     if k != "subwords"},
               "splits": {"train": _count(stages["train"] / f"train.{src}"),
                          "valid": _count(stages["train"] / f"valid.{src}"),
                          **{k: v["sentences"] for k, v in test_info.items()}},
               "test_sets": {k: v["test_set"] for k, v in test_info.items()}}
    write_json(staging / "data.json", summary)
    return summary


def _count(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


register_kind(DataKind("wmt", key=config_key, check=check_wmt, build=build,
                        subwords=lambda data, folder: [folder / name for name in SUBWORD_FILES.values()
                                                       if (folder / name).is_file()]))
