"""`hprune export`: a CTranslate2 model directory built from an hprune model computes what hprune computes (the
same greedy translations, log-probabilities within 1e-4, the attention it returns), unpruned and with heads
removed unevenly (padded per stack); its own parity check tells the runtimes' design differences from a wrong
export, which it refuses; bad input is one line, nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import SMALL_DATA, hprune
from test_cli import assert_one_line_error

pytest.importorskip("fairseq")
ctranslate2 = pytest.importorskip("ctranslate2")

# one head left in an encoder layer, a decoder sublayer with none: the stacks are padded with zero heads
UNEVEN = {"enc-self": [[1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]],
          "dec-self": [[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 0]],
          "dec-enc": [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]}
GREEDY = ["generation.beam=1", "generation.max_len_b=200"]  # no translation cut by the length limit


def readme_translations(export_dir: Path, lines: list, max_length: int | None = None) -> list:
    """What the program in an export's README.md prints for `lines` (its own example sentence replaced), run as a
    user runs it: a fresh Python in the export folder, with nothing of hprune imported; max_length: its length
    limit replaced (the export's, where a weak model's search depends on it even for sentences that end well
    before)."""
    import re
    import subprocess
    import sys

    readme = (export_dir / "README.md").read_text()
    program = readme.split("```python\n", 1)[1].split("```", 1)[0]
    example = next(line for line in program.splitlines() if line.startswith("lines = "))
    program = program.replace(example, f"lines = {lines!r}")
    if max_length is not None:
        program, found = re.subn(r"max_decoding_length=\d+", f"max_decoding_length={max_length}", program)
        assert found == 1, program
    proc = subprocess.run([sys.executable, "-c", program], cwd=export_dir, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("\n")[:-1]


@pytest.fixture(scope="module")
def loaded(trained_run, evaluated_run):
    from hprune import backend
    return backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))


@pytest.mark.parametrize("masked", [False, True])
def test_ctranslate2_export_translates_and_scores_as_hprune(masked, trained_run, loaded, tmp_path):
    mask_args = []
    if masked:
        (tmp_path / "mask.json").write_text(json.dumps(UNEVEN))
        mask_args = [f"mask={tmp_path / 'mask.json'}"]
    out = tmp_path / "export"
    # min_len 8 on the masked export: eos kept out of the first 8 steps, which the runtimes do differently; the
    # translations it parts are told apart from a wrong export (by translating them again without it)
    hprune("export", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", *mask_args,
           *(["generation.min_len=8"] if masked else []))
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["ctranslate2_encoder_heads"], metrics["ctranslate2_decoder_heads"]) == ((4, 4) if masked else (4, 4))
    if masked:  # padded to 4 heads in every sublayer: none of the pruning survives in CTranslate2
        assert metrics["attention_macs_pct_mask"] < 100 == metrics["attention_macs_pct_ctranslate2"]
    assert metrics["parity_ended"] + metrics["parity_at_limit"] == 100 and metrics["parity_max_log_prob_diff"] < 1e-4
    explained = metrics["parity_ended_differ_min_len"] + metrics["parity_ended_differ_tie"]
    assert explained == metrics["parity_ended_differ"]  # else the export had failed
    assert metrics["translations_differ"] <= metrics["parity_ended_differ"] + metrics["parity_at_limit_differ"]
    print({key: value for key, value in metrics.items() if key.startswith("parity_")})
    hprune("eval", f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'eval'}", *SMALL_DATA, "device=cpu", *GREEDY,
           *mask_args)
    ours = (tmp_path / "eval" / "hypotheses.test.txt").read_text().splitlines()

    from hprune import backend
    sources = [source for source, _ in backend.split_symbols(loaded, "test")]
    translator = ctranslate2.Translator(str(out / "ctranslate2"), device="cpu", compute_type="float32")
    results = translator.translate_batch(sources, beam_size=1, max_decoding_length=250,
                                         min_decoding_length=1)
    theirs = [" ".join(r.hypotheses[0]).replace("@@ ", "") for r in results]
    # every translation that ended (eos before 200 tokens, below both limits) is the same; the model is young
    # enough that a few loop until a limit, which the two runtimes set differently
    ended = [n for n, r in enumerate(results) if len(r.hypotheses[0]) < 200]
    assert len(ended) >= 0.9 * len(sources) and len({ours[n] for n in ended}) > 20
    assert [theirs[n] for n in ended] == [ours[n] for n in ended]

    # log-probabilities of the reference translations, against the model under the same mask
    largest = largest_log_prob_difference(loaded, out / "ctranslate2", "test", UNEVEN if masked else None)
    assert largest < 1e-4, largest
    identical = sum(a == b for a, b in zip(theirs, ours))
    print(f"{'uneven mask' if masked else 'unpruned'}: {len(ended)}/{len(sources)} greedy translations ended before "
          f"the limits, {identical}/{len(sources)} identical; max |log p| difference {largest:.1e}")


def test_beam_search_bleu_is_hprune_evals_and_int8_is_within_a_point(trained_run, evaluated_run, loaded, tmp_path):
    """Beam 5 with fairseq's length penalty (1.0) and its length limit (1.2 |source| + 10): the float32
    export's BLEU within 0.2 of `hprune eval`'s, as `hprune export` measures it and as translated here one
    sentence at a time; int8's within 1 point of float32's."""
    from hprune import backend
    from hprune.evaluation import score
    exported = {}
    for quantization in ("none", "int8"):
        out = tmp_path / quantization
        hprune("export", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
               f"quantization={quantization}")
        exported[quantization] = json.loads((out / "metrics.json").read_text())
    float32, int8 = exported["none"], exported["int8"]
    assert float32["bleu_hprune"] == evaluated_run[1]["bleu"]  # the unpruned model, as `hprune eval` scores it
    assert abs(float32["bleu"] - float32["bleu_hprune"]) <= 0.2 and abs(int8["bleu"] - float32["bleu"]) <= 1.0

    references = (Path(evaluated_run[1]["data_bin"]).parent / "raw" / "test.tgt").read_text().splitlines()
    translator = ctranslate2.Translator(str(tmp_path / "none" / "ctranslate2"), device="cpu")
    ours = [" ".join(translator.translate_batch([source], beam_size=5, length_penalty=1.0, max_decoding_length=int(
        1.2 * (len(source) + 1) + 10))[0].hypotheses[0]).replace("@@ ", "")
        for source, _ in backend.split_symbols(loaded, "test")]
    assert abs(score(ours, references).bleu - evaluated_run[1]["bleu"]) <= 0.2
    print(f"beam 5: BLEU {float32['bleu']:.2f} (float32; {score(ours, references).bleu:.2f} one sentence at a "
          f"time), {int8['bleu']:.2f} (int8) against hprune eval's {evaluated_run[1]['bleu']:.2f}; "
          f"{float32['translations_differ']}/{len(ours)} float32 translations differ from hprune's")


def largest_log_prob_difference(loaded, model_dir: Path, split: str, mask) -> float:
    """The largest |log p| difference over every target token of a split's reference translations, CTranslate2's
    float32 scores against hprune's model under `mask` (teacher-forced, one sentence at a time)."""
    from hprune import backend
    sentences = backend.split_symbols(loaded, split)
    translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type="float32")
    scored = translator.score_batch([source for source, _ in sentences], [target for _, target in sentences])
    src_dict, tgt_dict = loaded.task.source_dictionary, loaded.task.target_dictionary
    largest = 0.0
    loaded.model.set_head_mask(mask)
    try:
        with torch.no_grad():
            for (source, target), result in zip(sentences, scored):
                src = torch.tensor([[src_dict.index(w) for w in source] + [src_dict.eos()]])
                tgt = [tgt_dict.index(w) for w in target] + [tgt_dict.eos()]
                prev = torch.tensor([[tgt_dict.eos()] + tgt[:-1]])
                logits = loaded.model(src, torch.tensor([src.size(1)]), prev)
                mine = loaded.model.get_normalized_probs(logits, log_probs=True)[0, torch.arange(len(tgt)), tgt]
                largest = max(largest, (mine - torch.tensor(result.log_probs)).abs().max().item())
    finally:
        loaded.model.set_head_mask(None)
    return largest


