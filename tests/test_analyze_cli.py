"""`hprune analyze` end to end on the small model, checked against a direct computation, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import SMALL_DATA, hprune
from hprune.analysis.alignment import read_pharaoh
from test_cli import assert_one_line_error

pytest.importorskip("fairseq")


def test_roles_table_summary_and_a_direct_check(trained_run, evaluated_run, tmp_path):
    from hprune import backend
    out = tmp_path / "run"
    mask = {kind: [[1, 0, 1, 1]] * 3 for kind in ("enc-self", "dec-self", "dec-enc")}
    (tmp_path / "mask.json").write_text(json.dumps(mask))
    hprune("analyze", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           f"mask={tmp_path / 'mask.json'}", subprocess=True)  # the analyze verb as its own process
    roles = pd.read_csv(out / "head_roles.csv")
    assert len(roles) == 36 and roles["confidence"].between(0, 1).all()
    enc = roles[roles["type"] == "enc-self"]
    assert enc["positional_prev"].notna().all() and "nsubj_dep->head" in roles.columns
    assert (enc["alive"] == [1, 0, 1, 1] * 3).all()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["syntactic_heads"] == int(enc["syntactic"].sum())
    assert "survived the mask" in (out / "summary.txt").read_text()
    for measure in ("confidence", "positional_prev", "rare_token"):
        assert (out / f"roles_{measure}.png").stat().st_size > 5_000

    # a second implementation: each raw sentence alone (no batching, no padding), previous-token and
    # rare-word shares of every enc-self head
    loaded = backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))
    dictionary = loaded.task.source_dictionary
    modules = [layer.self_attn for layer in loaded.model.encoder.layers]
    loaded.model.record_heads(weights=True)
    previous, rare, queries = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64), 0
    raw = Path(evaluated_run[1]["data_bin"]).parent / "pieces" / "valid.src"  # what the model reads
    for line in raw.read_text().splitlines():
        tokens = dictionary.encode_line(line, add_if_not_exist=False).long()
        counts = [dictionary.count[t] for t in tokens[:-1].tolist()]
        rarest = counts.index(min(counts))
        with torch.no_grad():
            loaded.model.encoder(tokens.unsqueeze(0), src_lengths=torch.tensor([len(tokens)]))
        for layer, module in enumerate(modules):
            argmax = module.head_weights[0, :, :-1].argmax(-1)  # (heads, words)
            previous[layer] += (argmax == torch.arange(argmax.size(1)) - 1).sum(-1)
            rare[layer] += (argmax == rarest).sum(-1)
        queries += len(tokens) - 1
    for column, expected in (("positional_prev", previous), ("rare_token", rare)):
        ours = torch.tensor(enc.sort_values(["layer", "head"])[column].to_numpy()).view(3, 4)
        torch.testing.assert_close(ours, expected / queries, atol=1e-12, rtol=0)


def test_bad_input(trained_run, tmp_path):
    bad_mask = tmp_path / "mask.json"
    bad_mask.write_text(json.dumps({"enc-self": [[1, 1]]}))
    args = [f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'run'}", *SMALL_DATA, "device=cpu"]
    assert_one_line_error(hprune("analyze", *args, f"mask={bad_mask}", check=False), "does not fit this model")
    assert_one_line_error(hprune("analyze", *args, f"arcs={tmp_path / 'none.jsonl'}", check=False),
                          "none.jsonl does not exist")
    assert not (tmp_path / "run" / "head_roles.csv").exists()


def test_alignment_heads_on_a_head_forced_along_the_gold_alignment(trained_run, tmp_path, monkeypatch):
    """Encoder-decoder layer 1, head 2 of the small model is made to attend, for every target piece, to the
    last piece of the source word the generator aligned its word to (EOS where none): analyze must find it an
    alignment head with AER 0, the best one, and dump its maps as they were."""
    from bertviz import model_view

    from hprune.analysis.alignment import word_ids
    from hprune.analysis.attention_maps import bertviz_inputs
    from hprune.session import Session

    layer, forced_head = 1, 2
    current, opened = {}, Session.open.__func__
    batches = Session.batches

    def remember(self, *args, **kwargs):
        for sample in batches(self, *args, **kwargs):
            current["sample"] = sample
            yield sample

    def force(module, inputs, output):
        session, sample = current["session"], current["sample"]
        source_dict, target_dict = session.dictionaries
        gold = current.setdefault("gold", read_pharaoh(session.data_bin.parent / "raw" / "valid.align"))
        for b, sentence in enumerate(sample["id"].tolist()):
            tokens = sample["net_input"]["src_tokens"][b]
            real = tokens.ne(session.pad).nonzero().squeeze(1).tolist()
            source = word_ids([source_dict[t] for t in tokens[real[:-1]].tolist()], "subword_nmt")
            length = int(sample["target"][b].ne(session.pad).sum())
            target = word_ids([target_dict[t] for t in sample["target"][b][:length - 1].tolist()], "subword_nmt")
            module.head_weights[b, forced_head] = 0
            for t, word in enumerate(target + [None]):
                aligned = sorted(i for i, j in gold[sentence][0] if j == word) if word is not None else []
                column = real[max(p for p, w in enumerate(source) if w == aligned[0])] if aligned else real[-1]
                module.head_weights[b, forced_head, t, column] = 1

    def open_forced(cls, *args, **kwargs):
        session = opened(cls, *args, **kwargs)
        current["session"] = session
        session.model.decoder.layers[layer].encoder_attn.register_forward_hook(force)
        return session

    monkeypatch.setattr(Session, "batches", remember)
    monkeypatch.setattr(Session, "open", classmethod(open_forced))
    out = tmp_path / "run"
    hprune("analyze", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", "lrp=false",
           "dump=100")  # every valid sentence
    roles = pd.read_csv(out / "head_roles.csv").set_index(["type", "layer", "head"])
    assert roles.loc[("dec-enc", layer, forced_head), "alignment_aer"] == 0
    assert roles.loc[("dec-enc", layer, forced_head), "alignment_share"] == 1
    assert roles.loc[("dec-enc", layer, forced_head), "alignment"]
    assert roles.xs("dec-self")["positional_prev"].between(0, 1).all() and len(roles) == 36
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["best_alignment_aer"], metrics["best_alignment_head"]) == (0, f"dec-enc {layer} {forced_head}")
    assert metrics["alignment_heads"] >= 1 and metrics["alignments_source"] == "data set"
    assert metrics["attention_maps"] == 100 and metrics["dec_self_positional_heads"] is not None

    # the dump: numpy arrays of the documented shapes, softmax rows, the forced head as it was forced
    maps = np.load(out / "attention" / "0.npz")
    source, target = len(maps["source_tokens"]), len(maps["target_tokens"])
    assert maps["enc_self"].shape == (3, 4, source, source) and maps["dec_self"].shape == (3, 4, target, target)
    assert maps["dec_enc"].shape == (3, 4, target, source) and maps["decoder_tokens"][0] == "</s>"
    np.testing.assert_allclose(maps["dec_enc"].sum(-1), 1, atol=1e-5)
    assert set(np.unique(maps["dec_enc"][layer, forced_head])) == {0.0, 1.0}
    html = model_view(**bertviz_inputs(out / "attention" / "0.npz"), html_action="return").data
    assert all(token in html for token in maps["source_tokens"].tolist())

    # a second reading of an unforced head's AER, from the dumped maps: words counted afresh, links summed
    gold = read_pharaoh(Path(metrics["alignments"]))
    counts = np.zeros(4)  # |A|, |A ∩ S|, |A ∩ P|, |S|
    for sentence, (sure, possible) in enumerate(gold):
        maps = np.load(out / "attention" / f"{sentence}.npz")

        def words(pieces):
            starts = [0] + [int(not previous.endswith("@@")) for previous in pieces[:-1]]
            return np.cumsum(starts).tolist()
        source, target = words(maps["source_tokens"][:-1].tolist()), words(maps["target_tokens"][:-1].tolist())
        best = maps["dec_enc"][2, 0][:len(target)].argmax(-1)
        links = {(source[s], target[t]) for t, s in enumerate(best) if s < len(source)}
        counts += (len(links), len(links & sure), len(links & possible), len(sure))
    expected = 1 - (counts[1] + counts[2]) / (counts[0] + counts[3])
    assert roles.loc[("dec-enc", 2, 0), "alignment_aer"] == pytest.approx(expected, abs=1e-12)

    # report.html draws the first sentence's maps, one (layer, head) grid per type
    hprune("report", str(out), f"hydra.run.dir={tmp_path / 'report'}", "attention_sentences=1", "plot_formats=[png]")
    assert sorted(p.name for p in (tmp_path / "report" / "plots").glob("*_attention_*")) == \
        [f"run_attention_0_{key}.png" for key in ("dec_enc", "dec_self", "enc_self")]
    assert "dec-enc attention, sentence 0: run" in (tmp_path / "report" / "report.html").read_text()


def test_alignments_bad_input(trained_run, tmp_path):
    args = [f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'run'}", *SMALL_DATA, "device=cpu", "lrp=false"]
    assert_one_line_error(hprune("analyze", *args, f"alignments={tmp_path / 'none.align'}", check=False),
                          "none.align does not exist")
    (tmp_path / "bad.align").write_text("0-0 x\n")
    assert_one_line_error(hprune("analyze", *args, f"alignments={tmp_path / 'bad.align'}", check=False),
                          "bad.align:1: 'x' is not a Pharaoh link")
    assert not (tmp_path / "run" / "head_roles.csv").exists()


def sure_links_aer(found, gold) -> float:
    counts = np.zeros(4)  # |A|, |A ∩ S|, |A ∩ P|, |S|: the found sure links scored against the gold ones
    for (sure, _), (gold_sure, gold_possible) in zip(found, gold):
        counts += (len(sure), len(sure & gold_sure), len(sure & gold_possible), len(gold_sure))
    return 1 - (counts[1] + counts[2]) / (counts[0] + counts[3])


def test_eflomal_beside_the_heads_is_scored_against_the_same_reference(trained_run, tmp_path):
    """aligner_baseline=eflomal: the heads are scored against the data set's gold alignments, and so is eflomal,
    its AER in metrics.json equal to the one counted here from the links it wrote."""
    pytest.importorskip("eflomal")
    out = tmp_path / "run"
    hprune("analyze", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", "lrp=false",
           "aligner_baseline=eflomal")
    metrics = json.loads((out / "metrics.json").read_text())
    gold = read_pharaoh(Path(metrics["data_bin"]).parent / "raw" / "valid.align")
    assert metrics["alignments_source"] == "data set" and metrics["eflomal_alignments"] == str(out / "eflomal.align")
    assert metrics["eflomal_aer"] == pytest.approx(sure_links_aer(read_pharaoh(out / "eflomal.align"), gold), abs=1e-4)
    assert metrics["eflomal_aer"] < 0.2 and "eflomal on the same sentences" in (out / "summary.txt").read_text()


def test_eflomal_reference_alignments_agree_with_the_gold_ones(trained_run, tmp_path):
    """alignments=eflomal: the aligner run on the split (with the training sentences), its links written to the
    run dir and used as the reference; against the generator's gold alignments, a second source of truth, its
    sure links are nearly all right."""
    pytest.importorskip("eflomal")
    out = tmp_path / "run"
    hprune("analyze", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", "lrp=false",
           "alignments=eflomal")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["alignments_source"] == "eflomal" and Path(metrics["alignments"]) == out / "reference.align"
    found = read_pharaoh(out / "reference.align")
    gold = read_pharaoh(Path(metrics["data_bin"]).parent / "raw" / "valid.align")  # the generator's
    assert len(found) == len(gold) == 100
    assert sure_links_aer(found, gold) < 0.2
    roles = pd.read_csv(out / "head_roles.csv")
    assert roles[roles["type"] == "dec-enc"]["alignment_aer"].between(0, 1).all()
