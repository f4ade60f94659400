"""A model with its own vocabulary and subwords, laid out as fairseq's published tarballs unpack (model.pt,
dict.en.txt, dict.fr.txt, bpecodes): data=pretrained encodes text with the model's codes and dictionaries and
scores against the pristine references; data=databin uses a data-bin as it is; `hprune data fetch` downloads
and unpacks a published model (from a local server). The model: stock fairseq-train on BPE'd toy text, with
encoder and decoder FFN sizes that differ from each other and from the arch's defaults (as WMT19's)."""
from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from conftest import hprune
from test_cli import assert_one_line_error
from test_stock_fairseq import fairseq_generate, stock_argv

pytest.importorskip("fairseq")
LANGS = ("en", "fr")


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hub(trained_run, evaluated_run, tmp_path_factory) -> dict:
    """{dir: the tarball layout, bin: the data-bin it was trained on, raw: the untokenized test text}."""
    from subword_nmt.apply_bpe import BPE
    from subword_nmt.learn_bpe import learn_bpe

    from hprune import backend
    root = tmp_path_factory.mktemp("hub")
    toy_raw = Path(evaluated_run[1]["data_bin"]).parent / "raw"
    raw, text = root / "raw", root / "text"
    raw.mkdir()
    text.mkdir()
    for split in ("train", "valid", "test"):
        for toy_lang, lang in zip(("src", "tgt"), LANGS):
            shutil.copyfile(toy_raw / f"{split}.{toy_lang}", raw / f"{split}.{lang}")
    corpus = (raw / "train.en").read_text().splitlines() + (raw / "train.fr").read_text().splitlines()
    with open(root / "bpecodes", "w") as out:
        learn_bpe(corpus, out, 300)
    with open(root / "bpecodes") as f:
        bpe = BPE(f)
    for path in raw.iterdir():
        write_lines(text / path.name, [bpe.segment(line) for line in path.read_text().splitlines()])
    backend.binarize(text, root / "bin", *LANGS, joined=True)
    argv = stock_argv(trained_run / "fairseq-train.sh", root / "checkpoints", updates=40)
    argv[0] = str(root / "bin")
    argv[argv.index("--source-lang") + 1], argv[argv.index("--target-lang") + 1] = LANGS
    argv += ["--encoder-ffn-embed-dim", "96", "--decoder-ffn-embed-dim", "48"]  # WMT19-like: they differ
    backend.train(argv)
    model = root / "wmt14.en-fr.joined-dict.transformer"  # as published: no data settings of its own
    model.mkdir()
    shutil.copyfile(root / "checkpoints" / "checkpoint_best.pt", model / "model.pt")
    for name in ("dict.en.txt", "dict.fr.txt"):
        shutil.copyfile(root / "bin" / name, model / name)
    shutil.copyfile(root / "bpecodes", model / "bpecodes")
    return {"dir": model, "bin": root / "bin", "raw": raw}


def own_sets(hub: dict, split: str) -> str:
    return f"{{src:{hub['raw'] / f'{split}.en'},tgt:{hub['raw'] / f'{split}.fr'}}}"


def pretrained(hub: dict, *extra: str) -> list[str]:
    return ["data=pretrained", f"data.test_sets=[{own_sets(hub, 'test')}]", *extra]


def test_a_published_layout_is_evaluated_with_its_own_codes_and_dictionaries(hub, tmp_path):
    """The same binarized test set as the model's own data-bin, so the same translations as stock
    fairseq-generate there; BLEU against the untokenized references; the FFN sizes as recorded."""
    from hprune.evaluation import score
    from hprune_fairseq.safe_load import load_checkpoint
    out = tmp_path / "eval"
    hprune("eval", f"ckpt={hub['dir'] / 'model.pt'}", f"hydra.run.dir={out}", *pretrained(hub), "device=cpu")
    metrics = json.loads((out / "metrics.json").read_text())
    data_bin = Path(metrics["data_bin"])
    assert (data_bin / "test.en-fr.en.bin").read_bytes() == (hub["bin"] / "test.en-fr.en.bin").read_bytes()
    assert (data_bin / "test.en-fr.fr.bin").read_bytes() == (hub["bin"] / "test.en-fr.fr.bin").read_bytes()
    summary = json.loads((data_bin.parent / "data.json").read_text())
    assert summary["bpe"] == "subword_nmt" and summary["encoding"]["test.en"]["unk"] == 0
    hypotheses = (out / "hypotheses.test.txt").read_text().splitlines()
    stock = fairseq_generate(hub["bin"], hub["dir"] / "model.pt", "--post-process", "subword_nmt")
    assert hypotheses == stock
    references = (hub["raw"] / "test.fr").read_text().splitlines()
    assert metrics["bleu"] == score(stock, references).bleu and metrics["imported_from"] == "transformer"
    model_cfg = load_checkpoint(hub["dir"] / "model.pt")["cfg"]["model"]
    assert (model_cfg.encoder_ffn_embed_dim, model_cfg.decoder_ffn_embed_dim) == (96, 48)

    # the data-bin itself (data=databin): references decoded from its targets give the same BLEU here, as the
    # toy text is what Moses and BPE removal give back
    out = tmp_path / "databin"
    hprune("eval", f"ckpt={hub['dir'] / 'model.pt'}", f"hydra.run.dir={out}", "data=databin",
           f"data.path={hub['bin']}", "data.post_process=subword_nmt", "device=cpu")
    databin = json.loads((out / "metrics.json").read_text())
    assert (out / "hypotheses.test.txt").read_text().splitlines() == stock and databin["bleu"] == metrics["bleu"]