def test_bad_export_settings_are_one_line(trained_run, tmp_path):
    (tmp_path / "mask.json").write_text(json.dumps({"enc-self": [[1, 1]]}))
    soft = json.loads(json.dumps(UNEVEN))
    soft["enc-self"][1][2] = 0.5  # `hprune eval` scales the head by it; an export cannot
    (tmp_path / "soft.json").write_text(json.dumps(soft))
    for extra, expected in ((["format=onnx"], "format=onnx is not one of ctranslate2, fairseq"),
                            (["quantization=int4"], "quantization=int4 is not one of"),
                            ([f"mask={tmp_path / 'mask.json'}"], "mask"),
                            ([f"mask={tmp_path / 'soft.json'}"], "0.5 for enc-self layer 1 head 2"),
                            ([f"mask={tmp_path / 'soft.json'}", "format=fairseq"], "holds 0 (removed) or 1 (kept)")):
        out = tmp_path / "out"
        proc = hprune("export", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", *extra,
                      check=False)
        assert_one_line_error(proc, expected)
        assert not (out / "ctranslate2").exists() and not (out / "metrics.json").exists()
        assert not (out / "checkpoints").exists()


def test_an_export_that_computes_otherwise_is_refused_and_nothing_is_written(trained_run, monkeypatch, tmp_path):
    """The export's own check: a CTranslate2 model whose weights are off (here one FFN scaled by 1 %) gives other
    log-probabilities than hprune's model: one line, no model directory, no metrics.json."""
    from hprune.deploy import ctranslate2 as writer
    original = writer._ffn

    def off(spec, layer):
        original(spec, layer)
        spec.linear_1.weight = spec.linear_1.weight * 1.01
    monkeypatch.setattr(writer, "_ffn", off)
    out = tmp_path / "export"
    proc = hprune("export", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", check=False)
    assert_one_line_error(proc, "other log-probabilities than hprune's model", "nothing was written")
    assert not (out / "metrics.json").exists() and not list(out.glob("ctranslate2*"))


def test_parity_explains_what_min_len_parts_and_nothing_else(loaded, tmp_path):
    """check_parity's classification, with hprune's side stood in for: a translation that differs before the
    length limit is explained when the runtimes agree on it without the eos masking (min_len 0), and listed
    (the export refused) when they do not, unless what they pick then scores the same (a tie); log-probabilities
    off by more than rounding are refused."""
    from omegaconf import OmegaConf

    from hprune import backend
    from hprune.deploy import ctranslate2 as writer
    model_dir = export_model(loaded, None, tmp_path)
    generation = OmegaConf.create({"beam": 2, "lenpen": 1.0, "max_len_a": 1.2, "max_len_b": 10, "min_len": 1})
    sources = [source for source, _ in backend.split_symbols(loaded, "test", 20)]
    limits = writer.length_limits(sources, generation, 1024)
    theirs = writer.translate(model_dir, sources, generation, limits)
    ours = [list(t) for t in theirs]
    ours[3] = ours[3][:-1]  # ended, and differs
    assert len(ours[3]) < limits[3]

    class Stand:
        def __init__(self, again, shift=0.0):
            self.again, self.shift = again, shift

        def score_pairs(self, pairs):
            return [[p + self.shift for p in row] for row in writer.score(model_dir, pairs)]

        def translate_each(self, retried, unmasked):
            assert unmasked.min_len == 0 and retried == [sources[3]]
            return [self.again]

    class Tie(Stand):  # hprune's pick without the masking scores as CTranslate2's does
        def __init__(self, again, same_as):
            super().__init__(again)
            self.same_as = same_as

        def score_pairs(self, pairs):
            return super().score_pairs([(s, self.same_as if t == self.again else t) for s, t in pairs])
    references = backend.split_symbols(loaded, "test", 5)
    _, agreed = writer.check_parity(model_dir, sources, ours, generation, limits, references, Stand(theirs[3]), True)
    assert (agreed.ended_differ, agreed.min_len, agreed.ties, agreed.unexplained, agreed.failure()) == (1, 1, 0, [], None)
    assert agreed.ended + agreed.at_limit == 20 and agreed.max_log_prob_diff == 0
    _, parted = writer.check_parity(model_dir, sources, ours, generation, limits, references, Stand(ours[3]), True)
    assert parted.unexplained == [3] and "1 of the CTranslate2 export's translations differ" in parted.failure()
    tie = ours[3] + ["<unk>"]  # another pick, as likely as CTranslate2's under the scores stood in for
    _, tied = writer.check_parity(model_dir, sources, ours, generation, limits, references, Tie(tie, theirs[3]), True)
    assert (tied.ties, tied.min_len, tied.failure()) == (1, 0, None)
    _, off = writer.check_parity(model_dir, sources, ours, generation, limits, references, Stand(theirs[3], 0.01), True)
    assert "other log-probabilities" in off.failure()
    _, half = writer.check_parity(model_dir, sources, ours, generation, limits, references, Stand(ours[3], 0.01), False)
    assert half.failure() is None and half.unexplained == []  # half precision: rounding may part them; not classified


# per_stack: 2 heads in every sublayer, the last cross-attention's kept heads not the first ones; padded: the last
# cross-attention keeps 1 head where the decoder stack holds 3; none: the last cross-attention keeps no head
ATTENTION_MASKS = {
    "unpruned": None,
    "per_stack": {"enc-self": [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 0, 0]],
                  "dec-self": [[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1]],
                  "dec-enc": [[0, 1, 1, 0], [1, 0, 1, 0], [0, 1, 0, 1]]},
    "padded": {"enc-self": [[1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]],
               "dec-self": [[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]],
               "dec-enc": [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]},
    "none_in_the_last_layer": {"enc-self": [[1, 1, 1, 1]] * 3, "dec-self": [[1, 1, 1, 1]] * 3,
                               "dec-enc": [[1, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]]},
}


