"""A real corpus with manual word alignments, on any machine (data=greek_nt_en): the Greek New Testament (SBL
Greek New Testament, CC-BY-4.0) and its English translation (Berean Standard Bible, public domain), verse by verse,
with Clear Bible's manually corrected word alignments between them (CC-BY-4.0), as the PyPI wheel
bible-alignments (code MIT) ships them.

    the wheel: data.wheel.path, else <data_root>/downloads/<wheel file>, fetched with `pip download --no-deps`
        (the package declares django and jupyterlab, which hprune must not pull in); checked by its sha256
    verse pairs: the Greek words of a verse (SBLGNT.tsv: id n<BBCCCVVVWWW>, text) and the English tokens whose
        source_verse is that verse (nt_BSB.tsv, in file order); a verse missing either side is dropped and counted
    the model's text: the Greek words and the English tokens, space-joined (the alignments' words); BLEU on those
        tokens (the references are the verse's English tokens, the hypotheses as the model writes them: Moses'
        detokenizer does not attach the BSB's curly quotes, which capped a perfect model at BLEU 97.83); the text
        rebuilt with skip_space_after is kept beside them as raw/<split>.text
    held out: whole chapters, numbered from 0 in canonical order (Matthew 1 is 0): chapter k is a test chapter when
        k % test_every == test_every // 2, a valid chapter when k % valid_every == 0 (and not test), else train
    raw/<valid|test>.align: the manual alignments as Pharaoh `i-j` (the i-th Greek word, the j-th English token
        of the verse, from 0), read by `hprune analyze`; links between words of two verses, and links of a verse
        dropped for lacking a side, are dropped and counted (data.json: links_in_records = links + the dropped);
        raw/<split>.exclude: the English tokens the alignment leaves out (punctuation, `exclude`), unscored
"""
from __future__ import annotations

import csv
import io
import json
import logging
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

from omegaconf import DictConfig

from ..errors import UserError
from ..files import file_digest, write_json
from .kinds import DataKind, register_kind
from .stages import check_processing, key_with_file, run_stage, subword_files, write_lines
from .text import build_from_text

log = logging.getLogger(__name__)
csv.field_size_limit(1 << 24)


EXTRACT_VERSION = 3  # bump when the extraction's output changes for the same wheel and settings


def check(data: DictConfig) -> None:
    check_processing(data, (None,))  # the corpus's own tokens, scored as they are
    if (data.src_lang, data.tgt_lang) != ("grc", "en"):
        raise UserError(f"data=greek_nt_en translates Greek into English (grc -> en), not {data.src_lang} -> "
                        f"{data.tgt_lang}; leave data.src_lang and data.tgt_lang as they are")
    if int(data.held_out.test_every) < 2 or int(data.held_out.valid_every) < 2:
        raise UserError("data.held_out.test_every and valid_every must be 2 or more (every N-th chapter is held out)")
    if data.wheel.get("path") and not Path(data.wheel.path).expanduser().is_file():
        raise UserError(f"data.wheel.path={data.wheel.path} does not exist; give the {data.wheel.file} you "
                        "downloaded, or data.wheel.path=null to fetch it with pip")


def _fetch_hint(data: DictConfig, dest: Path) -> str:
    return (f"on a machine with internet run `pip download {data.wheel.requirement} --no-deps -d DIR` and put "
            f"{data.wheel.file} at {dest} (or pass data.wheel.path=FILE)")


def wheel(data: DictConfig, data_root: Path) -> Path:
    """The wheel: given, cached, or fetched with pip (its dependencies never)."""
    if data.wheel.get("path"):
        path = Path(data.wheel.path).expanduser().absolute()
    else:
        path = data_root / "downloads" / data.wheel.file
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            log.info("fetching %s with pip (no dependencies)", data.wheel.requirement)
            done = subprocess.run([sys.executable, "-m", "pip", "download", data.wheel.requirement, "--no-deps",
                                   "--only-binary", ":all:", "--disable-pip-version-check", "-q", "-d",
                                   str(path.parent)], capture_output=True, text=True)
            if done.returncode or not path.is_file():
                last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
                raise UserError(f"cannot fetch {data.wheel.requirement} ({last}); {_fetch_hint(data, path)}")
    if data.wheel.get("sha256") and file_digest(path, "sha256") != data.wheel.sha256:
        raise UserError(f"{path} is not {data.wheel.file} (its sha256 differs from data.wheel.sha256); "
                        f"delete it and run again, or {_fetch_hint(data, path)}")
    return path