def test_fastbpe_codes_and_sentencepiece_encode_as_the_model_was_trained(hub, tmp_path):
    """fastBPE's format of the same merges gives the same data-bin; a sentencepiece model's pieces are what its
    processor gives, mapped through the model's dictionary."""
    import sentencepiece

    from hprune import backend
    fastbpe = tmp_path / "fastbpe"
    shutil.copytree(hub["dir"], fastbpe)
    merges = (hub["dir"] / "bpecodes").read_text().splitlines()[1:]
    write_lines(fastbpe / "bpecodes", [f"{m} {1000 - i}" for i, m in enumerate(merges)])
    out = hprune("data", "prepare", *pretrained(hub, f"data.model_dir={fastbpe}", "data.src_lang=en",
                                                 "data.tgt_lang=fr")).stdout
    data_bin = Path(out.split(": ")[-1].strip())
    assert json.loads((data_bin.parent / "data.json").read_text())["bpe"] == "fastbpe"
    assert (data_bin / "test.en-fr.en.bin").read_bytes() == (hub["bin"] / "test.en-fr.en.bin").read_bytes()

    spm_dir = tmp_path / "spm"
    spm_dir.mkdir()
    train = [hub["raw"] / "train.en", hub["raw"] / "train.fr"]
    sentencepiece.SentencePieceTrainer.train(input=",".join(map(str, train)), model_prefix=str(spm_dir / "sentencepiece.bpe"),
                                             vocab_size=200, model_type="bpe", minloglevel=2)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm_dir / "sentencepiece.bpe.model"))
    text = tmp_path / "spm-text"
    text.mkdir()
    for split in ("train", "valid"):
        for lang in LANGS:
            write_lines(text / f"{split}.{lang}", [" ".join(processor.encode(line, out_type=str))
                                                   for line in (hub["raw"] / f"{split}.{lang}").read_text().splitlines()])
    backend.binarize(text, tmp_path / "spm-bin", *LANGS, test_splits=())
    for lang in LANGS:
        shutil.copyfile(tmp_path / "spm-bin" / f"dict.{lang}.txt", spm_dir / f"dict.{lang}.txt")
    out = hprune("data", "prepare", *pretrained(hub, f"data.model_dir={spm_dir}", "data.src_lang=en",
                                                 "data.tgt_lang=fr")).stdout
    data_bin = Path(out.split(": ")[-1].strip())
    summary = json.loads((data_bin.parent / "data.json").read_text())
    assert summary["bpe"] == "sentencepiece"
    sources = (hub["raw"] / "test.en").read_text().splitlines()
    from fairseq.data import Dictionary, data_utils
    dictionary = Dictionary.load(str(spm_dir / "dict.en.txt"))
    binarized = data_utils.load_indexed_dataset(str(data_bin / "test.en-fr.en"), dictionary)
    for i in (0, 7, len(sources) - 1):  # no Moses before sentencepiece (tokenizer=auto), as the wmt20 recipe
        assert dictionary.string(binarized[i]) == " ".join(processor.encode(sources[i], out_type=str))


def test_codes_that_do_not_fit_the_dictionary_are_caught_before_anything_is_written(hub, tmp_path, data_root):
    """wmt19.en-ru's trap: codes of another model encode into pieces the dictionary lacks."""
    from subword_nmt.learn_bpe import learn_bpe
    wrong = tmp_path / "wrong"
    shutil.copytree(hub["dir"], wrong)
    other = [" ".join(word[::-1] for word in line.split()) for line in (hub["raw"] / "train.en").read_text().splitlines()]
    with open(wrong / "bpecodes", "w") as out:
        learn_bpe(other, out, 300)
    before = sorted(p.name for p in data_root.iterdir())
    result = hprune("eval", f"ckpt={wrong / 'model.pt'}", f"hydra.run.dir={tmp_path / 'eval'}", *pretrained(hub),
                    "device=cpu", check=False)
    assert_one_line_error(result, "codes do not fit its dictionary", "<unk>", "wmt19.en-ru")
    assert sorted(p.name for p in data_root.iterdir()) == before and not (tmp_path / "eval" / "metrics.json").exists()


