"""WMT data sets the way fairseq's prepare-wmt14en2{de,fr}.sh build them, plus EN-RU, as cached stages.

    fetch -> extract (+ subsample, valid = every 100th pair) -> tokenize (Moses) -> learn BPE -> apply BPE
          -> clean (length 1-250, ratio 1.5) -> binarize (fairseq-preprocess)
    test sets from sacreBLEU -> tokenize -> apply BPE (the codes learnt above); pristine references kept for BLEU.

Each stage lives in `<data_root>/stages/<name>/<stage>-<key>/`, where the key hashes the stage's parameters and
its inputs' keys: a stage whose inputs did not change is skipped, and changing, say, the BPE size reruns only
BPE and what follows. A stage is built under a temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..files import write_json
from . import testsets
from .corpora import BadLines, download_name, languages, read_pairs, remote
from .download import fetch
from .kinds import DataKind, register_kind
from .stages import (
    binarize_into,
    check_processing,
    clean_splits,
    config_key,
    count_lines,
    learn_bpe,
    map_files,
    run_stage,
    subword_files,
    subword_model,
    write_lines,
)

log = logging.getLogger(__name__)
TOKENIZERS = ("moses", None)


def check_wmt(data: DictConfig) -> None:
    """Reject a data config that cannot work before anything is downloaded."""
    src, tgt = data.src_lang, data.tgt_lang
    check_processing(data, TOKENIZERS)
    if not data.sources:
        raise UserError(f"data set {data.name} declares no sources; add them under data.sources")
    for name, source in data.sources.items():
        missing = {src, tgt} - languages(source)
        if missing:
            have = "-".join(sorted(languages(source))) or "none"
            raise UserError(f"language pair {src}-{tgt} is not in data set {data.name}: its source {name} has "
                            f"{have}; use a data config of that pair (data=wmt14_en_de, wmt14_en_fr or wmt_en_ru)")
    if data.on_bad_utf8 not in ("fail", "skip"):
        raise UserError(f"data.on_bad_utf8 must be fail or skip, not '{data.on_bad_utf8}'")
    if data.subsample is not None and int(data.subsample) <= 0:
        raise UserError(f"data.subsample must be a positive number of sentence pairs or null, not {data.subsample}")
    testsets.check_test_sets(list(data.test_sets), src, tgt)


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
        write_lines(out / f"{split}.{data.src_lang}", sources)
        write_lines(out / f"{split}.{data.tgt_lang}", references)
        names[split] = {"test_set": name, "sentences": len(sources)}
    return {"splits": names}


def _test_splits(data: DictConfig) -> list[str]:
    """fairseq-preprocess --testpref a,b,c names the splits test, test1, test2."""
    return ["test" if i == 0 else f"test{i}" for i in range(len(data.test_sets))]


def prepare_text(data: DictConfig, data_root: Path) -> dict[str, Path]:
    """Every stage up to BPE'd text. The training side and the test side are separate chains, so adding a test
    set does not re-tokenize the training corpus. Returns the stage folders: train (clean), test (BPE'd test
    sets), and raw_test (their untokenized sources and pristine references); and subwords, the BPE codes or
    sentencepiece model learnt."""
    check_wmt(data)
    stages = data_root / "stages" / data.name
    downloads = _fetch_all(data, data_root)
    langs = {"src": data.src_lang, "tgt": data.tgt_lang}
    workers = int(data.workers)
    tokenizer = lambda lang: (data.tokenizer or "normalize", lang)  # noqa: E731
    extracted = run_stage(stages, "extract", {
        **langs, "sources": _source_identity(data, downloads), "subsample": data.subsample,
        "subsample_seed": data.subsample_seed, "valid_every": data.valid_every, "on_bad_utf8": data.on_bad_utf8,
    }, lambda out: _extract(data, downloads, out))
    tokenized = run_stage(stages, "tokenize", {"extract": extracted.name, "tokenizer": data.tokenizer},
                          lambda out: map_files(tokenizer, ["train", "valid"], langs.values(), extracted, out, workers))
    learned = run_stage(stages, "learn_bpe", {"tokenize": tokenized.name, "bpe": data.bpe, "size": data.bpe_size},
                        lambda out: learn_bpe(data.bpe, int(data.bpe_size),
                                              [tokenized / f"train.{lang}" for lang in langs.values()], out))
    model = str(subword_model(learned, data.bpe))
    segment = lambda lang: (data.bpe, model)  # noqa: E731
    applied = run_stage(stages, "apply_bpe", {"learn_bpe": learned.name, "tokenize": tokenized.name},
                        lambda out: map_files(segment, ["train", "valid"], langs.values(), tokenized, out, workers))
    cleaned = run_stage(stages, "clean", {"apply_bpe": applied.name, "min_len": data.min_len,
                                          "max_len": data.max_len, "max_ratio": data.max_ratio},
                        lambda out: clean_splits(data, applied, extracted, out))
    tests = run_stage(stages, "testsets", {**langs, "test_sets": list(data.test_sets)},
                      lambda out: _test_sets(data, out))
    splits = _test_splits(data)
    tests_tok = run_stage(stages, "tokenize_test", {"testsets": tests.name, "tokenizer": data.tokenizer},
                          lambda out: map_files(tokenizer, splits, langs.values(), tests, out, workers))
    tests_bpe = run_stage(stages, "apply_bpe_test", {"learn_bpe": learned.name, "tokenize_test": tests_tok.name},
                          lambda out: map_files(segment, splits, langs.values(), tests_tok, out, workers))
    return {"train": cleaned, "test": tests_bpe, "raw_test": tests, "subwords": Path(model)}


def build(data: DictConfig, data_root: Path, staging: Path) -> dict:
    """Fill a data set folder: bin/ (fairseq data-bin) and raw/ (untokenized text; the references BLEU uses)."""
    stages = prepare_text(data, data_root)
    src, tests = data.src_lang, _test_splits(data)
    binarize_into(staging, data, {"train": stages["train"], "valid": stages["train"],
                                  **{split: stages["test"] for split in tests}},
                  {"valid": (stages["train"], "valid.raw.{lang}"),
                   **{split: (stages["raw_test"], f"{split}.{{lang}}") for split in tests}},
                  stages["subwords"], tests)
    test_info = json.loads((stages["raw_test"] / "DONE").read_text())["splits"]
    summary = {"name": data.name, "pair": f"{src}-{data.tgt_lang}",
               "stages": {k: str(v) for k, v in stages.items() if k != "subwords"},
               "splits": {"train": count_lines(stages["train"] / f"train.{src}"),
                          "valid": count_lines(stages["train"] / f"valid.{src}"),
                          **{k: v["sentences"] for k, v in test_info.items()}},
               "test_sets": {k: v["test_set"] for k, v in test_info.items()}}
    write_json(staging / "data.json", summary)
    return summary


register_kind(DataKind("wmt", key=lambda data: config_key(data), check=check_wmt, build=build, subwords=subword_files,
                       text_step=lambda data: data.tokenizer or "normalize"))