def _tsv(archive: zipfile.ZipFile, member: str) -> list[dict]:
    try:
        with archive.open(member) as f:
            return list(csv.DictReader(io.TextIOWrapper(f, encoding="utf-8"), delimiter="\t",
                                       quoting=csv.QUOTE_NONE))
    except KeyError:
        raise UserError(f"{archive.filename} has no {member}; it is not the bible-alignments wheel this data set "
                        "reads (data.wheel)") from None


def verse_pairs(source_rows: list[dict], target_rows: list[dict]) -> "OrderedDict[str, dict]":
    """verse id (BBCCCVVV) -> its Greek word ids and words, its English token ids, tokens and rebuilt text; in
    canonical order, verses with both sides only."""
    greek: "OrderedDict[str, list]" = OrderedDict()
    for row in source_rows:
        greek.setdefault(row["id"][1:9], []).append((row["id"][1:], row["text"]))
    english: dict[str, list] = {}
    for row in target_rows:
        english.setdefault(row["source_verse"], []).append((row["id"], row["text"], row["skip_space_after"] == "y",
                                                            row["exclude"] == "y"))
    pairs = OrderedDict()
    for verse, words in greek.items():
        tokens = [t for t in english.get(verse, []) if t[1].strip()]
        words = [w for w in words if w[1].strip()]
        if words and tokens:
            pairs[verse] = {"source_ids": [w[0] for w in words], "source": [w[1] for w in words],
                            "target_ids": [t[0] for t in tokens], "target": [t[1] for t in tokens],
                            "unaligned": [j for j, t in enumerate(tokens) if t[3]],
                            "text": "".join(t[1] + ("" if t[2] else " ") for t in tokens).strip()}
    return pairs


def links(records: list[dict], pairs: dict) -> tuple[dict, dict]:
    """verse -> sure links (Greek word index, English token index); and how many of the records' links (every
    Greek word of a record with every English token of it) were dropped, by reason: they join two verses, a word of
    theirs is in a verse without its other side (or in no verse pair: a blank word), or they repeat a link."""
    where_source = {i: (verse, n) for verse, p in pairs.items() for n, i in enumerate(p["source_ids"])}
    where_target = {i: (verse, n) for verse, p in pairs.items() for n, i in enumerate(p["target_ids"])}
    out: dict[str, set] = {}
    dropped = {"across_verses": 0, "verse_without_a_side": 0, "repeated": 0}
    for record in records:
        for s in record["source"]:
            for t in record["target"]:
                (vs, i), (vt, j) = where_source.get(s.lstrip("n"), (None, None)), where_target.get(t, (None, None))
                if vs is None or vt is None:
                    dropped["verse_without_a_side"] += 1
                elif vs != vt:
                    dropped["across_verses"] += 1
                elif (i, j) in out.setdefault(vs, set()):
                    dropped["repeated"] += 1
                else:
                    out[vs].add((i, j))
    return out, dropped


def split_of(chapter: int, held_out: DictConfig) -> str:
    test_every, valid_every = int(held_out.test_every), int(held_out.valid_every)
    return "test" if chapter % test_every == test_every // 2 else "valid" if chapter % valid_every == 0 else "train"


def _read_wheel(data: DictConfig, path: Path) -> tuple:
    try:
        with zipfile.ZipFile(path) as archive:
            source_rows, target_rows = _tsv(archive, data.members.source), _tsv(archive, data.members.target)
            records = json.loads(archive.read(data.members.alignments))["records"]
            licences = [archive.read(name).decode("utf-8") for name in (data.members.licence, data.members.about)
                        if name in archive.namelist()]
    except (zipfile.BadZipFile, KeyError, ValueError) as err:
        raise UserError(f"{path} is not the bible-alignments wheel this data set reads ({type(err).__name__}: "
                        f"{err}); delete it and run again, or {_fetch_hint(data, path)}") from None
    return source_rows, target_rows, records, licences