def export_model(loaded, mask, tmp_path: Path, name: str = "model") -> str:
    from hprune import backend
    from hprune.deploy import ctranslate2 as writer
    from hprune.pruning.heads import kept_ids, mask_without
    model = backend.pruned_model(loaded, kept_ids(mask or mask_without(loaded.model, ())))
    spec = writer.model_spec(model, loaded.cfg.model, loaded.task.source_dictionary, loaded.task.target_dictionary)
    (tmp_path / name).mkdir()
    writer.save(spec, tmp_path / name, "none")
    return str(tmp_path / name)


@pytest.mark.parametrize("name", list(ATTENTION_MASKS))
def test_returned_attention_is_hprunes_averaged_cross_attention(name, loaded, monkeypatch, tmp_path):
    """`return_attention` (and `replace_unknowns` through it) gives fairseq's attention: the last decoder layer's
    cross-attention averaged over the heads it keeps, as hprune's pruned model and its model under the mask
    return it (the last layer that keeps a head where the last keeps none), over the source words (CTranslate2
    leaves out the eos column); measured against the old default (head 0 of the last layer) too."""
    from hprune import backend
    from hprune.deploy import ctranslate2 as writer
    from hprune.pruning.heads import kept_ids
    mask = ATTENTION_MASKS[name]
    sources = [source for source, _ in backend.split_symbols(loaded, "test")]
    pruned = backend.pruned_model(loaded, kept_ids(mask)) if mask else loaded.model
    layer, heads = writer.alignment(pruned.decoder)
    assert (layer, heads) == {"unpruned": (2, 4), "per_stack": (2, 2), "padded": (2, 1),
                              "none_in_the_last_layer": (1, 2)}[name]

    def returned(model_dir):
        translator = ctranslate2.Translator(model_dir, device="cpu", compute_type="float32")
        return translator.translate_batch(sources, beam_size=1, return_attention=True, max_decoding_length=40)
    results = returned(export_model(loaded, mask, tmp_path))
    with monkeypatch.context() as patch:  # what the export returned before: CTranslate2's default, head 0
        patch.setattr(writer, "alignment", lambda decoder: (len(decoder.layers) - 1, 1))
        before = returned(export_model(loaded, mask, tmp_path, "head_0"))
    src_dict, tgt_dict = loaded.task.source_dictionary, loaded.task.target_dictionary
    agree = {"now": 0, "before": 0}
    tokens = largest = 0
    for source, result, old in zip(sources, results, before):
        hypothesis = result.hypotheses[0]
        src = torch.tensor([[src_dict.index(w) for w in source] + [src_dict.eos()]])
        prev = torch.tensor([[tgt_dict.eos()] + [tgt_dict.index(w) for w in hypothesis]])
        theirs = torch.tensor(result.attention[0])
        for model, model_mask in ((pruned, None), (loaded.model, mask)):  # pruned, and masked: the same attention
            model.set_head_mask(model_mask)
            try:
                with torch.no_grad():
                    ours = model(src, torch.tensor([src.size(1)]), prev, alignment_layer=layer)[1]["attn"][0][0]
            finally:
                model.set_head_mask(None)
            ours = ours[:len(hypothesis), :len(source)]  # CTranslate2 leaves out the source's eos column
            assert theirs.shape == ours.shape
            largest = max(largest, (theirs - ours).abs().max().item())
        agree["now"] += (theirs.argmax(-1) == ours.argmax(-1)).sum().item()
        if old.hypotheses[0] == hypothesis:  # the same tokens: head 0's argmax set against the average's
            agree["before"] += (torch.tensor(old.attention[0]).argmax(-1) == ours.argmax(-1)).sum().item()
        tokens += len(hypothesis)
    assert largest < 1e-4 and agree["now"] == tokens, (largest, agree, tokens)
    print(f"{name}: alignment layer {layer}, {heads} head(s) averaged; the same source position is the argmax for "
          f"{agree['now']} of {tokens} target tokens (largest difference {largest:.1e}); CTranslate2's default "
          f"(head 0 of the last layer): {agree['before']} of {tokens}")


