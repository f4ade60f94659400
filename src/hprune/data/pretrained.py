"""A model's own vocabulary and subwords (data=pretrained): text prepared as the model's recipe prepared its
training data, then binarized with the model's dictionaries.

    raw text (sacreBLEU sets, or your own files) -> Moses (normalise + tokenize) -> the model's codes
      (subword-nmt; fastBPE's through subword-nmt; sentencepiece) -> <unk> / pieces-per-word check
      -> fairseq-preprocess --srcdict/--tgtdict (the model's dict.{src,tgt}.txt, joined or separate)

The model's directory is the folder of its checkpoint (or data.model_dir), laid out as fairseq's tarballs
unpack: dict.<lang>.txt, and `bpecodes` (older archives: `code`) or a sentencepiece model (or one a side,
spm.<lang>.model, as imported Marian models have). It may carry the
data settings of its model (test, valid and train sets, tokenizer) in hprune.yaml, which `hprune data fetch`
writes for fairseq's published models; settings given on the command line win.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from ..errors import UserError
from ..files import write_json
from ..model_folder import LANGUAGES, SETTINGS_FILE, folder_of, read_settings, write_settings
from . import testsets
from .kinds import DataKind, register_kind
from .prepare import multilingual_needs_languages, prefixes
from .processing import fastbpe_codes_to_subword_nmt, line_function, read_lines

log = logging.getLogger(__name__)
CODES_FILES = ("bpecodes", "code", "codes")
SENTENCEPIECE_FILES = ("sentencepiece.bpe.model", "sentencepiece.model", "spm.model")
SIDE_SENTENCEPIECE = ("spm.{lang}.model", "sentencepiece.{lang}.model")  # one model a side (imported Marian models)
TOKENIZERS = ("moses", None, "none")  # Moses; Moses' punctuation normalisation only (null); the text as it is
BPE_KINDS = ("auto", "subword_nmt", "fastbpe", "sentencepiece", "none")
POST_PROCESS = {"subword_nmt": "subword_nmt", "fastbpe": "subword_nmt", "sentencepiece": "sentencepiece", "none": None}
FORMAT_VERSION = 2  # bump when the preparation changes for the same inputs
JOINT_DICTIONARY = "dict.txt"  # a multilingual model's dictionary, used for every language it has


@dataclass(frozen=True)
class ModelFiles:
    folder: Path
    dictionaries: tuple[Path, Path]  # (source, target); the same file twice, or two equal files, when joined
    bpe: str                          # subword_nmt | fastbpe | sentencepiece | none
    codes: tuple[Optional[Path], Optional[Path]]  # (source, target); the same file twice when shared

    def describe(self) -> str:
        names = {p.name for p in self.codes if p is not None}
        return " and ".join(sorted(names)) or "no codes"


def _is_fastbpe(codes: Path) -> bool:
    with open(codes, encoding="utf-8") as f:
        first = f.readline().split(" ")
    return len(first) == 3 and first[2].strip().isdigit()


def model_files(data: DictConfig) -> ModelFiles:
    """The dictionaries and codes in the model's directory, or one line saying what is missing."""
    folder, src, tgt = Path(data.model_dir), data.src_lang, data.tgt_lang
    if not folder.is_dir():
        raise UserError(f"data.model_dir={folder} is not a folder; pass the folder the model's tarball unpacked to")
    missing = [f"dict.{lang}.txt" for lang in (src, tgt) if not (folder / f"dict.{lang}.txt").is_file()]
    joint = folder / JOINT_DICTIONARY
    if missing and joint.is_file():  # a multilingual model's one dictionary, whichever the pair
        missing = []
    if missing:
        have = ", ".join(sorted(p.name for p in folder.glob("dict.*.txt"))) or "no dictionaries"
        raise UserError(f"{folder} has no {' or '.join(missing)} (it has {have}): data=pretrained encodes with the "
                        f"model's own {src}-{tgt} dictionaries, as its tarball ships them; pass data.model_dir=<that "
                        "folder>, or data=databin data.path=<the data-bin the model was trained on>")
    dictionaries = tuple(folder / f"dict.{lang}.txt" if (folder / f"dict.{lang}.txt").is_file() else joint
                         for lang in (src, tgt))
    codes = next((folder / n for n in CODES_FILES if (folder / n).is_file()), None)
    shared_spm = next((folder / n for n in SENTENCEPIECE_FILES if (folder / n).is_file()), None)
    spm = tuple(next((folder / n.format(lang=lang) for n in SIDE_SENTENCEPIECE if (folder / n.format(lang=lang)).is_file()),
                     shared_spm) for lang in (src, tgt))
    spm = spm if all(spm) else None
    bpe = data.bpe
    if bpe not in BPE_KINDS:
        raise UserError(f"data.bpe must be one of {', '.join(BPE_KINDS)}, not '{bpe}'")
    if bpe == "auto":
        if codes is None and spm is None:
            raise UserError(f"{folder} has no subword codes ({', '.join(CODES_FILES)}) and no sentencepiece model "
                            f"({', '.join(SENTENCEPIECE_FILES)}); copy the model's codes there, or set data.bpe=none "
                            "for a model trained on whole words")
        bpe = "sentencepiece" if codes is None else "fastbpe" if _is_fastbpe(codes) else "subword_nmt"
    paths = (None, None) if bpe == "none" else spm if bpe == "sentencepiece" else (codes, codes)
    if paths is None or (bpe != "none" and paths[0] is None):
        raise UserError(f"data.bpe={bpe} but {folder} has no {'sentencepiece model' if bpe == 'sentencepiece' else 'codes'} "
                        "file; set data.bpe=auto")
    return ModelFiles(folder, dictionaries, bpe, paths)


