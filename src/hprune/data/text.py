"""Your own parallel text (data=text): files per language or one tab-separated file for train, valid and test,
prepared as fairseq's recipes prepare WMT (data/stages.py's chain: tokenize, joint BPE or sentencepiece,
clean-corpus-n on train and valid, binarize), the test set's target side kept as it is for BLEU.

A split is given one of three ways (configs/data/text.yaml):

    data.train=corpus/train                  a prefix, as fairseq-preprocess's --trainpref: train.<src>, train.<tgt>
    data.train=corpus/train.tsv              one file, source<TAB>target a line
    data.train='{src: a.txt, tgt: b.txt}'    two files named

Bad input is one line each, before anything is kept: a missing file, one file given as both sides, sides of
unequal length (both files and their counts), an empty or non-UTF-8 line (the file and line; data.on_bad_lines=skip
drops such pairs and counts them), a test set without its references, a model with its own vocabulary (data=pretrained
encodes your files with it). A byte-order mark at the start of a line (a file's first) and CRLF line ends are no text.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..files import write_json
from ..model_folder import LANGUAGES, SETTINGS_FILE, folder_of, read_settings
from .kinds import DataKind, register_kind
from .processing import BOM, MAX_WORD_LENGTH
from .stages import (
    READS,
    binarize_into,
    check_processing,
    clean_splits,
    config_key,
    count_lines,
    file_identity,
    learn_bpe,
    map_files,
    run_stage,
    stage_info,
    subword_files,
    subword_model,
)

log = logging.getLogger(__name__)
TOKENIZERS = ("moses", None, "none")
MIN_VALID = 8  # fairseq-train's --required-batch-size-multiple: a smaller last batch is dropped, all of a smaller split
FORMS = "a prefix (PREFIX.<src_lang> and PREFIX.<tgt_lang>), a .tsv file (source<TAB>target) or {src: FILE, tgt: FILE}"


@dataclass(frozen=True)
class SplitFiles:
    """Where one split's text is: two line-parallel files, or one tab-separated file (target None)."""
    setting: str
    source: Path
    target: Optional[Path] = None

    @property
    def files(self) -> list[Path]:
        return [self.source] + ([self.target] if self.target else [])


def _path(value) -> Path:
    return Path(str(value)).expanduser().absolute()


def split_files(data: DictConfig, split: str) -> Optional[SplitFiles]:
    """The files of data.<split> (None where the split is not given)."""
    setting = f"data.{split}"
    if split in data and OmegaConf.is_missing(data, split):
        raise UserError(f"data=text needs {setting}: {FORMS}")
    given = data.get(split)
    if given is None:
        return None
    if OmegaConf.is_dict(given):
        unknown = set(given) - {"src", "tgt"}
        if unknown or "src" not in given:
            raise UserError(f"{setting} names its files as {{src: FILE, tgt: FILE}}, not {sorted(given)}")
        found = SplitFiles(setting, _path(given.src), _path(given.tgt) if given.get("tgt") else None)
        if found.target is None:
            raise UserError(f"{setting} has no tgt file; give {{src: FILE, tgt: FILE}}")
    else:
        path = _path(given)
        found = SplitFiles(setting, path) if path.is_file() else \
            SplitFiles(setting, Path(f"{path}.{data.src_lang}"), Path(f"{path}.{data.tgt_lang}"))
    missing = [path for path in found.files if not path.is_file()]
    if missing == [found.target] and split == "test":
        raise UserError(f"{setting}: the references {found.target} do not exist; a test set needs its target side "
                        "for BLEU: give {src: FILE, tgt: FILE} or a .tsv file")
    if missing:
        raise UserError(f"{setting}: {' and '.join(str(p) for p in missing)} "
                        f"{'does' if len(missing) == 1 else 'do'} not exist; give {FORMS}")
    if found.target is not None and found.source.samefile(found.target):
        raise UserError(f"{setting}: {found.source} is given as both the {data.src_lang} and the {data.tgt_lang} side "
                        f"({found.target}); give each language's own file")
    return found


def check(data: DictConfig) -> None:
    for lang in ("src_lang", "tgt_lang"):
        if not data.get(lang):
            raise UserError(f"data=text needs data.{lang}=<language code> (as the file names use it, e.g. de)")
    check_processing(data, TOKENIZERS)
    if data.on_bad_lines not in ("fail", "skip"):
        raise UserError(f"data.on_bad_lines must be fail or skip, not '{data.on_bad_lines}'")
    if int(data.valid_every) < 2:
        raise UserError(f"data.valid_every must be 2 or more (every N-th training pair is held out), not {data.valid_every}")
    for split in ("train", "valid", "test"):
        split_files(data, split)