def test_a_decoder_output_dim_checkpoint_exports(evaluated_run, tmp_path):
    """A stock checkpoint trained with --decoder-output-dim (a project_out without a project_in) is written with
    the projection it has and computes the log-probabilities of the stock model."""
    from hprune import backend
    from test_stock_recipes import COMMON
    data_bin = Path(evaluated_run[1]["data_bin"])
    common = COMMON[:COMMON.index("--max-update") + 1] + ["30"] + COMMON[COMMON.index("--max-update") + 2:]
    backend.train([str(data_bin), "-s", "src", "-t", "tgt", "--arch", "transformer", "--decoder-output-dim", "16",
                   *common, "--save-dir", str(tmp_path / "stock")])
    stock = backend.load_model(tmp_path / "stock" / "checkpoint_last.pt", data_bin, languages=("src", "tgt"))
    assert stock.model.decoder.project_in_dim is None and stock.model.decoder.project_out_dim is not None
    model_dir = Path(export_model(stock, None, tmp_path))
    largest = largest_log_prob_difference(stock, model_dir, "valid", None)
    print(f"--decoder-output-dim 16: largest log-probability difference {largest:.1e}")
    assert largest < 1e-4, largest


def test_what_ctranslate2_cannot_hold_is_refused_in_one_line(monkeypatch):
    from types import SimpleNamespace

    from hprune.deploy.ctranslate2 import model_spec
    from hprune.errors import UserError
    moa = SimpleNamespace(moa_layers=lambda: iter([("enc-self", 0, None)]))
    with pytest.raises(UserError, match="no mixture-of-attention-heads layer; export MoA models with format=fairseq"):
        model_spec(moa, SimpleNamespace(), None, None)
    monkeypatch.setitem(__import__("sys").modules, "ctranslate2", None)  # as if it were not installed
    with pytest.raises(UserError, match=r"pip install 'hprune\[deploy\]'"):
        model_spec(moa, SimpleNamespace(), None, None)


