"""The multilingual Hugging Face translation models: M2M100, NLLB-200 and mBART-50. Tiny models built from
transformers' own config and tokenizer classes (sentencepiece models learnt from toy text, the tokenizers'
real layouts: M2M100's vocab.json and __xx__ tokens, NLLB's and mBART-50's tokenizer.json with their language
codes), trained a hundred steps so that their translations depend on the source, saved with save_pretrained.
Once imported, hprune encodes a language pair as their tokenizers do (ids), gives their log-probabilities, with
and without heads, and their greedy translations (`generate` with the target language forced first); every
verb takes them (tests/test_hf.py does the same for FSMT and Marian)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import hprune
from test_cli import assert_one_line_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("fairseq")
from hf_models import BUILDERS  # noqa: E402  (needs transformers)
from test_hf import without_heads  # noqa: E402

MAX_LEN = 20  # as test_hf.py: fairseq's max_len_b; transformers' max_length counts the start and eos too
FAMILIES = ("m2m100", "nllb", "mbart50")


def toy_text(evaluated_run, split: str, n: int) -> dict:
    raw = Path(evaluated_run[1]["data_bin"]).parent / "raw"
    return {lang: (raw / f"{split}.{toy}").read_text().splitlines()[:n] for lang, toy in zip(("en", "fr"), ("src", "tgt"))}


@pytest.fixture(scope="module")
def built(evaluated_run, tmp_path_factory) -> dict:
    """Each family's tiny model, built once for the module ({family: model})."""
    models: dict = {}

    def build(family: str) -> dict:
        if family not in models:
            root = tmp_path_factory.mktemp(family)
            models[family] = BUILDERS[family](root, toy_text(evaluated_run, "train", 800))
            for split, source, n in (("test", "test", 30), ("valid", "train", 40)):
                for lang, lines in toy_text(evaluated_run, source, n).items():
                    (root / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines))
        return models[family]
    return build


@pytest.fixture(params=FAMILIES)
def multilingual(request, built) -> dict:
    return built(request.param)


@pytest.fixture
def nllb(built) -> dict:
    return built("nllb")


def own_text(hf: dict, split: str = "test") -> str:
    return f"{{src:{hf['root'] / f'{split}.en'},tgt:{hf['root'] / f'{split}.fr'}}}"


def pair(hf: dict) -> list[str]:
    src, tgt = hf["languages"]
    return [f"data.src_lang={src}", f"data.tgt_lang={tgt}"]