def bind(data: DictConfig, checkpoint: Optional[Path] = None, languages=(None, None)) -> DictConfig:
    """data=text is for a model trained on it. A model that came with its own vocabulary and subwords (a folder
    with hprune.yaml: a published or imported model, or a pruned checkpoint of one) reads only text encoded with
    them, which data=pretrained does: refused before anything is read or learnt, naming that form with these files."""
    folder = folder_of(checkpoint) if checkpoint is not None else None
    if folder is None or not (folder / SETTINGS_FILE).is_file():
        return data
    sets, tsv = [], []
    for split in ("test", "valid", "train"):
        found = split_files(data, split)
        if found is not None:
            files = (found.source, found.target) if found.target is not None else ("FILE", "FILE")
            sets.append(f"'data.{split}_sets=[{{src:{files[0]},tgt:{files[1]}}}]'")
            tsv += [found.source.name] if found.target is None else []
    multilingual = LANGUAGES in read_settings(folder)
    raise UserError(f"{folder} holds a model with its own vocabulary and subwords ({SETTINGS_FILE}), which data=text "
                    "would learn anew from your files and the model could not read; encode your files with the "
                    f"model's own: data=pretrained data.model_dir={folder} {' '.join(sets)}"
                    + (f" data.src_lang={data.src_lang} data.tgt_lang={data.tgt_lang}" if multilingual else "")
                    + (f" (the two columns of {', '.join(tsv)} as two files)" if tsv else ""))


def key(data: DictConfig) -> str:
    files = {split: [file_identity(p) for p in found.files]
             for split in ("train", "valid", "test") if (found := split_files(data, split))}
    return config_key(data, files)


# ------------------------------------------------------------------------------------------- reading
class LineCheck:
    """Empty and non-UTF-8 lines: `fail` stops at the first with its file and line, `skip` drops the pair and
    counts it."""

    def __init__(self, policy: str):
        self.policy, self.count, self.first = policy, 0, []

    def bad(self, where: str, line_no: int, why: str) -> None:
        if self.policy == "fail":
            raise UserError(f"{where} line {line_no} {why}; fix the file or set data.on_bad_lines=skip to drop such "
                            "sentence pairs")
        self.count += 1
        if len(self.first) < 5:
            self.first.append(f"{where}:{line_no} ({why})")

    def text(self, raw: bytes, where: str, line_no: int) -> Optional[str]:
        try:  # one line per sentence, whatever whitespace it had (\r of CRLF included), without a byte-order mark
            text = " ".join(raw.decode("utf-8").lstrip(BOM).split())  # (a file's, or one concatenated in)
        except UnicodeDecodeError as err:
            self.bad(where, line_no, f"is not UTF-8 ({err.reason} at byte {err.start})")
            return None
        if not text:
            self.bad(where, line_no, "is empty")
            return None
        return text


