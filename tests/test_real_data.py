"""Real language in: your own parallel text (data=text), IWSLT14 as fairseq's prepare-iwslt14.sh builds it (a
small archive in the real layout, from the local server), and the Greek NT -> English corpus with its manual word
alignments (a small wheel in the real layout of bible-alignments, built here)."""
from __future__ import annotations

import json
import socket
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import hprune
from hprune.analysis.alignment import corpus_aer, read_pharaoh, read_unscored
from hprune.data import bible_alignments
from hprune.data.prepare import prepare
from hprune.data.processing import line_function
from hprune.errors import UserError
from wmt_fixtures import FixtureServer, corpus, tgz

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "data"
PAIRS = corpus(600, seed=11)  # (en, de)


def data_config(name: str, **overrides):
    cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    for split, rows in (("train", PAIRS[:560]), ("test", PAIRS[560:])):
        write(folder / f"{split}.en", (s for s, _ in rows))
        write(folder / f"{split}.de", (t for _, t in rows))
    write(folder / "train.tsv", (f"{s}\t{t}" for s, t in PAIRS[:560]))
    return folder


def text_config(corpus_dir: Path, **overrides):
    settings = {"src_lang": "en", "tgt_lang": "de", "train": str(corpus_dir / "train"),
                "test": str(corpus_dir / "test"), "bpe_size": 120, "workers": 1, "valid_every": 50}
    return data_config("text", **{**settings, **overrides})


def test_own_text_is_prepared_like_wmt_and_scored_against_the_file_as_given(tmp_path, corpus_dir):
    data_bin = prepare(text_config(corpus_dir), tmp_path)
    root = data_bin.parent
    summary = json.loads((root / "data.json").read_text())
    assert summary["splits"]["valid"] == 11 and summary["splits"]["test"] == 40  # every 50th of 560; test as given
    assert summary["splits"]["train"] <= 549 and summary["skipped_bad_lines"] == {}
    assert (root / "raw" / "test.de").read_text(encoding="utf-8").splitlines() == [t for _, t in PAIRS[560:]]
    assert (root / "bpecodes").is_file() and (data_bin / "dict.en.txt").read_text() == (data_bin / "dict.de.txt").read_text()
    for split in ("train", "valid", "test"):
        assert (data_bin / f"{split}.en-de.de.bin").stat().st_size > 0
    # the same pairs as one tab-separated file, or two files named: the same data set
    tsv = prepare(text_config(corpus_dir, train=str(corpus_dir / "train.tsv")), tmp_path / "tsv")
    named = prepare(text_config(corpus_dir, train={"src": str(corpus_dir / "train.en"),
                                                   "tgt": str(corpus_dir / "train.de")}), tmp_path / "named")
    for other in (tsv, named):
        assert (other / "train.en-de.en.bin").read_bytes() == (data_bin / "train.en-de.en.bin").read_bytes()
    # the same files again: the same data set; lowercased, with lowercased references
    assert prepare(text_config(corpus_dir), tmp_path) == data_bin
    lowered = prepare(text_config(corpus_dir, lowercase=True), tmp_path).parent
    assert (lowered / "raw" / "test.de").read_text(encoding="utf-8").splitlines() == [t.lower() for _, t in PAIRS[560:]]