@pytest.mark.parametrize("tokenization", ["synthetic", "subword_nmt", "sentencepiece"])
def test_the_readme_program_translates_as_the_export(tokenization, trained_run, tmp_path):
    """The program an export's README.md shows, run as written in a fresh Python with CTranslate2 and the
    tokenizers alone, prints the export's own translations of the test sources, given as text: the synthetic
    task (the text is the tokens), your text with Moses + subword-nmt BPE, and with sentencepiece (a multilingual
    model's: tests/test_hf_multilingual.py). Every translation's length limit is the README's one (256)."""
    from wmt_fixtures import corpus
    limit = ["generation.beam=2", "generation.max_len_a=0", "generation.max_len_b=256", "device=cpu"]
    if tokenization == "synthetic":
        run, data = trained_run, list(SMALL_DATA)
    else:
        pairs = corpus(300, seed=31)
        for split, rows in (("train", pairs[:280]), ("test", pairs[280:])):
            for side, lang in enumerate(("en", "de")):
                (tmp_path / f"{split}.{lang}").write_text("".join(row[side] + "\n" for row in rows))
        data = ["data=text", "data.src_lang=en", "data.tgt_lang=de", f"data.train={tmp_path / 'train'}",
                f"data.test={tmp_path / 'test'}", f"data.bpe={tokenization}", "data.bpe_size=150",
                "data.valid_every=20", "data.workers=1"]
        run = tmp_path / "run"  # a model a few updates old: what it says does not matter, only that both say it
        hprune("train", f"hydra.run.dir={run}", *data, "optim.max_update=3", "optim.warmup_updates=1", "device=cpu")
    out = tmp_path / "export"
    hprune("export", f"ckpt={run}", f"hydra.run.dir={out}", *data, *limit)
    exported = (out / "hypotheses" / "ctranslate2.txt").read_text().splitlines()
    data_bin = Path(json.loads((out / "metrics.json").read_text())["data_bin"])
    # the synthetic task's text is its pieces (pieces/; raw/ holds the words BLEU sees)
    given = data_bin.parent / "pieces" / "test.src" if tokenization == "synthetic" else tmp_path / "test.en"
    assert readme_translations(out / "ctranslate2", given.read_text().splitlines()) == exported