def read_pairs(found: SplitFiles, lines: LineCheck) -> Iterator[tuple[str, str]]:
    """The (source, target) pairs of one split, both sides checked."""
    if found.target is None:
        with open(found.source, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                cells = raw.rstrip(b"\r\n").split(b"\t")
                if len(cells) != 2:
                    lines.bad(str(found.source), line_no, f"has {len(cells)} tab-separated columns, not 2 "
                              "(source<TAB>target)")
                    continue
                pair = [lines.text(cell, str(found.source), line_no) for cell in cells]
                if None not in pair:
                    yield pair[0], pair[1]
        return
    counts = [count_lines(path) for path in found.files]
    if counts[0] != counts[1]:
        raise UserError(f"{found.setting}: {found.source} has {counts[0]} lines and {found.target} {counts[1]}; "
                        "the two sides must be line-parallel")
    with open(found.source, "rb") as fs, open(found.target, "rb") as ft:
        for line_no, (raw_s, raw_t) in enumerate(zip(fs, ft), start=1):
            s, t = lines.text(raw_s, str(found.source), line_no), lines.text(raw_t, str(found.target), line_no)
            if s is not None and t is not None:
                yield s, t


def _read(data: DictConfig, out: Path) -> dict:
    """train, valid (given, or every valid_every-th training pair) and test as text, checked."""
    src, tgt = data.src_lang, data.tgt_lang
    counts, skipped = {}, {}
    valid_given = split_files(data, "valid") is not None
    files = {split: [open(out / f"{split}.{lang}", "w", encoding="utf-8") for lang in (src, tgt)]
             for split in ("train", "valid", "test")}
    try:
        for split in ("train", "valid", "test"):
            found = split_files(data, split)
            if found is None:
                continue
            lines = LineCheck(data.on_bad_lines)
            for n, (s, t) in enumerate(read_pairs(found, lines), start=1):
                to = "valid" if split == "train" and not valid_given and n % int(data.valid_every) == 0 else split
                files[to][0].write(s + "\n")
                files[to][1].write(t + "\n")
                counts[to] = counts.get(to, 0) + 1
            if lines.count:
                skipped[split] = lines.count
                log.warning("%s: skipped %d sentence pairs with empty or non-UTF-8 lines (first: %s)",
                            found.setting, lines.count, "; ".join(lines.first))
    finally:
        for pair in files.values():
            for f in pair:
                f.close()
    for split in ("train", "valid", "test"):
        if not counts.get(split):
            raise UserError(f"data.{split} has no sentence pairs left to use"
                            + (f" ({skipped[split]} skipped)" if skipped.get(split) else "")
                            + ("; give data.valid or more training pairs" if split == "valid" else ""))
    return {"pairs": counts, "skipped_bad_lines": skipped}


# --------------------------------------------------------------------------------------- the chain
def tokenize_step(tokenizer: Optional[str], lowercase: bool) -> Optional[str]:
    """The line function of processing.py a tokenizer setting names (steps joined by +), None for nothing."""
    steps = {"moses": ["moses"], None: ["normalize"], "none": []}[tokenizer] + (["lowercase"] if lowercase else [])
    return "+".join(steps) or None


def build_from_text(data: DictConfig, stages: Path, extracted: Path, staging: Path,
                    test_splits: Sequence[str] = ("test",), tokenize: bool = True, clean: bool = True) -> dict:
    """A data set folder from text splits: `extracted/<split>.<lang>` (train, valid and the test splits) the text
    the model reads, `extracted/references/<split>.<lang>` the references where they differ from it (else the
    text itself), `extracted/annotations/*` copied into raw/ as they are (e.g. gold alignments). tokenize=False:
    the kind tokenized the text already; clean=False: no length filter (annotations of valid stay in step)."""
    src, tgt, workers = data.src_lang, data.tgt_lang, int(data.workers)
    splits = ["train", "valid", *test_splits]
    step = tokenize_step(data.tokenizer, bool(data.get("lowercase", False))) if tokenize else None
    tokenized = extracted if step is None else run_stage(
        stages, "tokenize", {"text": extracted.name, "step": step},
        lambda out: map_files(lambda lang: (step, lang), splits, (src, tgt), extracted, out, workers))
    learned = run_stage(stages, "learn_bpe", {"tokenize": tokenized.name, "bpe": data.bpe, "size": data.bpe_size},
                        lambda out: learn_bpe(data.bpe, int(data.bpe_size),
                                              [tokenized / f"train.{src}", tokenized / f"train.{tgt}"], out))
    model = subword_model(learned, data.bpe)
    applied = run_stage(stages, "apply_bpe", {"learn_bpe": learned.name, "tokenize": tokenized.name},
                        lambda out: map_files(lambda lang: (data.bpe, str(model)), splits, (src, tgt), tokenized,
                                              out, workers))
    references = extracted / "references" if (extracted / "references").is_dir() else extracted
    texts = {split: applied for split in splits}
    raws = {split: (references, f"{split}.{{lang}}") for split in splits if split != "train"}
    kept = None
    if clean:
        cleaned = run_stage(stages, "clean", {"apply_bpe": applied.name, "references": references.name,
                                              "min_len": data.min_len, "max_len": data.max_len,
                                              "max_ratio": data.max_ratio, "max_word_length": MAX_WORD_LENGTH},
                            lambda out: clean_splits(data, applied, references, out))
        texts.update(train=cleaned, valid=cleaned)
        raws["valid"] = (cleaned, "valid.raw.{lang}")
        kept = stage_info(cleaned)["kept"]
    valid = count_lines(texts["valid"] / f"valid.{src}")
    if valid < MIN_VALID:
        raise UserError(f"the valid split holds {valid} sentence pairs{' after cleaning' if clean else ''}; "
                        f"fairseq-train needs {MIN_VALID} or more (it drops a last batch smaller than its batch "
                        "multiple, 8): give data.valid, or a smaller data.valid_every")
    annotations = extracted / "annotations"
    (staging / "raw").mkdir()
    for path in sorted(annotations.iterdir()) if annotations.is_dir() else []:
        (staging / "raw" / path.name).write_bytes(path.read_bytes())
    binarize_into(staging, data, texts, raws, model, test_splits)
    if tokenize and data.get("lowercase"):  # lowercased output is scored against lowercased references
        for split in raws:
            reference = staging / "raw" / f"{split}.{tgt}"
            reference.write_text(reference.read_text(encoding="utf-8").lower(), encoding="utf-8")
    counts = {split: count_lines(texts[split] / f"{split}.{src}") for split in splits}
    return {"name": data.name, "pair": f"{src}-{tgt}", "splits": counts,
            "stages": {"text": str(extracted), "bpe": str(applied)}, **({"cleaned": kept} if kept else {})}


def build(data: DictConfig, data_root: Path, staging: Path) -> dict:
    stages = data_root / "stages" / data.name
    identity = {split: [file_identity(p) for p in found.files]
                for split in ("train", "valid", "test") if (found := split_files(data, split))}
    read = run_stage(stages, "read", {"files": identity, "langs": [data.src_lang, data.tgt_lang],
                                      "valid_every": data.valid_every, "on_bad_lines": data.on_bad_lines,
                                      "reader": READS["read"]},
                     lambda out: _read(data, out))
    summary = {**build_from_text(data, stages, read, staging), "skipped_bad_lines": stage_info(read)["skipped_bad_lines"]}
    write_json(staging / "data.json", summary)
    return summary


register_kind(DataKind("text", key=key, check=check, build=build, bind=bind, subwords=subword_files,
                       text_step=lambda data: tokenize_step(data.tokenizer, bool(data.get("lowercase", False)))))