def test_a_multilingual_model_encodes_scores_and_translates_as_transformers(multilingual, tmp_path):
    """Ids: every source and target of the test set binarized as the tokenizer encodes it (language tokens
    included). Log-probabilities within 1e-4 of transformers', unpruned, masked and physically pruned against
    transformers' model with the same heads' projections zeroed. Greedy: every translation equal to
    generate(num_beams=1) with the target language forced first."""
    from hprune import backend
    hf, out = multilingual, tmp_path / "eval"
    models = f"paths.models_root={tmp_path / 'models'}"
    hprune("eval", f"ckpt={hf['dir']}", models, *pair(hf), f"data.test_sets=[{own_text(hf)}]",
           "data.max_pieces_per_word=null", "generation.beam=1", "generation.max_len_a=0",
           f"generation.max_len_b={MAX_LEN}", "device=cpu", f"hydra.run.dir={out}")
    metrics = json.loads((out / "metrics.json").read_text())
    tok, theirs = hf["tokenizer"], hf["model"]
    test = {lang: (hf["root"] / f"test.{lang}").read_text().splitlines() for lang in ("en", "fr")}
    encoded = tok(test["en"], text_target=test["fr"])
    checkpoint = backend.resolve_checkpoint(str(hf["dir"]), tmp_path / "models")
    loaded = backend.load_model(checkpoint, Path(metrics["data_bin"]), languages=tuple(hf["languages"]))
    dictionary = loaded.task.source_dictionary
    pairs = backend.split_symbols(loaded, "test")
    ids = [([dictionary.index(t) for t in s] + [2], [dictionary.index(t) for t in t_] + [2]) for s, t_ in pairs]
    assert [s for s, _ in ids] == encoded["input_ids"] and [t for _, t in ids] == encoded["labels"]

    def largest_difference(model, reference) -> float:
        largest = 0.0
        with torch.no_grad():
            for source, target in ids[:10]:
                src, prev = torch.tensor([source]), torch.tensor([[2] + target[:-1]])
                ours = model.get_normalized_probs(model(src_tokens=src, src_lengths=torch.tensor([len(source)]),
                                                        prev_output_tokens=prev), log_probs=True)[0]
                hf_logits = reference(input_ids=src, decoder_input_ids=prev, use_cache=False).logits[0]
                largest = max(largest, (ours - torch.log_softmax(hf_logits, -1)).abs().max().item())
        return largest

    full = largest_difference(loaded.model, theirs)
    mask = {"enc-self": [[1, 0, 1, 1], [0, 0, 1, 1]], "dec-self": [[1, 1, 1, 0], [1, 0, 1, 1]],
            "dec-enc": [[0, 1, 1, 1], [1, 1, 0, 0]]}
    removed = without_heads(theirs, mask, hf["attention"])
    loaded.model.set_head_mask(mask)
    masked = largest_difference(loaded.model, removed)
    loaded.model.set_head_mask(None)
    pruned = backend.pruned_model(loaded, {kind: [[h for h, kept in enumerate(row) if kept] for row in rows]
                                           for kind, rows in mask.items()})
    physical = largest_difference(pruned, removed)
    assert max(full, masked, physical) <= 1e-4, (full, masked, physical)
    assert largest_difference(loaded.model, removed) > 1e-2  # the heads mattered

    ours = (out / "hypotheses.test.txt").read_text().splitlines()
    inputs = tok(test["en"], return_tensors="pt", padding=True)
    with torch.no_grad():
        # fairseq's limit counts the forced language token, then forces eos; transformers' counts the start token
        # too, and forces eos within it where the model says so (mBART's forced_eos_token_id)
        longest = MAX_LEN + 1 + (getattr(theirs.generation_config, "forced_eos_token_id", None) is not None)
        generated = theirs.generate(**inputs, num_beams=1, do_sample=False, max_length=longest,
                                    forced_bos_token_id=hf["forced_bos"], suppress_tokens=[hf["pad"]])
    # after the start and the language token; a last piece "▁" leaves transformers a trailing space, which
    # fairseq's sentencepiece decoding strips
    hyps = [h.strip() for h in tok.batch_decode(generated[:, 2:], skip_special_tokens=True)]
    assert ours == hyps
    assert len(set(hyps)) >= len(hyps) / 2, "the translations hardly depend on the source"
    if hf["dir"].name.startswith("mbart"):  # the Hub's mBART-50 folder may lack tokenizer.json: the same ids
        bare = tmp_path / hf["dir"].name
        shutil.copytree(hf["dir"], bare, ignore=shutil.ignore_patterns("tokenizer.json"))
        without = backend.import_hf(bare, tmp_path / "models").parent
        for name in ("dict.txt", "hprune.yaml"):
            assert (without / name).read_text().replace(str(bare), "") == \
                (checkpoint.parent / name).read_text().replace(str(hf["dir"]), "")
    print(f"{hf['dir'].name}: max |log p| difference {full:.1e} (masked {masked:.1e}, pruned {physical:.1e}); "
          f"greedy {sum(a == b for a, b in zip(ours, hyps))}/{len(hyps)} identical, {len(set(hyps))} distinct")


def test_every_verb_takes_a_multilingual_model(nllb, tmp_path):
    """NLLB's tiny model through prune (Michel's order by stack, then fisher at half the attention MACs), the
    export to fairseq (stock fairseq-generate translates as hprune) and to CTranslate2 (its parity check: the
    target language given as target_prefix), and analyze."""
    pytest.importorskip("ctranslate2")
    from test_stock_fairseq import fairseq_generate
    common = [f"ckpt={nllb['dir']}", f"paths.models_root={tmp_path / 'models'}", *pair(nllb),
              f"data.test_sets=[{own_text(nllb)}]", f"data.valid_sets=[{own_text(nllb, 'valid')}]",
              f"data.train_sets=[{own_text(nllb, 'valid')}]",
              "data.max_pieces_per_word=null", "device=cpu", "generation.beam=2", "generation.lenpen=1.0",
              "generation.max_len_a=1.2", "generation.max_len_b=10"]
    out = tmp_path / "prune"
    hprune("prune", "--method", "michel", *common, "prune.step_pct=50", "prune.target_pct=50", "prune.export=true",
           "prune.layout=per_stack", f"hydra.run.dir={out}")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["export_same_translations"]
    evaluated = tmp_path / "exported"
    imported = next((tmp_path / "models" / "hf").glob("nllb-200-tiny-*"))
    hprune("eval", f"ckpt={metrics['export_checkpoint']}", "data=pretrained", *common[1:], f"data.model_dir={imported}",
           f"hydra.run.dir={evaluated}")
    data_bin = Path(json.loads((evaluated / "metrics.json").read_text())["data_bin"])
    stock = fairseq_generate(data_bin, Path(metrics["export_checkpoint"]), "--post-process", "sentencepiece",
                             "--prefix-size", "1", "--beam", "2")
    assert [line.removeprefix("fra_Latn").strip() for line in stock] == \
        (evaluated / "hypotheses.test.txt").read_text().splitlines()
    fisher = tmp_path / "fisher"
    hprune("prune", "--method", "fisher", *common, "prune.macs_budget=0.5", f"hydra.run.dir={fisher}")
    assert json.loads((fisher / "metrics.json").read_text())["attention_macs_pct"] <= 50.0
    exported = tmp_path / "ctranslate2"
    hprune("export", *common, f"mask={out / 'head_mask.json'}", "format=ctranslate2", f"hydra.run.dir={exported}")
    ct2 = json.loads((exported / "metrics.json").read_text())
    assert ct2["parity_ended_differ"] == ct2["parity_ended_differ_min_len"] + ct2["parity_ended_differ_tie"]
    assert ct2["parity_max_log_prob_diff"] < 1e-3 and ct2["ctranslate2_encoder_heads"] == 2
    readme = (exported / "ctranslate2" / "README.md").read_text()
    assert "target_prefix=[['fra_Latn']]" in readme and "['eng_Latn'] + t" in readme
    analysed = tmp_path / "analyze"
    hprune("analyze", *common[:-4], "split=test", f"hydra.run.dir={analysed}")
    import pandas as pd
    assert len(pd.read_csv(analysed / "head_roles.csv")) == 24
    # the language tokens are no word: an alignment's word indices are the text's
    from hprune import backend
    from hprune.analysis.alignment import word_texts
    pairs = backend.split_symbols(backend.load_model(Path(metrics["export_checkpoint"]), data_bin), "test")
    assert pairs[0][0][0] == "eng_Latn" and pairs[0][1][0] == "fra_Latn"
    words = [(word_texts(s, "sentencepiece", {"eng_Latn", "fra_Latn"}), word_texts(t, "sentencepiece", {"fra_Latn"}))
             for s, t in pairs]
    text = [(nllb["root"] / f"test.{lang}").read_text().splitlines() for lang in ("en", "fr")]
    assert words == [(s.split(), t.split()) for s, t in zip(*text)]


