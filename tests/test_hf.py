"""Hugging Face translation models imported as fairseq models. Tiny random FSMTForConditionalGeneration and
MarianMTModel models (built from transformers' own config classes, their BPE / sentencepiece models and
vocabularies learnt from toy text, saved with save_pretrained), once imported, give transformers'
log-probabilities, greedy and beam translations, and the log-probabilities of transformers' model with the same
heads removed by hand; every verb takes their folders as ckpt=."""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import hprune
from test_cli import assert_one_line_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("fairseq")
from hf_models import BUILDERS, LANGS  # noqa: E402  (needs transformers)

MAX_LEN = 20  # target tokens before eos: fairseq's max_len_b; transformers' max_length counts the start and eos too


def toy_text(evaluated_run, split: str, n: int) -> dict:
    raw = Path(evaluated_run[1]["data_bin"]).parent / "raw"
    return {lang: (raw / f"{split}.{toy}").read_text().splitlines()[:n] for lang, toy in zip(LANGS, ("src", "tgt"))}


def built(family: str, evaluated_run, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(family)
    model = BUILDERS[family](root, toy_text(evaluated_run, "train", 600 if family == "fsmt" else 400))
    for lang, lines in toy_text(evaluated_run, "test", 30).items():
        (root / f"test.{lang}").write_text("".join(line + "\n" for line in lines))
    return model


@pytest.fixture(scope="module")
def fsmt(evaluated_run, tmp_path_factory) -> dict:
    return built("fsmt", evaluated_run, tmp_path_factory)


@pytest.fixture(scope="module")
def marian(evaluated_run, tmp_path_factory) -> dict:
    return built("marian", evaluated_run, tmp_path_factory)


@pytest.fixture(params=["fsmt", "marian"])
def hf_model(request) -> dict:
    return request.getfixturevalue(request.param)


def fairseq_ids(hf: dict, loaded) -> torch.Tensor:
    """transformers id -> fairseq id (FSMT keeps fairseq's ids; Marian's are mapped through the pieces)."""
    if hf["vocab"] is None:
        return torch.arange(hf["model"].config.tgt_vocab_size)
    by_id = {i: token for token, i in hf["vocab"].items()}
    return torch.tensor([loaded.task.target_dictionary.index(by_id[i]) for i in range(len(by_id))])


def hf_log_probs(hf: dict, model, sources, decoder_in) -> torch.Tensor:
    with torch.no_grad():  # use_cache=False: with the cache on, FSMT takes whole decoder inputs unmasked
        logits = model(input_ids=sources["input_ids"], attention_mask=sources["attention_mask"],
                       decoder_input_ids=decoder_in, use_cache=False).logits
    return torch.log_softmax(logits, -1)


def our_log_probs(model, to_fairseq, sources, decoder_in, pad) -> list[torch.Tensor]:
    """One sentence at a time (fairseq pads sources on the left; alone they need no padding), over
    transformers' vocabulary order."""
    lengths, out = sources["attention_mask"].sum(1), []
    with torch.no_grad():
        for i in range(len(lengths)):
            src = to_fairseq[sources["input_ids"][i, : lengths[i]]].unsqueeze(0)
            prev = to_fairseq[decoder_in[i:i + 1]]
            prev[0, 0] = 2  # fairseq's decoder starts from eos (Marian's own start vector: --decoder-start-embedding)
            net = model(src_tokens=src, src_lengths=lengths[i:i + 1], prev_output_tokens=prev)
            out.append(model.get_normalized_probs(net, log_probs=True)[0][:, to_fairseq])
    return out


def without_heads(model, mask: dict, attention: tuple[str, str]):
    """transformers' model with the masked heads' columns of each attention's output projection zeroed: what
    removing a head computes, without hprune."""
    model = copy.deepcopy(model)
    base = model.model
    layers = {"enc-self": (base.encoder.layers, attention[0]), "dec-self": (base.decoder.layers, attention[0]),
              "dec-enc": (base.decoder.layers, attention[1])}
    with torch.no_grad():
        for kind, rows in mask.items():
            stack, name = layers[kind]
            for layer, keep in zip(stack, rows):
                projection = getattr(layer, name).out_proj
                width = projection.weight.shape[1] // len(keep)
                for head, kept in enumerate(keep):
                    if not kept:
                        projection.weight[:, head * width:(head + 1) * width] = 0
    return model


def test_an_imported_model_computes_as_transformers_with_and_without_heads(hf_model, tmp_path):
    from hprune import backend
    ckpt = backend.import_hf(hf_model["dir"], tmp_path / "models")
    assert (ckpt.parent / "dict.en.txt").is_file() and (ckpt.parent / "dict.fr.txt").is_file()
    loaded = backend.load_model(ckpt, ckpt.parent)
    tok, theirs, pad = hf_model["tokenizer"], hf_model["model"], hf_model["pad"]
    test = {lang: (hf_model["root"] / f"test.{lang}").read_text().splitlines()[:8] for lang in LANGS}
    sources = tok(test["en"], return_tensors="pt", padding=True)
    targets = tok(text_target=test["fr"], return_tensors="pt", padding=True)["input_ids"]
    decoder_in = torch.cat([torch.full((targets.shape[0], 1), hf_model["start"]), targets[:, :-1]], dim=1)
    keep = targets.ne(pad)
    to_fairseq = fairseq_ids(hf_model, loaded)

    def difference(ours, hf):
        return max((ours[i] - hf[i])[keep[i]].abs().max().item() for i in range(len(ours)))

    full = difference(our_log_probs(loaded.model, to_fairseq, sources, decoder_in, pad),
                      hf_log_probs(hf_model, theirs, sources, decoder_in))
    assert full <= 1e-4, full
    mask = {"enc-self": [[1, 0, 1, 1], [0, 0, 1, 1]], "dec-self": [[1, 1, 1, 0], [1, 0, 1, 1]],
            "dec-enc": [[0, 1, 1, 1], [1, 1, 0, 0]]}
    removed = hf_log_probs(hf_model, without_heads(theirs, mask, hf_model["attention"]), sources, decoder_in)
    loaded.model.set_head_mask(mask)
    masked = difference(our_log_probs(loaded.model, to_fairseq, sources, decoder_in, pad), removed)
    loaded.model.set_head_mask(None)
    pruned = copy.deepcopy(loaded.model)
    pruned.keep_heads({kind: [[h for h, kept in enumerate(row) if kept] for row in rows] for kind, rows in mask.items()})
    physical = difference(our_log_probs(pruned, to_fairseq, sources, decoder_in, pad), removed)
    assert masked <= 1e-4 and physical <= 1e-4, (masked, physical)
    assert difference(our_log_probs(loaded.model, to_fairseq, sources, decoder_in, pad), removed) > 1e-2  # it mattered
    print(f"{hf_model['dir'].name}: max |log p| difference {full:.1e}, masked {masked:.1e}, pruned {physical:.1e}")


def test_an_imported_model_translates_as_transformers_generate(hf_model, tmp_path):
    """Greedy: every sentence. Beam 4: every sentence whose transformers translation ends before the length limit.
    At the limit the two searches score differently (transformers forces eos with log-probability 0, fairseq adds
    eos's own), so a hypothesis cut there may rank differently."""
    tok, theirs = hf_model["tokenizer"], hf_model["model"]
    sources = (hf_model["root"] / "test.en").read_text().splitlines()
    inputs = tok(sources, return_tensors="pt", padding=True)
    agreement = {}
    for beam in (1, 4):
        out = tmp_path / f"beam{beam}"
        hprune("eval", f"ckpt={hf_model['dir']}", f"paths.models_root={tmp_path / 'models'}", "data=pretrained",
               f"data.test_sets=[{{src:{hf_model['root'] / 'test.en'},tgt:{hf_model['root'] / 'test.fr'}}}]",
               "data.max_pieces_per_word=null", f"generation.beam={beam}", "generation.lenpen=1.0",
               "generation.max_len_a=0", f"generation.max_len_b={MAX_LEN}", "device=cpu", f"hydra.run.dir={out}")
        ours = (out / "hypotheses.test.txt").read_text().splitlines()
        with torch.no_grad():
            generated = theirs.generate(**inputs, num_beams=beam, max_length=MAX_LEN + 2, min_length=2,
                                        suppress_tokens=[hf_model["pad"]], do_sample=False, early_stopping=True,
                                        length_penalty=1.0)
        hyps = tok.batch_decode(generated, skip_special_tokens=True)
        eos = theirs.config.eos_token_id
        ended = [eos in row[1:MAX_LEN + 1].tolist() for row in generated]  # after the start, within the limit
        agreement[beam] = f"{sum(a == b for a, b in zip(ours, hyps))}/{len(hyps)} ({sum(ended)} end before the limit)"
        if beam == 1:
            assert ours == hyps
        else:
            assert sum(ended) >= len(hyps) // 2, "too few sentences end before the limit to compare beam search"
            assert [a for a, e in zip(ours, ended) if e] == [h for h, e in zip(hyps, ended) if e]
    print(f"{hf_model['dir'].name}: identical translations, greedy {agreement[1]}, beam 4 {agreement[4]}")


def test_a_marian_model_is_fetched_from_the_hub_resumed_imported_pruned_and_analysed(marian, tmp_path, monkeypatch):
    """Through huggingface_hub against a local server answering the Hub's endpoints (HF_ENDPOINT): a dropped
    connection resumed, a gated copy refused without the token and fetched with it, the resolved commit recorded;
    then, offline (HF_HUB_OFFLINE=1, a warm cache), ckpt=ORG/NAME with no data= prunes, exports and analyses it."""
    from hub_server import HubServer
    repo, gated = "Helsinki-NLP/opus-mt-en-fr", "Helsinki-NLP/opus-mt-en-fr-gated"
    files = {p.name: p.read_bytes() for p in marian["dir"].iterdir()}
    files["README.md"] = b"not read by hprune"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    models = f"paths.models_root={tmp_path / 'models'}"
    with HubServer({repo: files, gated: files}, gated={gated: "secret"}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        server.cut_once.add("model.safetensors")
        hprune("data", "fetch", f"hf={repo}", models, subprocess=True)
        refused = hprune("data", "fetch", f"hf={gated}", models, subprocess=True, check=False)
        assert_one_line_error(refused, f"{gated} is gated", "HF_TOKEN")
        monkeypatch.setenv("HF_TOKEN", "secret")
        hprune("data", "fetch", f"hf={gated}", models, subprocess=True)
        monkeypatch.delenv("HF_TOKEN")
    requested = [name for name, _ in server.requests]
    assert requested.count("model.safetensors") >= 2  # cut, then fetched again
    assert {"config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json"} <= set(requested)
    assert "README.md" not in requested  # only the files hprune reads
    record = json.loads((tmp_path / "models" / "hub" / "Helsinki-NLP--opus-mt-en-fr.json").read_text())
    folder = Path(record["folder"])
    assert record["commit"] == server.commits[repo] == folder.name and record["revision"] == "main"
    assert folder.is_relative_to(tmp_path / "hf")  # the shared Hugging Face cache, as from_pretrained uses it
    for path in marian["dir"].iterdir():
        assert (folder / path.name).read_bytes() == path.read_bytes()
        assert record["sha256"][path.name] == hashlib.sha256(path.read_bytes()).hexdigest()
    # offline: the warm cache answers; a repository it lacks is one line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = hprune("data", "fetch", "hf=Helsinki-NLP/opus-mt-en-de", models, subprocess=True, check=False)
    assert_one_line_error(missing, "not in the Hugging Face cache", "HF_HUB_OFFLINE")

    own = f"{{src:{marian['root'] / 'test.en'},tgt:{marian['root'] / 'test.fr'}}}"
    common = [f"ckpt={repo}", models, f"data.test_sets=[{own}]", f"data.valid_sets=[{own}]",
              "data.max_pieces_per_word=null", "device=cpu"]
    out = tmp_path / "prune"
    hprune("prune", "--method", "michel", *common, "prune.step_pct=50", "prune.target_pct=50", "prune.export=true",
           "generation.beam=1", f"hydra.run.dir={out}", subprocess=True)  # the environment's HF_* as a user has it
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["export_same_translations"]
    from hprune_fairseq.safe_load import load_checkpoint
    state = load_checkpoint(metrics["export_checkpoint"])  # an import is written in fairseq's legacy `args` layout
    kept = json.loads(state["args"].kept_heads)
    assert sum(len(layer) for rows in kept.values() for layer in rows) == 12  # half of 24
    # the pruned export is an hprune_transformer with Marian's options: stock fairseq-generate translates with it
    # as hprune does
    from test_stock_fairseq import fairseq_generate
    imported = next((tmp_path / "models" / "hf").glob("*opus-mt-en-fr-*"))
    evaluated = tmp_path / "exported"
    hprune("eval", f"ckpt={metrics['export_checkpoint']}", "data=pretrained", *common[2:], f"data.model_dir={imported}",
           "generation.beam=5", "generation.lenpen=1.0", "generation.max_len_a=1.2", "generation.max_len_b=10",
           f"hydra.run.dir={evaluated}")
    data_bin = json.loads((evaluated / "metrics.json").read_text())["data_bin"]
    stock = fairseq_generate(Path(data_bin), Path(metrics["export_checkpoint"]), "--post-process", "sentencepiece")
    assert stock == (evaluated / "hypotheses.test.txt").read_text().splitlines()
    analysed = tmp_path / "analyze"
    hprune("analyze", *common, "split=test", f"hydra.run.dir={analysed}", subprocess=True)
    import pandas as pd
    roles = pd.read_csv(analysed / "head_roles.csv")
    assert len(roles) == 24 and roles.loc[roles["type"] == "enc-self", "syntactic"].isna().all()  # no arcs: unmeasured
    assert json.loads((analysed / "metrics.json").read_text())["syntactic_heads"] is None


def test_an_imported_marian_model_trains_on_with_its_swish_ffn():
    """Continued training (Voita's gates, recovery, the MoA conversion) passes an imported model's options to
    fairseq-train again: Marian's `--activation-fn swish`, which fairseq computes but its parser did not offer,
    is accepted by hprune_transformer's and built as fairseq's swish."""
    from fairseq import options
    from fairseq.models.transformer import TransformerConfig

    from hprune.backend import PLUGIN_DIR
    from hprune_fairseq.layers import HeadEncoderLayer
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["data", "--user-dir", PLUGIN_DIR, "--arch", "hprune_transformer",
                                                "--activation-fn", "swish", "--encoder-embed-dim", "16",
                                                "--encoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2"])
    assert args.activation_fn == "swish"
    layer = HeadEncoderLayer(TransformerConfig.from_namespace(args))
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(layer.activation_fn(x), torch.nn.functional.silu(x))


def test_hugging_face_folders_hprune_does_not_import_are_one_line(fsmt, marian, tmp_path, monkeypatch):
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5"}))
    broken, no_spm, wrong = tmp_path / "broken", tmp_path / "no-spm", tmp_path / "wrong"
    shutil.copytree(fsmt["dir"], broken)
    (broken / "merges.txt").unlink()
    shutil.copytree(marian["dir"], no_spm)
    (no_spm / "target.spm").unlink()
    shutil.copytree(marian["dir"], wrong)
    vocab = json.loads((wrong / "vocab.json").read_text())
    (wrong / "vocab.json").write_text(json.dumps({**vocab, "extra": len(vocab)}))
    # issue 50: weights cut short (a download, a full disk), a config.json that describes another model than its
    # weights (its import used to be kept, with its data set, and fail when loaded), a damaged vocabulary
    cut, cut_bin, other_config, bad_json = (tmp_path / name for name in ("cut", "cut-bin", "other-config", "bad-json"))
    for folder in (cut, other_config, bad_json):
        shutil.copytree(marian["dir"], folder)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(fsmt["dir"], cut_bin, ignore=shutil.ignore_patterns("model.safetensors"))
    from safetensors.torch import load_file
    torch.save(load_file(str(fsmt["dir"] / "model.safetensors")), cut_bin / "pytorch_model.bin")
    (cut_bin / "pytorch_model.bin").write_bytes((cut_bin / "pytorch_model.bin").read_bytes()[:5000])
    config = json.loads((other_config / "config.json").read_text())
    (other_config / "config.json").write_text(json.dumps({**config, "encoder_ffn_dim": 96}))
    (bad_json / "vocab.json").write_text((bad_json / "vocab.json").read_text()[:100])
    for folder, expected in ((t5, "Hugging Face 't5' model"), (broken, "has no merges.txt"),
                             (no_spm, "has no target.spm"), (wrong, "vocabulary has"),
                             (cut, "model.safetensors cannot be read"), (cut_bin, "pytorch_model.bin cannot be read"),
                             (other_config, "config.json does not match the weights (size mismatch for "
                                            "encoder.layers.0.fc1.weight"), (bad_json, "vocab.json is not JSON")):
        result = hprune("eval", f"ckpt={folder}", f"paths.models_root={tmp_path / 'models'}", "data=pretrained",
                        f"paths.data_root={tmp_path / 'data'}", "data.test_sets=[wmt14/full]", "device=cpu",
                        f"hydra.run.dir={tmp_path / 'out'}", check=False)
        assert_one_line_error(result, expected)
    assert not (tmp_path / "out" / "metrics.json").exists() and not list((tmp_path / "models").glob("hf/[!.]*"))  # no import left
    assert not list((tmp_path / "data").glob("[!.]*"))  # and no data set prepared for it
    assert_one_line_error(hprune("data", "fetch", "hf=opus-mt-en-de", f"paths.models_root={tmp_path / 'models'}",
                                 check=False), "pass hf=ORG/NAME")

    import sys

    from hprune import backend
    from hprune.errors import UserError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # an install without the hf extra
    with pytest.raises(UserError, match=r"pip install 'hprune\[hf\]'"):
        backend.import_hf(marian["dir"], tmp_path / "models")


def test_an_imported_model_exported_to_ctranslate2_scores_as_hprune(hf_model, tmp_path):
    """Marian's positions, decoder start vector and output bias, FSMT's separate vocabularies: the CTranslate2
    export of the imported model, with heads removed unevenly, gives its log-probabilities."""
    pytest.importorskip("ctranslate2")
    from hprune import backend
    from test_export import largest_log_prob_difference
    mask = {"enc-self": [[1, 0, 1, 1], [0, 0, 0, 1]], "dec-self": [[1, 1, 1, 0], [1, 0, 1, 1]],
            "dec-enc": [[0, 1, 1, 1], [1, 1, 0, 0]]}
    (tmp_path / "mask.json").write_text(json.dumps(mask))
    out = tmp_path / "export"
    test = f"{{src:{hf_model['root'] / 'test.en'},tgt:{hf_model['root'] / 'test.fr'}}}"
    hprune("export", f"ckpt={hf_model['dir']}", f"paths.models_root={tmp_path / 'models'}", "data=pretrained",
           f"data.test_sets=[{test}]", "data.max_pieces_per_word=null", f"mask={tmp_path / 'mask.json'}",
           "speed_split=test", "device=cpu", f"hydra.run.dir={out}")  # loss_split follows speed_split
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["subword_files"] and all((out / "ctranslate2" / name).is_file() for name in metrics["subword_files"])
    loaded = backend.load_model(Path(metrics["checkpoint"]), Path(metrics["data_bin"]))
    largest = largest_log_prob_difference(loaded, out / "ctranslate2", "test", mask)
    assert largest < 1e-4, largest
    print(f"{hf_model['dir'].name}: CTranslate2 export, max |log p| difference {largest:.1e}")
