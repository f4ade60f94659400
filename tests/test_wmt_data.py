"""The WMT pipeline against real components: a local HTTP server serving archives with the real layouts, a
pre-seeded sacreBLEU cache, sacremoses, subword-nmt and fairseq-preprocess."""
from __future__ import annotations

import errno
import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import hprune
from hprune.data import download, processing, wmt
from hprune.data.corpora import BadLines, read_pairs
from hprune.errors import UserError
from wmt_fixtures import TEST_PAIRS, FixtureServer, gz, seed_sacrebleu, sha256, source_overrides, tgz, wmt14_en_de_archives

ARCHIVES = wmt14_en_de_archives()
SMALL = ["data=wmt14_en_de", "data.bpe_size=100", "data.workers=2", "data.download_retries=1"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------- download
def test_download_resumes_after_a_cut_connection(tmp_path):
    blob = os.urandom(300_000)
    with FixtureServer({"big.tgz": blob}) as server:
        server.cut_once.add("big.tgz")
        dest = download.fetch(download.Remote(f"{server.url}/big.tgz", sha256=sha256(blob), size=len(blob)),
                              tmp_path / "big.tgz", backoff_s=0)
    assert dest.read_bytes() == blob
    first, second = server.requests
    assert first == ("big.tgz", None)
    assert second[1] == f"bytes={len(blob) // 2}-"  # resumed where the cut left it, not from zero
    assert not (tmp_path / "big.tgz.part").exists()


def test_checksum_mismatch_is_downloaded_once_more_then_fails(tmp_path):
    with FixtureServer({"a.tgz": b"abc"}) as server:
        with pytest.raises(UserError, match="downloaded twice with the wrong sha256"):
            download.fetch(download.Remote(f"{server.url}/a.tgz", sha256="0" * 64), tmp_path / "a.tgz", backoff_s=0)
    assert server.requests == [("a.tgz", None), ("a.tgz", None)]
    assert [p.name for p in tmp_path.iterdir()] == [".locks"]  # nothing under the final name, no partial file


def test_a_cached_file_that_changed_is_downloaded_again(tmp_path):
    dest = tmp_path / "a.tgz"
    remote = download.Remote(None, sha256=sha256(b"right"))
    dest.write_bytes(b"wrong")
    with FixtureServer({"a.tgz": b"right"}) as server:
        download.fetch(download.Remote(f"{server.url}/a.tgz", sha256=remote.sha256), dest, backoff_s=0)
        assert dest.read_bytes() == b"right" and len(server.requests) == 1
        download.fetch(download.Remote(f"{server.url}/a.tgz", sha256=remote.sha256), dest, backoff_s=0)
        assert len(server.requests) == 1  # verified once, then trusted by its stamp


def test_no_network_names_the_url_and_where_to_put_the_file(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/training-parallel-nc-v9.tgz"
    with pytest.raises(UserError) as err:
        download.fetch(download.Remote(url, sha256="0" * 64), tmp_path / "nc.tgz", retries=1, backoff_s=0)
    assert url in str(err.value) and str(tmp_path / "nc.tgz") in str(err.value) and "by hand" in str(err.value)
    with pytest.raises(UserError, match="place the file at"):
        download.fetch(download.Remote(None), tmp_path / "licensed.zip")


# --------------------------------------------------------------------------------------------- corpora
def test_non_utf8_lines_are_reported_with_file_and_line_or_skipped(tmp_path):
    tsv = gz(b"one\teins\n" + "zwei\u00df\tzwei\n".encode("latin-1") + b"three\tdrei\n")
    archive = tmp_path / "news-commentary-v14.en-ru.tsv.gz"
    archive.write_bytes(tsv)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    source = OmegaConf.create({"columns": {"en": 0, "de": 1}})
    with pytest.raises(UserError, match=r"nc:news-commentary-v14.en-ru.tsv line 2 is not UTF-8.*on_bad_utf8=skip"):
        list(read_pairs("nc", source, archive, "en", "de", scratch, BadLines("fail")))
    bad = BadLines("skip")
    assert list(read_pairs("nc", source, archive, "en", "de", scratch, bad)) == [("one", "eins"), ("three", "drei")]
    assert bad.count == 1 and bad.first == ["nc:news-commentary-v14.en-ru.tsv line 2"]


def test_corrupt_archive_and_missing_member_are_clear_errors(tmp_path):
    archive = tmp_path / "training-parallel-nc-v9.tgz"
    archive.write_bytes(ARCHIVES["training-parallel-nc-v9.tgz"][:500])
    source = OmegaConf.create({"files": {"en": "training/news-commentary-v9.de-en.en",
                                         "de": "training/news-commentary-v9.de-en.de"}})
    with pytest.raises(UserError, match="corrupt or truncated"):
        list(read_pairs("nc", source, archive, "en", "de", tmp_path, BadLines("fail")))
    archive.write_bytes(ARCHIVES["training-parallel-nc-v9.tgz"])
    source.files.de = "training/news-commentary-v9.xx-en.de"
    with pytest.raises(UserError, match="has no member 'training/news-commentary-v9.xx-en.de'"):
        list(read_pairs("nc", source, archive, "en", "de", tmp_path, BadLines("fail")))


def test_members_of_unequal_length_are_refused(tmp_path):
    archive = tmp_path / "c.tgz"
    archive.write_bytes(tgz({"a.en": b"1\n2\n3\n", "a.de": b"1\n2\n"}))
    source = OmegaConf.create({"files": {"en": "a.en", "de": "a.de"}})
    with pytest.raises(UserError, match="differ in length"):
        list(read_pairs("c", source, archive, "en", "de", tmp_path, BadLines("fail")))


# --------------------------------------------------------------------------------------------- text
def test_moses_tokenization_and_bpe_as_the_recipes():
    moses = processing.line_function("moses", "en")
    assert moses("\u201cIt's well-known,\u201d she said.") == '&quot; It &apos;s well @-@ known , &quot; she said .'
    assert processing.keep_pair("a b", "c d e", 1, 250, 1.5)
    assert not processing.keep_pair("a", "b c", 1, 250, 1.5)        # ratio 2 > 1.5
    assert not processing.keep_pair("a " * 251, "b " * 251, 1, 250, 1.5)
    assert not processing.keep_pair("", "b", 1, 250, 1.5)


def test_disk_full_in_a_stage_leaves_nothing_behind(tmp_path):
    def build(out: Path):
        (out / "train.en").write_text("half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match="disk is full while writing tokenize-"):
        wmt.run_stage(tmp_path, "tokenize", {"x": 1}, build)
    assert [p.name for p in tmp_path.iterdir()] == [".locks"]  # the lock file stays (removing it would race)


# --------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def sacrebleu_seeded():
    seed_sacrebleu(Path(os.environ["SACREBLEU"]))


def test_prepare_end_to_end_then_cached_then_partly_rebuilt(tmp_path, sacrebleu_seeded):
    env_root = f"paths.data_root={tmp_path}"
    with FixtureServer(ARCHIVES) as server:
        server.cut_once.add("training-parallel-commoncrawl.tgz")
        overrides = source_overrides(server.url, ARCHIVES)
        first = hprune("data", "prepare", *SMALL, *overrides, env_root, f"hydra.run.dir={tmp_path / 'run1'}",
                       subprocess=True)  # the data verb as its own process
        assert ("training-parallel-commoncrawl.tgz", None) in server.requests
        assert any(r[0] == "training-parallel-commoncrawl.tgz" and r[1] for r in server.requests)  # resumed
        n_requests = len(server.requests)
        again = hprune("data", "prepare", *SMALL, *overrides, env_root, f"hydra.run.dir={tmp_path / 'run2'}")
        assert len(server.requests) == n_requests  # nothing downloaded again
        assert again.stdout.strip().splitlines()[-1] == first.stdout.strip().splitlines()[-1]  # same folder
        rebpe = hprune("data", "prepare", *SMALL[:1], "data.bpe_size=60", *SMALL[2:], *overrides, env_root,
                       f"hydra.run.dir={tmp_path / 'run3'}")
    log = rebpe.stdout + rebpe.stderr
    for stage in ("extract", "testsets", "tokenize", "tokenize_test"):
        assert f"{stage}: cached" in log
    for stage in ("learn_bpe", "apply_bpe", "clean", "apply_bpe_test"):
        assert f"{stage}: built" in log

    bin_dir = Path(first.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    root = bin_dir.parent
    summary = json.loads((root / "data.json").read_text())
    assert summary["test_sets"] == {"test": "wmt14/full"}
    text_dir = Path(summary["stages"]["train"])
    # pairs: europarl 700, commoncrawl 350, news commentary 175; every 100th to valid, then clean-corpus-n
    total = 700 + 350 + 175
    applied = text_dir.parent / json.loads((text_dir / "DONE").read_text())["inputs"]["apply_bpe"]
    before = list(zip(*((applied / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de"))))
    assert len(before) == total - total // 100 and before[0][0].startswith("word word")  # the planted long pair
    learned = text_dir.parent / json.loads((applied / "DONE").read_text())["inputs"]["learn_bpe"]
    assert (root / "bpecodes").read_bytes() == (learned / "codes").read_bytes()  # beside the data: for deployment
    kept = [(s, t) for s, t in before if 1 <= len(s.split()) <= 250 and 1 <= len(t.split()) <= 250
            and len(s.split()) / len(t.split()) <= 1.5 and len(t.split()) / len(s.split()) <= 1.5]
    assert len(kept) <= len(before) - 2  # at least the two planted pairs go
    assert summary["splits"]["train"] == len(kept) and summary["splits"]["valid"] <= total // 100
    assert list(zip(*((text_dir / f"train.{lang}").read_text(encoding="utf-8").splitlines()
                      for lang in ("en", "de")))) == kept
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            assert (bin_dir / f"{split}.en-de.{lang}.bin").stat().st_size > 0
    assert (bin_dir / "dict.en.txt").read_text() == (bin_dir / "dict.de.txt").read_text()  # joined dictionary
    # BLEU's references are the pristine test-set sentences, untokenized
    assert (root / "raw" / "test.de").read_text(encoding="utf-8").splitlines() == [t for _, t in TEST_PAIRS]
    bpe_test = (Path(summary["stages"]["test"]) / "test.en").read_text(encoding="utf-8").splitlines()
    assert len(bpe_test) == len(TEST_PAIRS) and "@@ " in " ".join(bpe_test)  # test sets are never cleaned
    assert bpe_test[1].replace("@@ ", "").endswith(" .")  # tokenized before BPE
    assert list(root.parent.glob("*.tmp-*")) == [] and list((tmp_path / "stages").rglob("*.tmp-*")) == []


def test_bad_input_gets_one_line(tmp_path, sacrebleu_seeded):
    proc = hprune("data", "prepare", "data=wmt14_en_de", "data.tgt_lang=ru", f"paths.data_root={tmp_path}",
                  check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "language pair en-ru is not in data set wmt14_en_de" in proc.stderr.strip().splitlines()[-1]
    url = f"http://127.0.0.1:{closed_port()}"
    proc = hprune("data", "prepare", *SMALL, *source_overrides(url, ARCHIVES), f"paths.data_root={tmp_path}",
                  check=False)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cannot download http://127.0.0.1" in line and str(tmp_path / "downloads") in line
    assert not any(p.name.startswith("wmt14_en_de-") for p in tmp_path.iterdir())  # no half-built data set
    proc = hprune("data", "prepare", *SMALL, "data.test_sets=[wmt14/full,wmt99]", f"paths.data_root={tmp_path}",
                  check=False)
    assert proc.returncode == 2 and "unknown sacreBLEU test set 'wmt99'" in proc.stderr


def test_train_and_eval_on_wmt_data_score_detokenized_output_against_pristine_references(tmp_path,
                                                                                          sacrebleu_seeded):
    from sacrebleu.metrics import BLEU

    with FixtureServer(ARCHIVES) as server:
        data = [*SMALL, *source_overrides(server.url, ARCHIVES)]
        hprune("train", *data, "optim.max_update=60", "optim.max_tokens=2048", "device=cpu",
               f"hydra.run.dir={tmp_path / 'train'}")
    # the data set is cached now: evaluation needs no server
    hprune("eval", *data, f"ckpt={tmp_path / 'train'}", "device=cpu", f"hydra.run.dir={tmp_path / 'eval'}")
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["test_set"] == "wmt14/full" and metrics["sentences"] == len(TEST_PAIRS)
    hypotheses = (tmp_path / "eval" / "hypotheses.test.txt").read_text(encoding="utf-8").splitlines()
    assert not any(mark in h for h in hypotheses for mark in ("@@", "&apos;", "&quot;", " ."))  # BPE and Moses undone
    expected = BLEU().corpus_score(hypotheses, [[t for _, t in TEST_PAIRS]]).score
    assert metrics["bleu"] == pytest.approx(expected, abs=1e-3)
    if importlib.util.find_spec("ctranslate2") is not None:  # the exported model comes with its BPE codes
        hprune("export", *data, f"ckpt={tmp_path / 'train'}", "device=cpu", f"hydra.run.dir={tmp_path / 'export'}")
        exported = json.loads((tmp_path / "export" / "metrics.json").read_text())
        assert exported["subword_files"] == ["bpecodes"] and (tmp_path / "export" / "ctranslate2" / "bpecodes").is_file()


def test_sentencepiece_option_learns_and_segments_losslessly(tmp_path):
    from wmt_fixtures import corpus

    lines = [s for pair in corpus(400, seed=5) for s in pair]
    train = tmp_path / "train.txt"
    train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    processing.learn_sentencepiece([train], tmp_path / "spm", 120)
    assert processing.map_file("sentencepiece", str(tmp_path / "spm.model"), train, tmp_path / "out.txt") == len(lines)
    pieces = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    assert all(" " in p for p in pieces[:10])  # sentences are split into pieces
    # fairseq's --post-process sentencepiece: join the pieces, "▁" back to spaces
    assert [p.replace(" ", "").replace("\u2581", " ").strip() for p in pieces] == lines