def _extract(data: DictConfig, path: Path, out: Path) -> dict:
    src, tgt = data.src_lang, data.tgt_lang
    source_rows, target_rows, records, licences = _read_wheel(data, path)
    (out / "annotations").mkdir()
    pairs = verse_pairs(source_rows, target_rows)
    verse_links, dropped = links(records, pairs)
    chapters = list(OrderedDict.fromkeys(verse[:5] for verse in pairs))
    split = {verse: split_of(chapters.index(verse[:5]), data.held_out) for verse in pairs}
    held = {}
    for name in ("train", "valid", "test"):
        verses = [v for v in pairs if split[v] == name]
        held[name] = {"verses": len(verses), "chapters": sorted({v[:5] for v in verses})}
        write_lines(out / f"{name}.{src}", (" ".join(pairs[v]["source"]) for v in verses))
        write_lines(out / f"{name}.{tgt}", (" ".join(pairs[v]["target"]) for v in verses))
        if name != "train":
            if not verses:
                raise UserError(f"data.held_out leaves no {name} chapter (test_every={data.held_out.test_every}, "
                                f"valid_every={data.held_out.valid_every} of {len(chapters)} chapters); choose "
                                "smaller values")
            write_lines(out / "annotations" / f"{name}.text", (pairs[v]["text"] for v in verses))
            write_lines(out / "annotations" / f"{name}.exclude",
                        (" ".join(map(str, pairs[v]["unaligned"])) for v in verses))
            write_lines(out / "annotations" / f"{name}.align",
                        (" ".join(f"{i}-{j}" for i, j in sorted(verse_links.get(v, ()))) for v in verses))
            write_lines(out / "annotations" / f"{name}.verses", verses)
    (out / "annotations" / "LICENSES.md").write_text("\n\n".join(licences), encoding="utf-8")
    greek_verses = {row["id"][1:9] for row in source_rows}
    english_verses = {row["source_verse"] for row in target_rows}
    return {"verse_pairs": len(pairs), "verses_without_a_side": len(greek_verses ^ english_verses)
            + len((greek_verses & english_verses) - set(pairs)),
            "links_in_records": sum(len(r["source"]) * len(r["target"]) for r in records),
            "links": sum(len(v) for v in verse_links.values()), "links_across_verses_dropped": dropped["across_verses"],
            "links_of_verses_without_a_side_dropped": dropped["verse_without_a_side"],
            "links_repeated_dropped": dropped["repeated"],
            "held_out": {name: {"verses": h["verses"], "chapters": len(h["chapters"]),
                                "first_chapters": h["chapters"][:3]} for name, h in held.items()}}


def build(data: DictConfig, data_root: Path, staging: Path) -> dict:
    path = wheel(data, data_root)
    stages = data_root / "stages" / data.name
    extracted = run_stage(stages, "extract", {
        "wheel": file_digest(path, "sha256"), "langs": [data.src_lang, data.tgt_lang], "version": EXTRACT_VERSION,
        "members": dict(data.members), "held_out": dict(data.held_out)}, lambda out: _extract(data, path, out))
    info = json.loads((extracted / "DONE").read_text())
    summary = {**build_from_text(data, stages, extracted, staging, tokenize=False, clean=False),
               "wheel": {"path": str(path), "sha256": file_digest(path, "sha256")},
               **{k: info[k] for k in ("verse_pairs", "verses_without_a_side", "links_in_records", "links",
                                       "links_across_verses_dropped", "links_of_verses_without_a_side_dropped",
                                       "links_repeated_dropped", "held_out")}}
    (staging / "LICENSES.md").write_bytes((staging / "raw" / "LICENSES.md").read_bytes())
    write_json(staging / "data.json", summary)
    return summary


register_kind(DataKind("bible_alignments", key=lambda data: key_with_file(data, "wheel", data.wheel.get("path")),
                       check=check, build=build, subwords=subword_files))