def bind(data: DictConfig, checkpoint: Optional[Path] = None,
         languages: tuple[Optional[str], Optional[str]] = (None, None)) -> DictConfig:
    """The data config completed for one model: its folder (the checkpoint's, unless data.model_dir), its
    languages (as the checkpoint records them, unless given), the folder's hprune.yaml for settings left
    null or auto, and the tokenizer and BPE removal that go with the model's codes."""
    data = data.copy()
    with open_dict(data):
        folder = data.model_dir or (folder_of(checkpoint) if checkpoint is not None else None)
        if folder is None:
            raise UserError("data=pretrained needs the model's folder: data.model_dir=<folder with dict.*.txt and "
                            "its codes>, or a verb with ckpt=<that folder>/model.pt")
        data.model_dir = str(Path(folder).expanduser().absolute())
        data.src_lang = data.src_lang or languages[0]
        data.tgt_lang = data.tgt_lang or languages[1]
        settings = read_settings(Path(data.model_dir))
        tokens = settings.pop(LANGUAGES, None)
        if not (data.src_lang and data.tgt_lang):
            raise UserError(multilingual_needs_languages(data.model_dir, tokens) if tokens else
                            "data=pretrained without a checkpoint needs the languages: data.src_lang=.. data.tgt_lang=..")
        for key, value in settings.items():
            current = data.get(key)
            if current == "auto" or (current is None and key.endswith("_sets")):
                data[key] = value
        for key, lang in (("source_prefix", data.src_lang), ("target_prefix", data.tgt_lang)):
            if data.get(key, "auto") == "auto":
                data[key] = language_token(tokens, lang, data.model_dir) if tokens else None
        data.bpe = model_files(data).bpe
        if data.get("tokenizer") == "auto":  # the recipes: Moses before BPE codes, normalised text into sentencepiece
            data.tokenizer = None if data.bpe == "sentencepiece" else "moses"
        if data.get("post_process") in (None, "auto"):
            data.post_process = POST_PROCESS[data.bpe]
    return data


