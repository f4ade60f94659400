"""IWSLT14 German-English as fairseq's examples/translation/prepare-iwslt14.sh builds it, in Python:

    de-en.tgz (downloaded, or data.archive.path) -> train.tags.de-en.{de,en}: lines with <url>, <talkid> or
        <keywords> dropped, <title> and <description> tags removed -> Moses tokenizer (tokenizer.perl -l, no -a,
        no punctuation normalisation) -> clean-corpus-n 1..175 words, ratio 1.5, no word over 1,000 characters
        -> lowercased
        -> valid: every 23rd pair (awk 'NR%23 == 0'), train: the rest
    IWSLT14.TED*.{de,en}.xml: the <seg> lines, ’ as ', tokenized and lowercased -> test: dev2010, TEDX.dev2012,
        tst2010, tst2011 and tst2012 concatenated, in that order
    -> joint BPE, 10,000 merges, learnt on train (stages.py's chain, no further cleaning) -> binarize (one
       dictionary a language: the recipe runs fairseq-preprocess without --joined-dictionary)

BLEU is the papers': hypotheses as the model writes them (BPE removed, still tokenized and lowercased) against
the tokenized, lowercased references, as fairseq-generate scores IWSLT14. No size or checksum of de-en.tgz is
published: a first download is checked by its content (the archive opens and holds the two training files and
the five test sets), and its sha256 goes into data.json so two machines can compare theirs.
"""
from __future__ import annotations

import re
import tarfile
from pathlib import Path

from omegaconf import DictConfig

from ..errors import UserError
from ..files import file_digest, write_json
from .corpora import ARCHIVE_ERRORS
from .download import Remote, fetch
from .kinds import DataKind, register_kind
from .processing import MAX_WORD_LENGTH, keep_pair, line_function
from .stages import check_processing, key_with_file, run_stage, subword_files, write_lines
from .text import build_from_text

FOLDER = "de-en"
_SEG = re.compile(r'<seg id="[0-9]*">\s*')


def check(data: DictConfig) -> None:
    check_processing(data, (None,))  # the text is tokenized here; evaluation undoes nothing but BPE
    if (data.src_lang, data.tgt_lang) not in (("de", "en"), ("en", "de")):
        raise UserError(f"IWSLT14's archive de-en.tgz holds de and en, not {data.src_lang}-{data.tgt_lang}; set "
                        "data.src_lang and data.tgt_lang to de and en (either way round)")
    path = data.archive.get("path")
    if path and not Path(path).expanduser().is_file():
        raise UserError(f"data.archive.path={path} does not exist; give the de-en.tgz you downloaded, or "
                        "data.archive.path=null to download it")
    if not path and not data.archive.get("url"):
        raise UserError("data=iwslt14_de_en needs data.archive.url or data.archive.path (the recipe's de-en.tgz)")


def _archive(data: DictConfig, data_root: Path) -> Path:
    if data.archive.get("path"):
        return Path(data.archive.path).expanduser().absolute()
    remote = Remote(url=data.archive.url, sha256=data.archive.get("sha256"), size=data.archive.get("size"))
    return fetch(remote, data_root / "downloads" / "iwslt14-de-en.tgz", retries=int(data.download_retries))


def _members(data: DictConfig) -> dict[str, str]:
    """The archive's members the recipe reads, by what they become."""
    langs = (data.src_lang, data.tgt_lang)
    out = {f"train.{lang}": f"{FOLDER}/train.tags.de-en.{lang}" for lang in langs}
    for name in data.test_sets:
        out.update({f"{name}.{lang}": f"{FOLDER}/{name}.de-en.{lang}.xml" for lang in langs})
    return out


def _read_members(archive: Path, members: dict[str, str]) -> dict[str, list[str]]:
    try:
        with tarfile.open(archive, "r:*") as tar:
            names = set(tar.getnames())
            missing = sorted(m for m in members.values() if m not in names)
            if missing:
                raise UserError(f"{archive} is not IWSLT14's de-en.tgz: it has no {', '.join(missing[:3])}"
                                f"{' ...' if len(missing) > 3 else ''}; give the recipe's archive "
                                "(data.archive.path) or delete it to download it again")
            return {key: _lines(archive, member, tar.extractfile(member)) for key, member in members.items()}
    except ARCHIVE_ERRORS as err:
        raise UserError(f"{archive} is corrupt or truncated ({err}); delete it and run again") from None


