"""Retraining-free pruning (Kwon et al. 2022): head-mask gradients against autograd, the greedy rearrangement on
a case worked by hand, mask tuning against a direct least-squares solve, and `--method fisher` end to end:
the budget met in MACs counted on the exported model, the stages recorded, bad input refused."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import SMALL_DATA, hprune

pytest.importorskip("fairseq")
FISHER = ["--method", "fisher", *SMALL_DATA, "device=cpu", "prune.calibration.sentences=128"]


@pytest.fixture(scope="module")
def loaded(trained_run, evaluated_run):
    from hprune import backend
    return backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))


def test_mask_gradients_equal_autograd_of_an_explicit_head_mask(loaded):
    """Per batch: the gradient of the batch's mean NLL per target token with respect to an explicit head mask.
    Per sentence: one batch's per-sentence rows are the gradients of batch-size-1 passes over the same
    sentences."""
    from hprune import backend
    from hprune.pruning.scores import mask_gradients, nll

    model, pad = loaded.model, loaded.task.target_dictionary.pad()
    batches = backend.sampled_batches(loaded, "valid", 6, 3, seed=1)
    heads, grads = mask_gradients(model, batches, pad, per="batch")
    assert grads.shape == (2, 36) and heads[0] == ("enc-self", 0, 0) and heads[-1] == ("dec-enc", 2, 3)
    model.eval()
    for b, sample in enumerate(batches):
        leaves = []
        for _, _, module in model.attention_modules():
            module.head_mask = torch.ones(module.num_heads, requires_grad=True)
            leaves.append(module.head_mask)
        loss, tokens = nll(model, sample, pad)
        (loss / tokens).backward()
        torch.testing.assert_close(torch.cat([leaf.grad for leaf in leaves]).double(), grads[b], rtol=1e-4, atol=1e-7)
        model.set_head_mask(None)
    _, per_sentence = mask_gradients(model, batches, pad, per="sentence")  # rows in the batches' sentence order
    singles = backend.sampled_batches(loaded, "valid", 6, 1, seed=1)
    _, one_at_a_time = mask_gradients(model, singles, pad)
    ids = [i for sample in batches for i in sample["id"].tolist()]  # a batch is collated longest source first
    order = [ids.index(i) for sample in singles for i in sample["id"].tolist()]
    assert per_sentence.shape == (6, 36) and sorted(order) == list(range(6))
    # fp32 through padded and unpadded passes: sums in another order, so agreement to fp32 rounding, not bits
    torch.testing.assert_close(per_sentence[order], one_at_a_time, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(per_sentence.view(2, 3, 36).sum(1) / torch.tensor([[float(nll(model, s, pad)[1])]
                                                                                  for s in batches]).double(),
                               grads, rtol=1e-5, atol=1e-8)  # a batch's mean: its sentences' sum over its tokens


def test_calibration_sentences_are_drawn_at_random_with_lengths_mixed(loaded):
    from hprune import backend

    first = backend.sampled_batches(loaded, "valid", 40, 8, seed=1)
    again = backend.sampled_batches(loaded, "valid", 40, 8, seed=1)
    other = backend.sampled_batches(loaded, "valid", 40, 8, seed=2)
    ids = lambda batches: [i for b in batches for i in b["id"].tolist()]  # noqa: E731
    assert len(ids(first)) == len(set(ids(first))) == 40 and ids(first) == ids(again) != ids(other)
    assert ids(first) != sorted(ids(first))  # drawn, not read in order
    lengths = [set(b["net_input"]["src_lengths"].tolist()) for b in first]
    assert sum(len(batch) > 1 for batch in lengths) >= 3  # fairseq's iterator would bucket every batch to one length


def test_rearrangement_on_a_case_worked_by_hand():
    """Three heads, two to prune. Alone, c has the smallest Fisher (0.5² + 0.5²), a and b tie (2): the search
    prunes c and a, whose summed gradient (1.5, 1.5) costs 4.5. a and b cancel (Σ = 0): the greedy swap offers
    b, then drops c from the pruned set, and keeps c instead."""
    from hprune.methods.fisher import rearrange

    heads = [("enc-self", 0, 0), ("enc-self", 0, 1), ("enc-self", 0, 2)]  # a, b, c
    grads = torch.tensor([[1.0, -1.0, 0.5], [1.0, -1.0, 0.5]], dtype=torch.float64)  # (batches, heads)
    assert rearrange({heads[1]}, heads, grads, ["enc-self"]) == {heads[2]}
    # another layer is rearranged on its own; a layer with nothing pruned is left alone
    more = heads + [("dec-enc", 1, 0), ("dec-enc", 1, 1)]
    grads = torch.cat([grads, torch.tensor([[3.0, 0.1], [3.0, 0.1]], dtype=torch.float64)], dim=1)
    assert rearrange({heads[1], more[3], more[4]}, more, grads, ["enc-self", "dec-enc"]) == {heads[2], more[3], more[4]}


def test_mask_tuning_is_the_least_squares_solution_and_lowers_the_error(loaded):
    """Student: heads 1 and 3 of encoder layer 1 masked; teacher: the unpruned model. The normal equations
    accumulated over batches give the scales torch.linalg.lstsq gives on the stacked system, built here from the
    layer's input and the heads' outputs; the fitted scales reconstruct the teacher's sublayer output better than
    the untuned mask."""
    from hprune import backend
    from hprune.methods.fisher import least_squares
    from hprune.pruning.heads import mask_without

    model = copy.deepcopy(loaded.model).eval()
    teacher = copy.deepcopy(loaded.model).eval()
    pad = loaded.task.target_dictionary.pad()
    model.set_head_mask(mask_without(model, {("enc-self", 1, 1), ("enc-self", 1, 3)}))
    batches = list(backend.batches(loaded, "valid", 600, 2))
    gram, target = least_squares(model, teacher, "enc-self", 1, batches, pad, units=[0, 2])
    ours = torch.linalg.lstsq(gram, target.unsqueeze(-1)).solution.squeeze(-1)

    rows, goals = [], []
    layer_s, layer_t = model.encoder.layers[1], teacher.encoder.layers[1]
    for sample in batches:
        seen = {}
        hooks = [layer.register_forward_pre_hook(lambda _, args, who=who: seen.__setitem__(who, args[0]))
                 for who, layer in (("student", layer_s), ("teacher", layer_t))]
        layer_s.self_attn.record_outputs = True
        with torch.no_grad():
            model(**sample["net_input"])
            teacher(**sample["net_input"])
        context = layer_s.self_attn.head_outputs  # (batch, heads, len, dim)
        layer_s.self_attn.record_outputs, layer_s.self_attn.head_outputs = False, None
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            x_t = seen["teacher"]
            h_t = layer_t.self_attn_layer_norm(x_t)
            y_t = x_t + layer_t.self_attn(h_t, h_t, h_t, key_padding_mask=sample["net_input"]["src_tokens"].eq(pad),
                                         need_weights=False)[0]
        real = sample["net_input"]["src_tokens"].ne(pad).t()
        out_proj = layer_s.self_attn.out_proj
        per_head = torch.einsum("bhtd,ohd->tbho", context, out_proj.weight.view(-1, 4, 16))
        rows.append(per_head[real][:, [0, 2]].permute(0, 2, 1).reshape(-1, 2).double())
        goals.append((y_t - seen["student"] - out_proj.bias)[real].reshape(-1).double())
    a, b = torch.cat(rows), torch.cat(goals)
    direct = torch.linalg.lstsq(a, b.unsqueeze(-1)).solution.squeeze(-1)
    torch.testing.assert_close(ours, direct, rtol=1e-6, atol=1e-8)
    error = lambda scales: (a @ scales - b).pow(2).sum()  # noqa: E731
    assert error(ours) < error(torch.ones(2, dtype=torch.float64))


def test_the_tuning_teacher_keeps_every_unit_the_student_keeps(loaded):
    """A looser search may keep other heads than the student (other counts per stack): tuning toward a teacher
    without encoder layer 1's head 0, which the student keeps, is tuning toward the teacher with it (the unpruned
    model here), not a fit that scales that head away."""
    from types import SimpleNamespace

    from hprune import backend
    from hprune.methods.fisher import tune
    from hprune.pruning.heads import mask_without

    batches = list(backend.batches(loaded, "valid", 600, 2))
    student = mask_without(loaded.model, {("enc-self", 1, 1), ("enc-self", 1, 3), ("dec-enc", 2, 0)})
    tuned = {}
    for name, teacher in (("without head 0", mask_without(loaded.model, {("enc-self", 1, 0)})),
                          ("unpruned", mask_without(loaded.model, ()))):
        model = copy.deepcopy(loaded.model).eval()
        session = SimpleNamespace(model=model, set_mask=model.set_head_mask, pad=loaded.task.target_dictionary.pad())
        tuned[name], stopped = tune(session, teacher, student, ["enc-self", "dec-self", "dec-enc"], batches, 10.0)
        assert stopped == "done"
    assert tuned["without head 0"] == pytest.approx(tuned["unpruned"], abs=1e-9)
    assert tuned["unpruned"][("enc-self", 1, 0)] != pytest.approx(1.0)  # (the student's layer 1 is fitted)


def test_unit_costs_are_counted_over_the_whole_split_each_sentence_at_its_own_length(loaded):
    """Kwon et al. price units at the data's lengths, not at those of one batch: the cost model's MACs per target
    token equal FlopCounterMode's count of each sentence run alone (no padding), summed and divided by the
    sentences' target tokens; the lengths are the whole split's; fairseq's first batch (its shortest sentences)
    prices them otherwise."""
    from hprune import backend
    from hprune.flops import Lengths, _counted, unit_costs

    model, pad = loaded.model, loaded.task.target_dictionary.pad()
    model.eval()
    lengths = backend.split_lengths(loaded, "valid")
    dataset = loaded.task.dataset("valid")
    assert [(len(dataset[i]["source"]), len(dataset[i]["target"])) for i in range(len(dataset))] == \
        list(zip(lengths.source.tolist(), lengths.target.tolist()))
    names = {id(module): f"{type(model).__name__}.{name}" for name, module in model.named_modules()}
    attention = [(t, layer, names[id(module)], module.num_heads) for t, layer, module in model.attention_modules()]
    totals = {name: 0.0 for _, _, name, _ in attention}
    some = range(0, len(dataset), 7)  # a second implementation, on every 7th sentence: each counted alone
    for i in some:
        counts = _counted(model, **dataset.collater([dataset[i]])["net_input"]).get_flop_counts()
        for name in totals:
            totals[name] += sum(counts.get(name, {}).values())
    costs = unit_costs(model, Lengths(lengths.source[list(some)], lengths.target[list(some)]))
    tokens = float(lengths.target[list(some)].sum())
    for attn_type, layer, name, heads in attention:
        assert costs[(attn_type, layer)].per_unit * heads == pytest.approx(totals[name] / 2 / tokens, rel=1e-9)
    first = next(backend.batches(loaded, "valid", 256, 1))  # fairseq's first batch: the shortest sentences
    assert first["nsentences"] < len(dataset)
    ratio = lambda c: c[("enc-self", 0)].per_unit / c[("dec-self", 0)].per_unit  # noqa: E731
    on_split, on_first = unit_costs(model, lengths), unit_costs(model, Lengths.of_sample(first, pad))
    assert abs(ratio(on_first) / ratio(on_split) - 1) > 0.01  # the split's mix of lengths is not its first batch's


def test_fisher_end_to_end_meets_the_budget_in_counted_macs(trained_run, tmp_path):
    out = tmp_path / "run"
    hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={out}", *FISHER, "prune.macs_budget=0.6")
    metrics = json.loads((out / "metrics.json").read_text())
    # the budget, in the cost model and in the MACs counted on the physically pruned export (every type is in the
    # pool here, so the pool's attention MACs are the model's)
    assert metrics["attention_macs_kept"] <= 0.6 * metrics["attention_macs_pool"]
    counted = metrics["attention_macs_per_token_pruned"] / metrics["attention_macs_per_token_unpruned"]
    assert counted == pytest.approx(metrics["attention_macs_pct"] / 100, abs=0.005) and counted <= 0.6 + 0.005
    assert metrics["export_same_translations"] and metrics["export_max_abs_diff"] < 1e-4
    stages = pd.read_csv(out / "stages.csv")
    assert list(stages["stage"]) == ["search", "rearranged", "tuned"]
    assert (stages["kept_heads"] == metrics["kept_heads"]).all()  # rearranging and tuning keep the count
    assert metrics["bleu"] == metrics["bleu_tuned"] == stages["bleu"].iloc[-1] == metrics["export_bleu"]
    table = pd.read_csv(out / "fisher.csv")
    assert len(table) == 36 and table["kept"].sum() == metrics["kept_heads"]
    assert ((table["scale"] != 1) == (table["kept"] == 1)).sum() >= 1  # tuned heads carry their scale
    assert metrics["seconds"] > 0 and metrics["calibration_sentences"] == 128

    # stage ablation: search only
    hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'search'}", *FISHER, "prune.macs_budget=0.6",
           "prune.rearrange=false", "prune.tune=false", "prune.export=false")
    search = json.loads((tmp_path / "search" / "metrics.json").read_text())
    assert search["bleu"] == search["bleu_search"] == metrics["bleu_search"]
    assert list(pd.read_csv(tmp_path / "search" / "stages.csv")["stage"]) == ["search"]


def test_per_stack_search_is_the_best_layout_within_the_budget(trained_run, loaded, tmp_path):
    """prune.layout=per_stack: the search keeps the per_stack set of the most Fisher information that fits the
    budget (against all 16 per_stack sets, their MACs counted here), and rearrangement keeps the layout."""
    from hprune import backend
    from hprune.flops import mask_macs, unit_costs
    from test_prune_cli import is_per_stack
    out = tmp_path / "run"
    hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={out}", *FISHER, "prune.macs_budget=0.6",
           "prune.layout=per_stack", "prune.tune=false", "prune.export=false")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["layout"] == "per_stack" and is_per_stack(json.loads((out / "head_mask.json").read_text()))
    assert metrics["attention_macs_kept"] <= 0.6 * metrics["attention_macs_pool"]
    table = pd.read_csv(out / "fisher.csv")
    for column in ("kept_search", "kept"):
        mask = {kind: [[0] * 4 for _ in range(3)] for kind in ("enc-self", "dec-self", "dec-enc")}
        for row in table[table[column] == 1].itertuples():
            mask[row.type][row.layer][row.head] = 1
        assert is_per_stack(mask), column
    # every per_stack set: each sublayer's k highest-Fisher heads, k per stack
    costs = unit_costs(loaded.model, backend.split_lengths(loaded, "valid"))  # the loss split, all of it
    types = ["enc-self", "dec-self", "dec-enc"]
    budget = 0.6 * mask_macs(costs, {kind: [[1] * 4 for _ in range(3)] for kind in types}, types)
    rank = table.groupby(["type", "layer"])["fisher"].rank(ascending=False, method="first")
    fitting = {}
    for k_enc in range(1, 5):
        for k_dec in range(1, 5):
            kept = rank <= table["type"].map({"enc-self": k_enc, "dec-self": k_dec, "dec-enc": k_dec})
            mask = {kind: [[0] * 4 for _ in range(3)] for kind in types}
            for row in table[kept].itertuples():
                mask[row.type][row.layer][row.head] = 1
            if mask_macs(costs, mask, types) <= budget + 1e-9:
                fitting[(k_enc, k_dec)] = table.loc[kept, "fisher"].sum()
    assert table.loc[table["kept_search"] == 1, "fisher"].sum() == pytest.approx(max(fitting.values()), rel=1e-6)