def test_own_text_bad_input_is_one_line_each(tmp_path, corpus_dir):
    def refused(**overrides) -> str:
        with pytest.raises(UserError) as err:
            prepare(text_config(corpus_dir, **overrides), tmp_path)
        return str(err.value)

    message = refused(train=str(tmp_path / "nowhere"))
    assert message.startswith("data.train: ") and "nowhere.en" in message
    write(tmp_path / "short.en", ["a", "b", "c"])
    write(tmp_path / "short.de", ["a", "b"])
    message = refused(train=str(tmp_path / "short"))
    assert "short.en has 3 lines and" in message and "short.de 2" in message
    (tmp_path / "test_only.en").write_text("x\n")
    message = refused(test=str(tmp_path / "test_only"))
    assert "the references" in message and "test_only.de" in message
    rows = PAIRS[:200]
    write(tmp_path / "gaps.en", [s if i != 6 else "  " for i, (s, _) in enumerate(rows)])
    write(tmp_path / "gaps.de", [t for _, t in rows])
    with open(tmp_path / "gaps.de", "ab") as f:  # one more pair whose target is not UTF-8
        f.write(b"caf\xe9\n")
    with open(tmp_path / "gaps.en", "a", encoding="utf-8") as f:
        f.write("cafe\n")
    message = refused(train=str(tmp_path / "gaps"))
    assert "gaps.en line 7 is empty" in message and "data.on_bad_lines=skip" in message
    assert not any(p.name.startswith("text-") for p in tmp_path.iterdir())  # nothing half-written
    data_bin = prepare(text_config(corpus_dir, train=str(tmp_path / "gaps"), on_bad_lines="skip", valid_every=20),
                       tmp_path)
    summary = json.loads((data_bin.parent / "data.json").read_text())
    assert summary["skipped_bad_lines"] == {"train": 2}  # the empty line and the non-UTF-8 one
    assert "the valid split holds 4 sentence pairs" in refused(valid_every=120)  # 560 // 120: fairseq needs 8
    proc = hprune("data", "prepare", "data=text", "data.src_lang=en", "data.tgt_lang=de",
                  f"data.train={tmp_path / 'short'}", f"data.test={corpus_dir / 'test'}", f"paths.data_root={tmp_path}",
                  check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "short.en has 3 lines" in proc.stderr.strip().splitlines()[-1]


def test_own_text_with_byte_order_marks_and_crlf_is_the_text_without_them(tmp_path):
    """Files as Windows editors write them (a byte-order mark first, CRLF line ends) are the same data set as the
    plain files: the mark is in no reference (perfect hypotheses scored 99.74 BLEU on these 40 sentences) and in no
    dictionary (tokenizer=none made it an entry, `\\ufeff@@`)."""
    import sacrebleu

    from hprune.data.processing import read_lines
    rows = PAIRS[:300]
    for folder, head, end in (("plain", b"", "\n"), ("windows", b"\xef\xbb\xbf", "\r\n")):
        (tmp_path / folder).mkdir()
        for split, part in (("train", rows[:260]), ("test", rows[260:])):
            for k, lang in enumerate(("en", "de")):
                (tmp_path / folder / f"{split}.{lang}").write_bytes(head + "".join(row[k] + end for row in part).encode())
    built = {folder: prepare(text_config(tmp_path / folder, tokenizer="none", valid_every=20), tmp_path / "root")
             for folder in ("plain", "windows")}
    assert built["plain"] != built["windows"]  # two data sets (the files differ) ...
    for name in ("dict.en.txt", "dict.de.txt", "train.en-de.en.bin", "test.en-de.de.bin", "valid.en-de.de.bin"):
        assert (built["windows"] / name).read_bytes() == (built["plain"] / name).read_bytes(), name  # ... the same
    references = (built["windows"].parent / "raw" / "test.de").read_text(encoding="utf-8").splitlines()
    assert references == [t for _, t in rows[260:]]
    assert sacrebleu.corpus_bleu([t for _, t in rows[260:]], [references]).score == pytest.approx(100)  # was 99.74
    # data=pretrained and data=databin read your files the same way: split at \n only (wc -l), mark and \r dropped
    (tmp_path / "mixed.txt").write_bytes(b"\xef\xbb\xbfone\r\ntwo\xe2\x80\xa8halves\n\xef\xbb\xbfthree\n")
    assert read_lines(tmp_path / "mixed.txt") == ["one", "two\u2028halves", "three"]


def test_one_file_as_both_sides_is_refused_before_any_work(tmp_path, corpus_dir):
    same = str(corpus_dir / "train.en")
    with pytest.raises(UserError, match=r"train\.en is given as both the en and the de side"):
        prepare(text_config(corpus_dir, train={"src": same, "tgt": same}), tmp_path)
    (tmp_path / "linked.en").symlink_to(corpus_dir / "test.en")  # a prefix whose two files are one
    (tmp_path / "linked.de").symlink_to(corpus_dir / "test.en")
    with pytest.raises(UserError, match="is given as both the en and the de side"):
        prepare(text_config(corpus_dir, test=str(tmp_path / "linked")), tmp_path)
    proc = hprune("data", "prepare", "data=text", "data.src_lang=en", "data.tgt_lang=de",
                  f"data.train={{src:{same},tgt:{same}}}", f"data.test={corpus_dir / 'test'}",
                  f"paths.data_root={tmp_path / 'cli'}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "given as both the en and the de side" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "cli").exists() or not any((tmp_path / "cli").iterdir())  # nothing written


def perl_clean_word_length(side: str, limit: int = 1000) -> bool:
    """clean-corpus-n.perl's word-length rule as the script states it (a corpus whose first line has no `|`):
    `s/\\|//g`, then drop the pair if `/[^\\s\\|]{limit + 1}/` matches."""
    import re
    return re.search(r"[^\s|]{%d}" % (limit + 1), side.replace("|", "")) is None


@pytest.mark.parametrize("word", ["x" * 1000, "x" * 1001, "x" * 500 + "|" + "x" * 500, "x" * 501 + "|" + "x" * 500,
                                  "é" * 1001, "a-" * 500, "a-" * 501])
def test_clean_corpus_n_drops_a_pair_with_a_word_over_1000_characters(word):
    from hprune.data.processing import keep_pair
    for src, tgt in ((f"a {word} b", "c d e"), ("c d e", f"a {word} b")):
        assert keep_pair(src, tgt, 1, 250, 1.5) == (perl_clean_word_length(src) and perl_clean_word_length(tgt))


def test_own_text_drops_a_training_pair_with_a_word_the_recipe_drops(tmp_path):
    """A 100,000-character word on both sides of one training pair: BPE learns pieces of it up to 8,192
    characters, which clean-corpus-n's word-length limit drops with the pair; before, one became a dictionary entry."""
    rows = list(PAIRS[:260])
    long = "x" * 100_000
    rows[3] = (f"{rows[3][0]} {long}", f"{rows[3][1]} {long}")
    for k, lang in enumerate(("en", "de")):
        write(tmp_path / f"train.{lang}", (row[k] for row in rows))
    data_bin = prepare(text_config(tmp_path, train=str(tmp_path / "train"), test=str(tmp_path / "train"),
                                   tokenizer="none", valid_every=20), tmp_path / "root")
    summary = json.loads((data_bin.parent / "data.json").read_text())
    assert summary["splits"]["valid"] == 13 and summary["splits"]["train"] == 260 - 13 - 1
    assert max(len(line.split(" ")[0]) for line in (data_bin / "dict.en.txt").read_text().splitlines()) < 1000


# ----------------------------------------------------------------------------------------------- IWSLT14
def iwslt_archive() -> bytes:
    """de-en.tgz in its real layout: the training files with their TED tags, the five dev/test sets as XML."""
    de_en = [(t, s) for s, t in corpus(300, seed=12)]
    tags = ["<url>http://www.ted.com/talks/x.html</url>", "<keywords>talks, x</keywords>", "<talkid>1</talkid>"]
    train = {lang: tags + [f"<title>Talk {i}</title>" if i == 0 else pair[k] for i, pair in enumerate(de_en)]
             for k, lang in enumerate(("de", "en"))}
    train["de"][5] = "Ein sehr langer Satz mit vielen Wörtern , der nicht passt ."  # ratio > 1.5 after tokenizing
    train["en"][5] = "Short ."
    for lang in ("de", "en"):  # a word of 1,001 characters: clean-corpus-n.perl drops the pair
        train[lang][7] += " " + "x" * 1001
    members = {f"de-en/train.tags.de-en.{lang}": ("\n".join(lines) + "\n").encode() for lang, lines in train.items()}
    for n, name in enumerate(iwslt14_test_sets()):
        pairs = [(t, s) for s, t in corpus(4, seed=20 + n)]
        for k, lang in enumerate(("de", "en")):
            segs = "".join(f'<seg id="{i}"> {pair[k].replace(chr(39), chr(8217))} </seg>\n'
                           for i, pair in enumerate(pairs, 1))
            members[f"de-en/{name}.de-en.{lang}.xml"] = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n<srcset setid="{name}" srclang="{lang}">\n'
                f'<doc docid="1" genre="lectures">\n<talkid>1</talkid>\n{segs}</doc>\n</srcset>\n</mteval>\n').encode()
    return tgz(members)


def iwslt14_test_sets() -> list[str]:
    return list(OmegaConf.load(CONFIGS / "iwslt14_de_en.yaml").test_sets)


def test_iwslt14_is_prepared_as_the_recipe_from_its_archive(tmp_path):
    archive = iwslt_archive()
    with FixtureServer({"de-en.tgz": archive}) as server:
        cfg = data_config("iwslt14_de_en", **{"archive.url": f"{server.url}/de-en.tgz", "bpe_size": 200,
                                              "workers": 1})
        data_bin = prepare(cfg, tmp_path)
    root = data_bin.parent
    summary = json.loads((root / "data.json").read_text())
    extracted = Path(summary["stages"]["text"])
    info = json.loads((extracted / "DONE").read_text())
    assert info["read_pairs"] == 300 and info["cleaned_pairs"] == 298  # the title is a pair; the long one goes, and
    assert info["valid_pairs"] == 298 // 23 and info["train_pairs"] == 298 - 298 // 23  # the one with a long word
    assert info["test_pairs"] == 20  # five sets of 4
    tokenize = line_function("moses_plain", "en")  # tokenizer.perl -l en: no -a, apostrophes escaped
    expected = [tokenize(en).lower() for n in range(5) for en, _ in corpus(4, seed=20 + n)]  # ’ back to '
    assert (root / "raw" / "test.en").read_text(encoding="utf-8").splitlines() == expected
    assert (data_bin / "dict.de.txt").read_text() != (data_bin / "dict.en.txt").read_text()  # one dictionary a language
    assert summary["archive"]["sha256"] and OmegaConf.load(CONFIGS / "iwslt14_de_en.yaml").archive.sha256 is None
    # the same archive given as a file: nothing downloaded, the same extraction
    given = tmp_path / "mine.tgz"
    given.write_bytes(archive)
    cfg = data_config("iwslt14_de_en", **{"archive.path": str(given), "bpe_size": 200, "workers": 1})
    other = prepare(cfg, tmp_path / "given")
    assert (other / "test.de-en.en.bin").read_bytes() == (data_bin / "test.de-en.en.bin").read_bytes()
    given.write_bytes(tgz({"de-en/README": b"x"}))
    with pytest.raises(UserError, match="is not IWSLT14's de-en.tgz"):
        prepare(data_config("iwslt14_de_en", **{"archive.path": str(given)}), tmp_path / "bad")


# ------------------------------------------------------------------------------------ the Greek NT corpus
GREEK = {  # verse -> Greek words; three chapters of a book, in canonical order (chapters 0, 1 and 2 of the NT)
    "40001001": ["Βίβλος", "γενέσεως", "Ἰησοῦ"], "40001002": ["Ἀβραὰμ", "ἐγέννησεν", "τὸν", "Ἰσαάκ"],
    "40002001": ["Τοῦ", "δὲ", "Ἰησοῦ"], "40002002": ["λέγοντες"],
    **{f"4000300{v}": ["ἐν", "δὲ", "ταῖς", "ἡμέραις"] for v in (1, 2, 3)},
    **{f"4000100{v}": ["καὶ", "ἐγέννησεν"] for v in range(3, 10)},  # valid needs 8 pairs (fairseq's batch multiple)
    "40003004": ["μόνον"],  # a verse without its English side (versifications differ)
}
ENGLISH = {  # source_verse -> (token, skip_space_after)
    "40001001": [("This", ""), ("is", ""), ("the", ""), ("record", ""), ("of", ""), ("Jesus", "y"), (".", "")],
    "40001002": [("Abraham", ""), ("was", ""), ("the", ""), ("father", ""), ("of", ""), ("Isaac", "y"), (",", "")],
    "40002001": [("After", ""), ("Jesus", "y"), (",", "")],
    "40002002": [("“", "y"), ("Where", ""), ("is", "y"), ("?", "y"), ("”", "")],
    **{f"4000300{v}": [("In", ""), ("those", ""), ("days", "")] for v in (1, 2, 3)},
    **{f"4000100{v}": [("and", ""), ("fathered", "")] for v in range(3, 10)},
}
PUNCTUATION = {",", ".", "?", "“", "”"}  # the BSB marks them `exclude`: no alignment links them


def small_wheel(path: Path) -> Path:
    source = ["id\taltId\ttext\tstrongs\tgloss\tgloss2\tlemma\tpos\tmorph"] + [
        f"n{verse}{i + 1:03d}\t{w}-1\t{w}\tG0000\tx\tx\t{w}\tnoun\tN" for verse, words in sorted(GREEK.items())
        for i, w in enumerate(words)]
    target = ["id\tsource_verse\ttext\tskip_space_after\texclude\tid_range_end\tsource_verse_range_end"] + [
        f"{verse}{i + 1:03d}\t{verse}\t{token}\t{skip}\t{'y' if token in PUNCTUATION else ''}\t\t"
        for verse, tokens in sorted(ENGLISH.items())
        for i, (token, skip) in enumerate(tokens)]
    records = [([("40001001", 1)], [("40001001", 4), ("40001001", 5)]),   # γενέσεως - record of
               ([("40001001", 3)], [("40001001", 6)]),                    # Ἰησοῦ - Jesus
               ([("40001002", 1), ("40001002", 2)], [("40001002", 1)]),   # Ἀβραὰμ ἐγέννησεν - Abraham
               ([("40002001", 3)], [("40002001", 2)]),                    # Ἰησοῦ - Jesus
               ([("40002002", 1)], [("40002001", 3), ("40002002", 2)]),   # one link crosses a verse: dropped
               ([("40003004", 1)], [("40003003", 1)]),                    # into the verse without a side: dropped
               ([("40001001", 3)], [("40001001", 6)])]                    # a link again: counted once
    burrito = {"records": [{"source": [f"n{v}{i:03d}" for v, i in s], "target": [f"{v}{i:03d}" for v, i in t],
                            "meta": {"process": "manual"}} for s, t in records]}
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("data/sources/SBLGNT.tsv", "\n".join(source) + "\n")
        wheel.writestr("data/eng/targets/BSB/nt_BSB.tsv", "\n".join(target) + "\n")
        wheel.writestr("data/eng/alignments/BSB/SBLGNT-BSB-manual.json", json.dumps(burrito))
        wheel.writestr("data/eng/alignments/BSB/SBLGNT-BSB-manual.toml", 'license = "CC-BY-4.0"\n')
        wheel.writestr("LICENSE.md", "MIT and CC BY 4.0\n")
    return path


def test_greek_nt_verse_pairs_chapters_held_out_and_manual_alignments_as_pharaoh(tmp_path):
    wheel = small_wheel(tmp_path / "bible_alignments-0.4.2-py3-none-any.whl")
    cfg = data_config("greek_nt_en", **{"wheel.path": str(wheel), "wheel.sha256": None, "bpe_size": 30,
                                        "held_out.test_every": 2, "held_out.valid_every": 4, "workers": 1})
    data_bin = prepare(cfg, tmp_path)
    root = data_bin.parent
    summary = json.loads((root / "data.json").read_text())
    # chapter 0 (Matthew 1) is valid (0 % 4 == 0), chapter 1 (Matthew 2) test (1 % 2 == 1), chapter 2 train
    held = summary["held_out"]
    assert [held[s]["verses"] for s in ("train", "valid", "test")] == [3, 9, 2]
    assert summary["links_across_verses_dropped"] == 1 and summary["links"] == 2 + 1 + 2 + 1 + 1
    assert summary["verses_without_a_side"] == 1 and summary["links_of_verses_without_a_side_dropped"] == 1
    assert summary["links_repeated_dropped"] == 1 and summary["links_in_records"] == 2 + 1 + 2 + 1 + 2 + 1 + 1
    assert summary["links_in_records"] == sum(summary[key] for key in (  # every link of the records accounted for
        "links", "links_across_verses_dropped", "links_of_verses_without_a_side_dropped", "links_repeated_dropped"))
    raw = root / "raw"
    assert (raw / "test.en").read_text(encoding="utf-8").splitlines() == ["After Jesus ,", "“ Where is ? ”"]
    assert (raw / "test.text").read_text(encoding="utf-8").splitlines() == ["After Jesus,", "“Where is?”"]
    assert (raw / "test.exclude").read_text().splitlines() == ["2", "0 3 4"]  # punctuation: unscored
    # a head's link to an unscored word counts neither way: AER 0 here, 1/3 if it were scored
    reference = read_unscored(raw / "test.exclude", read_pharaoh(raw / "test.align"))
    assert corpus_aer([{(2, 1), (0, 2)}, {(0, 1)}], reference) == 0.0
    assert corpus_aer([{(2, 1), (0, 2)}, {(0, 1)}], [r[:2] for r in reference]) == pytest.approx(1 - 4 / 5)
    assert (raw / "valid.grc").read_text(encoding="utf-8").splitlines()[0] == "Βίβλος γενέσεως Ἰησοῦ"
    assert (raw / "valid.align").read_text().splitlines() == ["0-3 0-4 2-5", "0-0 1-0"] + [""] * 7
    assert (raw / "test.align").read_text().splitlines() == ["2-1", "0-1"]
    assert "CC-BY-4.0" in (root / "LICENSES.md").read_text()


def test_greek_nt_without_the_wheel_offline_says_what_to_fetch(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    with pytest.raises(UserError) as err:
        bible_alignments.wheel(data_config("greek_nt_en"), tmp_path)
    message = str(err.value)
    assert "pip download bible-alignments==0.4.2 --no-deps" in message
    assert str(tmp_path / "downloads" / "bible_alignments-0.4.2-py3-none-any.whl") in message
    assert not list((tmp_path / "downloads").glob("*.whl"))