def beside_checkpoint(data: DictConfig, folder: Path) -> None:
    """Make `folder`, where a checkpoint derived from this model is written (a physically pruned one), a folder of
    the model: its dictionaries and codes copied, and hprune.yaml with the data settings of the run (the sets, your
    files by absolute path, tokenizer, bpe; the languages of a multilingual model) and where it came from
    (`source.model_dir`). A verb given that checkpoint then reads it with data=pretrained, as the run did, without
    data= (hprune_cli adds it for a folder with hprune.yaml)."""
    files, original = model_files(data), Path(data.model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if folder.resolve() == original.resolve():
        return
    for path in sorted({*files.dictionaries, *(p for p in files.codes if p is not None)}):
        shutil.copyfile(path, folder / path.name)
    settings = read_settings(original)
    source = settings.get("source") if isinstance(settings.get("source"), dict) else {}
    settings["source"] = {**source, "model_dir": str(original)}
    for key in ("test_sets", "valid_sets", "train_sets"):
        entries = [entry if isinstance(entry, str) else {side: str(Path(entry[side]).expanduser().absolute())
                                                         for side in ("src", "tgt")} for entry in _entries(data, key)]
        settings.pop(key, None)
        settings.update({key: entries} if entries else {})
    settings.update(tokenizer=data.tokenizer, bpe=data.bpe)
    if LANGUAGES not in settings:  # a prefix given by hand (a multilingual model's follow from the languages)
        settings.update({key: token for key, token in zip(("source_prefix", "target_prefix"), prefixes(data)) if token})
    write_settings(folder, settings)


def language_token(tokens: dict, lang: str, folder) -> str:
    """The token that marks `lang` in a multilingual model, or one line with the closest codes it has."""
    if lang in tokens:
        return tokens[lang]
    import difflib
    close = difflib.get_close_matches(lang, list(tokens), n=5, cutoff=0.3) or list(tokens)[:5]
    raise UserError(f"the model in {folder} has no language '{lang}'; the closest of its {len(tokens)} codes: "
                    f"{', '.join(close)} (all in {Path(folder) / SETTINGS_FILE})")


def _entries(data: DictConfig, key: str) -> list:
    value = data.get(key)
    return [] if value is None else list(OmegaConf.to_container(value, resolve=True))


def splits(data: DictConfig) -> dict[str, list]:
    """{split: [sets]}: train and valid concatenate their sets; each test set is a split (test, test1, ...)."""
    out = {name: _entries(data, f"{name}_sets") for name in ("train", "valid")}
    out = {name: entries for name, entries in out.items() if entries}
    for i, entry in enumerate(_entries(data, "test_sets")):
        out["test" if i == 0 else f"test{i}"] = [entry]
    return out


def _describe(entry) -> str:
    return entry if isinstance(entry, str) else f"{entry.get('src')} | {entry.get('tgt')}"


def check(data: DictConfig) -> None:
    """Everything that can be refused before any text is read."""
    model_files(data)
    if not _entries(data, "test_sets"):
        raise UserError(f"data=pretrained has no test sets: {Path(data.model_dir)} carries no test-set settings "
                        f"({SETTINGS_FILE}); set data.test_sets=[wmt14/full] (sacreBLEU names) or "
                        "'data.test_sets=[{src:FILE,tgt:FILE}]' (your own raw text)")
    if data.tokenizer not in TOKENIZERS:
        raise UserError(f"data.tokenizer must be moses, null (punctuation normalisation only) or none (the text as it "
                        f"is), not '{data.tokenizer}'")
    for split, entries in splits(data).items():
        for entry in entries:
            if isinstance(entry, str):
                testsets.check_test_sets([entry], data.src_lang, data.tgt_lang)
            elif not isinstance(entry, dict) or set(entry) != {"src", "tgt"}:
                raise UserError(f"data.{split.rstrip('0123456789')}_sets: {entry!r} is neither a sacreBLEU name nor "
                                "{src: FILE, tgt: FILE}")
            else:
                for side in ("src", "tgt"):
                    if not Path(entry[side]).expanduser().is_file():
                        raise UserError(f"data.{split.rstrip('0123456789')}_sets: {entry[side]} does not exist")
                if Path(entry["src"]).expanduser().samefile(Path(entry["tgt"]).expanduser()):
                    raise UserError(f"data.{split.rstrip('0123456789')}_sets: {entry['src']} is given as both the "
                                    f"{data.src_lang} and the {data.tgt_lang} side ({entry['tgt']}); give each "
                                    "language's own file")


def _digest(path: Path) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def config_key(data: DictConfig) -> str:
    """The data set's identity: the settings, the model's files (by content) and your files (by content)."""
    files = model_files(data)
    own = {_describe(e): [_digest(Path(e["src"]).expanduser()), _digest(Path(e["tgt"]).expanduser())]
           for entries in splits(data).values() for e in entries if not isinstance(e, str)}
    key = {"splits": splits(data), "langs": [data.src_lang, data.tgt_lang], "tokenizer": data.tokenizer,
           "bpe": files.bpe, "dicts": [_digest(p) for p in files.dictionaries],
           "codes": [_digest(p) if p else None for p in files.codes], "own": own, "format": FORMAT_VERSION,
           "checks": [data.max_unk_pct, data.max_pieces_per_word],
           **({"prefixes": prefixes(data)} if any(prefixes(data)) else {})}
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _read(entry, src: str, tgt: str) -> tuple[list[str], list[str]]:
    if isinstance(entry, str):
        return testsets.load(entry, src, tgt)
    sources, targets = read_lines(Path(entry["src"])), read_lines(Path(entry["tgt"]))
    if len(sources) != len(targets):
        raise UserError(f"{entry['src']} has {len(sources)} lines but {entry['tgt']} has {len(targets)}; "
                        "pass line-aligned parallel files")
    return sources, targets


def _segmenter(files: ModelFiles, side: int, staging: Path):
    codes = files.codes[side]
    if files.bpe == "none":
        return lambda line: line
    if files.bpe == "fastbpe":  # fastBPE does not build on Python 3.11: subword-nmt applies the same merges
        return line_function("subword_nmt", str(fastbpe_codes_to_subword_nmt(codes, staging / "bpecodes.subword_nmt")))
    return line_function(files.bpe, str(codes))


def _tokenizer(data: DictConfig, lang: str):
    if data.tokenizer == "none":
        return lambda line: line.strip()
    return line_function(data.tokenizer or "normalize", lang)


def _vocabulary(dictionary: Path) -> set[str]:
    with open(dictionary, encoding="utf-8") as f:
        return {line.rstrip("\n").split(" ")[0] for line in f}  # `token count [#fairseq:overwrite]`


def check_fit(counts: dict, data: DictConfig, files: ModelFiles) -> None:
    """Codes that do not belong with the dictionaries (wmt19.en-ru was published with EN-DE's bpecodes,
    fairseq#2928) encode into pieces the dictionary lacks (<unk>) or into single characters: refuse before
    BLEU is silently wrecked."""
    for (split, lang), c in counts.items():
        unk_pct = 100 * c["unk"] / max(c["pieces"], 1)
        per_word = c["pieces"] / max(c["words"], 1)
        too_many_unk = data.max_unk_pct is not None and unk_pct > float(data.max_unk_pct)
        too_split = data.max_pieces_per_word is not None and per_word > float(data.max_pieces_per_word)
        if too_many_unk or too_split:
            raise UserError(
                f"the model's codes do not fit its dictionary: the {split} {lang} text encodes to {unk_pct:.1f}% "
                f"<unk> and {per_word:.2f} pieces a word with {files.describe()} and "
                f"dict.{lang}.txt in {files.folder} (limits: data.max_unk_pct={data.max_unk_pct}, "
                f"data.max_pieces_per_word={data.max_pieces_per_word}); use the codes the model was trained with "
                "(the wmt19.en-ru ensemble shipped EN-DE's: use wmt19.en-ru.single_model's)")


def build(data: DictConfig, staging: Path) -> dict:
    """Fill a data set folder: bin/ (the model's dictionaries) and raw/ (the pristine text BLEU uses)."""
    from .. import backend  # fairseq is needed only to binarize

    check(data)
    files = model_files(data)
    src, tgt = data.src_lang, data.tgt_lang
    text, raw = staging / "text", staging / "raw"
    text.mkdir()
    raw.mkdir()
    vocab = {lang: _vocabulary(d) for lang, d in zip((src, tgt), files.dictionaries)}
    tokenizers = [_tokenizer(data, lang) for lang in (src, tgt)]
    segmenters = [_segmenter(files, 0, staging)]
    segmenters.append(segmenters[0] if files.codes[1] == files.codes[0] else _segmenter(files, 1, staging))
    counts, sentences, names = {}, {}, {}
    marks = [f"{token} " if token else "" for token in prefixes(data)]
    for side, token in enumerate(prefixes(data)):
        if token and token not in vocab[(src, tgt)[side]]:
            raise UserError(f"data.{('source', 'target')[side]}_prefix={token} is not in {files.dictionaries[side]}")
    for split, entries in splits(data).items():
        pairs = [_read(entry, src, tgt) for entry in entries]
        for side, lang in enumerate((src, tgt)):
            lines = [line for pair in pairs for line in pair[side]]
            words = [tokenizers[side](line) for line in lines]
            pieces = [segmenters[side](line) for line in words]
            tokens = [p for line in pieces for p in line.split()]
            counts[split, lang] = {"words": sum(len(w.split()) for w in words), "pieces": len(tokens),
                                   "unk": sum(t not in vocab[lang] for t in tokens)}
            (raw / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            (text / f"{split}.{lang}").write_text("".join(marks[side] + line + "\n" for line in pieces), encoding="utf-8")
        sentences[split] = sum(len(pair[0]) for pair in pairs)
        names[split] = ", ".join(_describe(e) for e in entries)
    check_fit(counts, data, files)
    tests = [s for s in splits(data) if s.startswith("test")]
    backend.binarize(text, staging / "bin", src, tgt, test_splits=tests,
                     splits=[s for s in ("train", "valid") if s in sentences], dictionaries=files.dictionaries)
    for path in text.iterdir():
        path.unlink()
    text.rmdir()
    summary = {"name": data.name, "pair": f"{src}-{tgt}", "model_dir": str(files.folder), "bpe": files.bpe,
               **({key: token for key, token in zip(("source_prefix", "target_prefix"), prefixes(data)) if token}),
               "codes": [str(p) if p else None for p in files.codes], "splits": sentences,
               "test_sets": {s: names[s] for s in tests}, "sets": names,
               "encoding": {f"{split}.{lang}": {**c, "unk_pct": round(100 * c["unk"] / max(c["pieces"], 1), 3)}
                            for (split, lang), c in counts.items()}}
    write_json(staging / "data.json", summary)
    return summary


def subword_files(data: DictConfig, folder: Path) -> list[Path]:
    """The model's codes, the source side's first (Marian: source.spm, target.spm); fastBPE's as the data set
    applied them, in subword-nmt's format (`folder`: the prepared data set)."""
    files = model_files(data)
    if files.bpe == "fastbpe":
        return [folder / "bpecodes.subword_nmt"]
    return list(dict.fromkeys(p for p in files.codes if p is not None))


register_kind(DataKind("pretrained", key=config_key, check=check, build=lambda data, root, staging: build(data, staging),
                        bind=bind, from_model=True, beside_checkpoint=beside_checkpoint, subwords=subword_files,
                        text_step=lambda data: None if data.tokenizer == "none" else data.tokenizer or "normalize"))