def test_bad_model_folders_are_one_line_each(hub, tmp_path):
    def folder(name: str, drop=(), dict_lines: int = 0) -> Path:
        path = tmp_path / name
        shutil.copytree(hub["dir"], path)
        for f in drop:
            (path / f).unlink()
        if dict_lines:
            with open(path / "dict.fr.txt", "a") as f:
                f.writelines(f"extra{i} 1\n" for i in range(dict_lines))
        return path / "model.pt"

    def eval_error(ckpt: Path, *extra: str):
        return hprune("eval", f"ckpt={ckpt}", f"hydra.run.dir={tmp_path / 'out'}", *extra, "device=cpu", check=False)

    assert_one_line_error(eval_error(folder("nodict", drop=["dict.fr.txt"]), *pretrained(hub)),
                          "has no dict.fr.txt", "data.model_dir")
    assert_one_line_error(eval_error(folder("nocodes", drop=["bpecodes"]), *pretrained(hub)),
                          "no subword codes", "data.bpe=none")
    assert_one_line_error(eval_error(folder("nosettings"), "data=pretrained"),
                          "no test-set settings", "data.test_sets=")
    assert_one_line_error(eval_error(folder("bigdict", dict_lines=8), *pretrained(hub)),
                          "embeds", "fr words but", "dict.fr.txt")
    assert_one_line_error(eval_error(folder("pairs"), *pretrained(hub, "data.valid_sets=[wmt17]")),
                          "wmt17 has no en-fr")
    assert_one_line_error(eval_error(folder("same"), "data=pretrained",
                                     f"data.test_sets=[{{src:{hub['raw'] / 'test.en'},tgt:{hub['raw'] / 'test.en'}}}]"),
                          "test.en is given as both the en and the fr side")
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_your_text_with_a_model_of_its_own_vocabulary_is_refused_before_any_work(hub, tmp_path, data_root):
    """data=text would learn a BPE and a dictionary of its own, which an imported or published model cannot read:
    one line before anything is prepared, naming the data=pretrained form with your files, which then works."""
    import shlex
    folder = tmp_path / "model"
    shutil.copytree(hub["dir"], folder)
    (folder / "hprune.yaml").write_text("test_sets: [wmt14/full]\n")  # as fetched or imported
    before = sorted(p.name for p in data_root.iterdir())
    own = ["data=text", "data.src_lang=en", "data.tgt_lang=fr", f"data.train={hub['raw'] / 'train'}",
           f"data.test={{src:{hub['raw'] / 'test.en'},tgt:{hub['raw'] / 'test.fr'}}}"]
    result = hprune("eval", f"ckpt={folder}", *own, f"hydra.run.dir={tmp_path / 'text'}", "device=cpu", check=False)
    line = assert_one_line_error(result, f"data=pretrained data.model_dir={folder} 'data.test_sets=[{{src:")
    assert sorted(p.name for p in data_root.iterdir()) == before and not (tmp_path / "text" / "metrics.json").exists()
    suggested = shlex.split(line.split("with the model's own: ")[1])
    assert suggested[2:] == [f"data.test_sets=[{{src:{hub['raw'] / 'test.en'},tgt:{hub['raw'] / 'test.fr'}}}]",
                             f"data.train_sets=[{{src:{hub['raw'] / 'train.en'},tgt:{hub['raw'] / 'train.fr'}}}]"]
    hprune("eval", f"ckpt={folder}", *suggested, f"hydra.run.dir={tmp_path / 'pretrained'}", "device=cpu")
    data_bin = Path(json.loads((tmp_path / "pretrained" / "metrics.json").read_text())["data_bin"])
    assert (data_bin / "test.en-fr.en.bin").read_bytes() == (hub["bin"] / "test.en-fr.en.bin").read_bytes()


