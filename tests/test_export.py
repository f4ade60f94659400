"""`hprune export`: a CTranslate2 model directory built from an hprune model computes what hprune computes (the
same greedy translations, log-probabilities within 1e-4), unpruned and with heads removed unevenly (padded per
stack); bad input is one line, nothing written."""
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
    hprune("export", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", *mask_args)
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["ctranslate2_encoder_heads"], metrics["ctranslate2_decoder_heads"]) == ((4, 4) if masked else (4, 4))
    if masked:  # padded to 4 heads in every sublayer: none of the pruning survives in CTranslate2
        assert metrics["attention_macs_pct_mask"] < 100 == metrics["attention_macs_pct_ctranslate2"]
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
    from hprune.session import score
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
    assert abs(score(ours, references)["bleu"] - evaluated_run[1]["bleu"]) <= 0.2
    print(f"beam 5: BLEU {float32['bleu']:.2f} (float32; {score(ours, references)['bleu']:.2f} one sentence at a "
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
    for extra, expected in ((["format=onnx"], "format=onnx is not one of ctranslate2, fairseq"),
                            (["quantization=int4"], "quantization=int4 is not one of"),
                            ([f"mask={tmp_path / 'mask.json'}"], "mask")):
        (tmp_path / "mask.json").write_text(json.dumps({"enc-self": [[1, 1]]}))
        out = tmp_path / "out"
        proc = hprune("export", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", *extra,
                      check=False)
        assert_one_line_error(proc, expected)
        assert not (out / "ctranslate2").exists() and not (out / "metrics.json").exists()


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