def test_multilingual_settings_that_cannot_work_are_one_line(nllb, tmp_path):
    models = f"paths.models_root={tmp_path / 'models'}"
    test = f"data.test_sets=[{own_text(nllb)}]"
    cases = (([], "holds a multilingual model", "data.tgt_lang="),
             (["data.src_lang=eng_Latn", "data.tgt_lang=fra_Lat"], "has no language 'fra_Lat'", "fra_Latn"),
             (["data.src_lang=english", "data.tgt_lang=fra_Latn"], "has no language 'english'"))
    for settings, *expected in cases:
        result = hprune("eval", f"ckpt={nllb['dir']}", models, test, *settings, "device=cpu",
                        f"hydra.run.dir={tmp_path / 'out'}", check=False)
        assert_one_line_error(result, *expected)
    assert not (tmp_path / "out" / "metrics.json").exists()
    bart = tmp_path / "bart"
    shutil.copytree(nllb["dir"], bart)
    (bart / "config.json").write_text(json.dumps({**json.loads((bart / "config.json").read_text()), "model_type": "bart"}))
    result = hprune("eval", f"ckpt={bart}", models, test, "device=cpu", f"hydra.run.dir={tmp_path / 'out'}", check=False)
    assert_one_line_error(result, "Hugging Face 'bart' model", "M2M100ForConditionalGeneration",
                          "MBartForConditionalGeneration", "MarianMTModel")


@pytest.mark.slow  # about 2 minutes: the methods that train (Voita's gates, DSP), and the other orders
def test_every_method_prunes_a_multilingual_model(nllb, tmp_path):
    """Voita's gates and DSP train the imported model with its language tokens in the data; LRP, confidence,
    magnitude and random order its heads; each run ends with its BLEU, per_stack where the method takes it."""
    common = [f"ckpt={nllb['dir']}", f"paths.models_root={tmp_path / 'models'}", *pair(nllb),
              f"data.test_sets=[{own_text(nllb)}]", f"data.valid_sets=[{own_text(nllb, 'valid')}]",
              f"data.train_sets=[{own_text(nllb, 'valid')}]", "data.max_pieces_per_word=null", "device=cpu",
              "generation.beam=1"]
    runs = {"voita": ["prune.optim.max_update=20", "prune.finetune.updates=0"],
            "dsp": ["prune.head_budget=12", "prune.optim.max_update=20", "prune.cooldown=10"],
            "michel": ["prune.step_pct=50", "prune.target_pct=50", "prune.layout=per_stack",
                       "prune.baselines=[lrp,confidence,magnitude,random]"]}
    for method, settings in runs.items():
        hprune("prune", "--method", method, *common, *settings, f"hydra.run.dir={tmp_path / method}")
    metrics = {method: json.loads((tmp_path / method / "metrics.json").read_text()) for method in runs}
    assert metrics["dsp"]["kept_heads"] == 12  # DSP keeps exactly K
    assert metrics["voita"]["kept_heads"] <= 8  # of the 8 gated encoder self-attention heads
    import pandas as pd
    curve = pd.read_csv(tmp_path / "michel" / "curve.csv")
    assert set(curve["order"]) == {"michel", "lrp", "confidence", "magnitude", "random"}