def test_a_test_sentence_longer_than_the_models_positions_is_refused_and_a_long_reference_is_scored(hub, tmp_path):
    """A source longer than the encoder's 1,024 positions: one line before any translation (was fairseq's "Size
    of sample #3 is invalid" traceback), naming the line; a reference that long: every sentence translated (the
    model never reads it; fairseq-generate refuses it too), the hypothesis cut at the decoder's positions."""
    from hprune.evaluation import score
    sources = (hub["raw"] / "test.en").read_text().splitlines()[:10]
    targets = (hub["raw"] / "test.fr").read_text().splitlines()[:10]
    long = {side: " ".join((" ".join(lines) + " ").split() * 40)[:20_000] for side, lines in (("en", sources),
                                                                                               ("fr", targets))}

    def files(name: str, source: list, target: list) -> str:
        write_lines(tmp_path / f"{name}.en", source)
        write_lines(tmp_path / f"{name}.fr", target)
        return f"data.test_sets=[{{src:{tmp_path / f'{name}.en'},tgt:{tmp_path / f'{name}.fr'}}}]"

    result = hprune("eval", f"ckpt={hub['dir'] / 'model.pt'}", "data=pretrained",
                    files("long_source", sources[:3] + [long["en"]] + sources[3:], targets[:3] + ["x"] + targets[3:]),
                    f"hydra.run.dir={tmp_path / 'refused'}", "device=cpu", check=False)
    assert_one_line_error(result, "1 of 11 test sentences have sources longer than the model's 1024 positions",
                          "(line 4 of ", "split or shorten those sentences")
    out = tmp_path / "scored"
    references = targets[:3] + [long["fr"]] + targets[3:]
    hprune("eval", f"ckpt={hub['dir'] / 'model.pt'}", "data=pretrained",
           files("long_reference", sources[:3] + [sources[0]] + sources[3:], references), f"hydra.run.dir={out}",
           "device=cpu")
    metrics = json.loads((out / "metrics.json").read_text())
    hypotheses = (out / "hypotheses.test.txt").read_text().splitlines()
    assert metrics["sentences"] == 11 and metrics["bleu"] == score(hypotheses, references).bleu


def tarball(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:bz2") as tar:
        tar.add(folder, arcname=folder.name)
    return buffer.getvalue()


def test_a_published_model_is_fetched_resumed_recorded_and_pruned(hub, tmp_path):
    """`hprune data fetch` against a local server that cuts the first transfer: resumed, unpacked with its data
    settings, its sha256 recorded and checked on a later download; then pruned with Michel's order."""
    from hprune_fairseq.safe_load import load_checkpoint
    from wmt_fixtures import FixtureServer
    name, archive = "wmt14.en-fr.joined-dict.transformer", "wmt14.en-fr.joined-dict.transformer.tar.bz2"
    blob = tarball(hub["dir"])
    models, data_root = tmp_path / "models", tmp_path / "root"
    fetch = ["data", "fetch", f"published={name}", f"paths.models_root={models}", f"paths.data_root={data_root}"]
    with FixtureServer({archive: blob}) as server:
        server.cut_once.add(archive)
        hprune(*fetch, f"mirror={server.url}", "hydra.run.dir=" + str(tmp_path / "f1"))
        assert [r for r in server.requests if r[1]], "the cut download was not resumed with a Range request"
        folder = models / name
        settings = (folder / "hprune.yaml").read_text()
        assert "wmt14/full" in settings and "first download" in settings
        import hashlib
        recorded = (data_root / "downloads" / f"{archive}.sha256").read_text().split()[0]
        assert recorded == hashlib.sha256(blob).hexdigest()
        # another archive under the same name (a changed or corrupted download) is refused after a retry
        shutil.rmtree(folder)
        (data_root / "downloads" / archive).unlink()
        server.files[archive] = blob[:-10] + b"0123456789"
        result = hprune(*fetch, f"mirror={server.url}", "hydra.run.dir=" + str(tmp_path / "f2"), check=False)
        assert_one_line_error(result, "downloaded twice with the wrong sha256")
        assert not folder.exists()
    shutil.copytree(hub["dir"], folder)  # (as fetched the first time)
    (folder / "hprune.yaml").write_text(settings)

    out = tmp_path / "prune"
    hprune("prune", "--method", "michel", f"ckpt={folder}", f"hydra.run.dir={out}", *pretrained(hub),
           f"data.valid_sets=[{own_sets(hub, 'valid')}]", f"data.train_sets=[{own_sets(hub, 'train')}]",
           "prune.step_pct=50", "prune.target_pct=50", "prune.export=true", "device=cpu")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["imported_from"] == "transformer" and metrics["export_same_translations"]
    assert load_checkpoint(metrics["export_checkpoint"])["cfg"]["model"].decoder_ffn_embed_dim == 48
    # the pruned checkpoint knows the model folder it came from: measured without data=, on the run's own data
    pruned = Path(metrics["export_checkpoint"])
    assert f"model_dir: {folder}" in (pruned.parent / "hprune.yaml").read_text()
    hprune("eval", f"ckpt={pruned}", f"hydra.run.dir={tmp_path / 'eval-pruned'}", "device=cpu")
    evaluated = json.loads((tmp_path / "eval-pruned" / "metrics.json").read_text())
    assert evaluated["data_bin"] == metrics["data_bin"] and evaluated["bleu"] == metrics["export_bleu"]