def _lines(archive: Path, member: str, handle) -> list[str]:
    """A member's lines, split at \n only (as grep and sed read them)."""
    if handle is None:
        raise UserError(f"{archive}: {member} is not a file; give the recipe's de-en.tgz")
    try:
        text = handle.read().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{archive}: {member} is not UTF-8 ({err.reason} at byte {err.start}); give the recipe's "
                        "de-en.tgz") from None
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def train_lines(lines: list[str]) -> list[str]:
    """grep -v '<url>' | grep -v '<talkid>' | grep -v '<keywords>' | sed the title and description tags away."""
    drop = ("<url>", "<talkid>", "<keywords>")
    tags = ("<title>", "</title>", "<description>", "</description>")
    out = []
    for line in lines:
        if not any(tag in line for tag in drop):
            for tag in tags:
                line = line.replace(tag, "")
            out.append(line)
    return out


def test_lines(lines: list[str]) -> list[str]:
    """grep '<seg id' | sed the seg tags away | ’ as '."""
    return [re.sub(r"\s*</seg>\s*", "", _SEG.sub("", line)).replace("\u2019", "'") for line in lines
            if "<seg id" in line]


def _extract(data: DictConfig, archive: Path, out: Path) -> dict:
    src, tgt = data.src_lang, data.tgt_lang
    text = _read_members(archive, _members(data))
    tokenize = {lang: line_function("moses_plain", lang) for lang in (src, tgt)}
    lower = str.lower  # lowercase.perl
    train = {lang: train_lines(text[f"train.{lang}"]) for lang in (src, tgt)}
    if len(train[src]) != len(train[tgt]):
        raise UserError(f"{archive}: train.tags.de-en.{src} has {len(train[src])} lines and train.tags.de-en.{tgt} "
                        f"{len(train[tgt])} after the recipe's filters; the archive is not the recipe's")
    pairs = [(tokenize[src](s), tokenize[tgt](t)) for s, t in zip(train[src], train[tgt])]
    cleaned = [(lower(s), lower(t)) for s, t in pairs
               if keep_pair(s, t, int(data.min_len), int(data.max_len), float(data.max_ratio))]
    every = int(data.valid_every)
    splits = {"valid": [p for i, p in enumerate(cleaned, 1) if i % every == 0],
              "train": [p for i, p in enumerate(cleaned, 1) if i % every != 0], "test": []}
    for name in data.test_sets:
        sides = [test_lines(text[f"{name}.{lang}"]) for lang in (src, tgt)]
        if len(sides[0]) != len(sides[1]):
            raise UserError(f"{archive}: {name} has {len(sides[0])} {src} and {len(sides[1])} {tgt} segments; "
                            "the archive is not the recipe's")
        splits["test"] += [(lower(tokenize[src](s)), lower(tokenize[tgt](t))) for s, t in zip(*sides)]
    for split, rows in splits.items():
        for i, lang in enumerate((src, tgt)):
            write_lines(out / f"{split}.{lang}", (row[i] for row in rows))
    return {"read_pairs": len(pairs), "cleaned_pairs": len(cleaned),
            **{f"{split}_pairs": len(rows) for split, rows in splits.items()}}


def build(data: DictConfig, data_root: Path, staging: Path) -> dict:
    archive = _archive(data, data_root)
    digest = file_digest(archive, "sha256")  # the extraction's identity, whichever way the archive came
    if data.archive.get("sha256") and digest != data.archive.sha256.lower():
        raise UserError(f"{archive} has sha256 {digest}, not data.archive.sha256={data.archive.sha256}; give the "
                        "archive that checksum names, or fix the setting")
    stages = data_root / "stages" / data.name
    extracted = run_stage(stages, "extract", {
        "archive": digest, "langs": [data.src_lang, data.tgt_lang], "test_sets": list(data.test_sets),
        "valid_every": data.valid_every, "min_len": data.min_len, "max_len": data.max_len,
        "max_ratio": data.max_ratio, "max_word_length": MAX_WORD_LENGTH}, lambda out: _extract(data, archive, out))
    summary = {**build_from_text(data, stages, extracted, staging, tokenize=False, clean=False),
               "archive": {"path": str(archive), "sha256": digest},
               "iwslt_test_sets": list(data.test_sets)}
    write_json(staging / "data.json", summary)
    return summary


register_kind(DataKind("iwslt14", key=lambda data: key_with_file(data, "archive", data.archive.get("path")),
                       check=check, build=build, subwords=subword_files,
                       text_step=lambda data: "moses_plain+lowercase"))
