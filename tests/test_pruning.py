"""Head scores, head choice and physical removal, in-process on the small trained model."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("fairseq")

from hprune.errors import UserError  # noqa: E402
from hprune.pruning import scores  # noqa: E402
from hprune.pruning.heads import (  # noqa: E402
    check_layout,
    extend_pruned,
    heads_to_prune,
    kept_columns,
    kept_ids,
    mask_without,
    max_prunable,
    michel_id,
    per_stack_masks,
    present_heads,
    ranked,
    read_mask,
)


@pytest.fixture()
def loaded(trained_run, evaluated_run):
    from hprune import backend
    return backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))


def first_batch(loaded, split="valid", max_tokens=600):
    from hprune import backend
    return next(backend.batches(loaded, split, max_tokens, 1))


def test_importance_equals_autograd_gradient_of_an_explicit_mask(loaded):
    """Σ_tokens |⟨ctx, ∂L/∂ctx⟩| / N_tokens equals |∂L/∂ξ| with ξ a per-token mask leaf, summed the same way;
    and the per-token gradients sum to ∂L/∂ξ of a per-head mask."""
    from hprune import backend
    model, criterion = loaded.model, backend.build_criterion(loaded)
    sample = first_batch(loaded)
    pad = loaded.task.target_dictionary.pad()
    table, tokens = scores.michel(model, criterion, [sample], pad)

    modules = list(model.attention_modules())
    source, target = sample["net_input"]["src_tokens"], sample["target"]
    lengths = {"enc-self": source.size(1), "dec-self": target.size(1), "dec-enc": target.size(1)}
    real = {"enc-self": source.ne(pad), "dec-self": target.ne(pad), "dec-enc": target.ne(pad)}
    per_token = [torch.ones(source.size(0), m.num_heads, lengths[kind], 1, requires_grad=True)
                 for kind, _, m in modules]
    for leaf, (_, _, m) in zip(per_token, modules):
        m.head_mask = leaf
    loss = criterion(model, sample)[0]
    token_grads = torch.autograd.grad(loss, per_token)
    per_head = [torch.ones(m.num_heads, requires_grad=True) for _, _, m in modules]
    for leaf, (_, _, m) in zip(per_head, modules):
        m.set_head_mask(leaf)
    head_grads = torch.autograd.grad(criterion(model, sample)[0], per_head)
    model.set_head_mask(None)

    assert tokens == {kind: int(real[kind].sum()) for kind in real}
    for (kind, layer, _), grad, head_grad in zip(modules, token_grads, head_grads):
        grad = grad.squeeze(-1) * real[kind].unsqueeze(1)  # (batch, heads, len)
        torch.testing.assert_close(grad.sum((0, 2)), head_grad, atol=1e-5, rtol=1e-5)
        expected = grad.abs().sum((0, 2)) / tokens[kind]
        ours = table[(table["type"] == kind) & (table["layer"] == layer)].sort_values("head")["importance"]
        torch.testing.assert_close(torch.tensor(ours.to_numpy()), expected.double(), atol=1e-5, rtol=1e-5)
        assert (expected > 0).all()


def test_scores_are_deterministic_and_normalised_per_layer(loaded):
    from hprune import backend
    criterion, pad = backend.build_criterion(loaded), loaded.task.target_dictionary.pad()
    runs = [scores.michel(loaded.model, criterion, backend.batches(loaded, "valid", 1000, 2), pad)[0] for _ in range(2)]
    pd.testing.assert_frame_equal(ranked(runs[0]), ranked(runs[1]))
    norms = scores.normalize_by_layer(runs[0]).groupby(["type", "layer"])["importance"].apply(lambda s: (s ** 2).sum())
    assert norms.to_numpy() == pytest.approx(1.0)
    pd.testing.assert_frame_equal(scores.random(loaded.model, 3), scores.random(loaded.model, 3))
    assert not scores.random(loaded.model, 3).equals(scores.random(loaded.model, 4))


def test_confidence_against_a_direct_computation(loaded):
    """One sentence, computed by hand from the recorded weights: max over non-EOS keys, averaged over queries."""
    model, eos, pad = loaded.model, loaded.task.target_dictionary.eos(), loaded.task.target_dictionary.pad()
    src = torch.tensor([[5, 6, 7, 8, eos]])
    prev = torch.tensor([[eos, 9, 10, 11]])
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([5]), "prev_output_tokens": prev},
              "target": torch.tensor([[9, 10, 11, eos]])}
    table = scores.confidence(model, [sample], pad, eos)
    model.record_heads(weights=True)
    with torch.no_grad():
        model(**sample["net_input"])
    weights = {(kind, layer): m.head_weights[0] for kind, layer, m in model.attention_modules()}
    model.record_heads()
    enc = weights[("enc-self", 1)][:, :, :4].amax(-1).mean(-1)  # 5 queries, keys without the final EOS
    dec = weights[("dec-self", 0)][:, 1:, 1:].amax(-1).mean(-1)  # query 0 sees only the leading EOS
    for (kind, layer), expected in {("enc-self", 1): enc, ("dec-self", 0): dec}.items():
        ours = table[(table["type"] == kind) & (table["layer"] == layer)].sort_values("head")["importance"]
        torch.testing.assert_close(torch.tensor(ours.to_numpy(), dtype=torch.float32), expected)


def test_magnitude_is_fairseqs_l1_criterion(loaded):
    m = loaded.model.decoder.layers[1].encoder_attn
    d = m.head_dim
    expected = sum(p.weight[2 * d:3 * d].abs().sum() + p.bias[2 * d:3 * d].abs().sum()
                   for p in (m.q_proj, m.k_proj, m.v_proj))
    table = scores.magnitude(loaded.model)
    row = table[(table["type"] == "dec-enc") & (table["layer"] == 1) & (table["head"] == 2)]
    assert row["importance"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_choice_of_heads_respects_order_ties_and_layer_minimum():
    heads = [(kind, layer, h) for kind in ("enc-self", "dec-enc") for layer in range(2) for h in range(2)]
    table = pd.DataFrame([(*head, 1.0) for head in heads], columns=["type", "layer", "head", "importance"])
    table.loc[(table["type"] == "dec-enc") & (table["layer"] == 1), "importance"] = 0.5
    pool = set(heads)
    # the two 0.5 heads first, then ties in type, layer, head order
    assert extend_pruned(table, set(), 3, pool, 0) == {("dec-enc", 1, 0), ("dec-enc", 1, 1), ("enc-self", 0, 0)}
    assert extend_pruned(table, set(), 3, pool, 1) == {("dec-enc", 1, 0), ("enc-self", 0, 0), ("enc-self", 1, 0)}
    assert extend_pruned(table, {("enc-self", 1, 1)}, 2, pool, 0) == {("enc-self", 1, 1), ("dec-enc", 1, 0)}
    with pytest.raises(UserError, match="cannot prune 5 heads"):
        extend_pruned(table, set(), 5, pool, 1)
    assert [heads_to_prune(36, pct) for pct in (0, 10, 20, 90, 100)] == [0, 4, 8, 33, 36]
    assert heads_to_prune(288, 10) == math.ceil(28.8) == 29
    assert michel_id(("dec-enc", 0, 3)) == "A:1:4"
    assert list(ranked(table)["rank"]) == list(range(8, 0, -1))


def test_a_mask_that_removes_heads_holds_0_or_1_and_eval_runs_any_finite_value(tmp_path):
    """read_mask: 0/1 (as ints or floats) for the verbs that remove heads; soft (eval): any finite number; what
    is neither is one line naming the head and its value."""
    shape = {"enc-self": [2, 2]}
    path = tmp_path / "mask.json"
    for value, hard, soft in ((1.0, [[1, 0], [1, 1]], [[1.0, 0], [1, 1]]), (0.5, None, [[0.5, 0], [1, 1]]),
                              (2, None, [[2, 0], [1, 1]]), (-1, None, [[-1, 0], [1, 1]]),
                              ("1", None, None), (True, None, None), (float("nan"), None, None)):
        path.write_text(__import__("json").dumps({"enc-self": [[value, 0], [1, 1]]}))
        for allowed, expected in ((False, hard), (True, soft)):
            if expected is None:
                with pytest.raises(UserError, match=r"mask=.* has .* for enc-self layer 0 head 0"):
                    read_mask(path, shape, soft=allowed)
            else:
                assert read_mask(path, shape, soft=allowed) == {"enc-self": expected}
    assert kept_columns({"enc-self": [[0.5, 0], [-1, 1]]}) == {"kept_enc_self": 3}  # heads that still compute


def per_stack_counts(kept) -> dict:
    """{(type, layer): heads kept} of a head set."""
    counts: dict = {}
    for kind, layer, _ in kept:
        counts[(kind, layer)] = counts.get((kind, layer), 0) + 1
    return counts


def test_per_stack_layout_on_a_case_worked_by_hand():
    """2 encoder layers and 2 decoder layers (self + cross) of 4 heads: an encoder level is 2 heads, a decoder
    level 4. Pruning 12 of the 24: kept 12 = 2·K_enc + 4·K_dec, so (K_enc, K_dec) = (4, 1) or (2, 2); the
    importance decides between them, and within a sublayer the least important heads go."""
    heads = [(kind, layer, h) for kind in ("enc-self", "dec-self", "dec-enc") for layer in range(2) for h in range(4)]
    importance = {head: 1.0 + head[2] / 10 for head in heads}  # head 0 the least important of every sublayer
    table = lambda scores: pd.DataFrame([(*h, v) for h, v in scores.items()],  # noqa: E731
                                        columns=["type", "layer", "head", "importance"])
    pool = set(heads)
    pruned = extend_pruned(table(importance), set(), 12, pool, 0, "per_stack")
    assert per_stack_counts(pool - pruned) == {**{("enc-self", i): 2 for i in range(2)},
                                               **{(k, i): 2 for k in ("dec-self", "dec-enc") for i in range(2)}}
    assert {h for h in pruned if h[0] == "enc-self"} == {("enc-self", i, h) for i in range(2) for h in (0, 1)}
    encoder_first = {h: v + (5 if h[0] == "enc-self" else 0) for h, v in importance.items()}  # the encoder matters
    pruned = extend_pruned(table(encoder_first), set(), 12, pool, 0, "per_stack")
    assert set(per_stack_counts(pool - pruned).values()) == {4, 1} and len(pruned) == 12
    assert all(h[0] != "enc-self" for h in pruned) and ("dec-self", 0, 3) not in pruned
    # 13 cannot be pruned exactly: the fewest above it (14 = 2 + 3·4), then cumulative from the 12 above
    assert len(extend_pruned(table(importance), set(), 13, pool, 0, "per_stack")) == 14
    assert extend_pruned(table(importance), pruned, 13, pool, 0, "per_stack") >= pruned
    # every stack keeps at least one head per layer: 24 - 6 can go, not 19
    assert max_prunable(pool, 0, "per_stack") == 18 and max_prunable(pool, 0, "free") == 24
    with pytest.raises(UserError, match="cannot keep only 5 of 24 heads"):
        extend_pruned(table(importance), set(), 19, pool, 0, "per_stack")
    # (4 encoder levels) x (4 decoder levels), each the same number of heads in every sublayer of its stack
    masks = per_stack_masks(pool, importance, 1)
    assert len(masks) == 16 and all(len(set(per_stack_counts(kept)[(k, i)] for k in ("dec-self", "dec-enc")
                                                                   for i in range(2))) == 1 for kept in masks)
    for bad, types, message in (("stacked", ["enc-self"], "prune.layout=stacked is not a layout"),
                                ("per_stack", ["enc-self", "dec-self"], "add dec-enc to prune.types")):
        with pytest.raises(UserError, match=message):
            check_layout(bad, types)
    check_layout("per_stack", ["enc-self"])


def test_physical_pruning_equals_masking_with_an_emptied_layer(loaded):
    """Removing heads (an enc-self layer and a dec-enc layer lose all of theirs) gives the masked model's outputs;
    the parameter count falls by exactly the removed q/k/v rows and out_proj columns."""
    model = copy.deepcopy(loaded.model).double()
    pruned_heads = {("enc-self", 1, h) for h in range(4)} | {("dec-enc", 2, h) for h in range(4)}
    pruned_heads |= {("dec-self", 0, 1), ("dec-enc", 0, 3), ("enc-self", 2, 0), ("enc-self", 2, 2)}
    mask = mask_without(model, pruned_heads)
    sample = first_batch(loaded)
    with torch.no_grad():
        model.set_head_mask(mask)
        masked = model(**sample["net_input"])[0]
        physical = copy.deepcopy(model)
        physical.set_head_mask(None)
        physical.keep_heads(kept_ids(mask))
        out = physical(**sample["net_input"])[0]
    torch.testing.assert_close(out, masked, atol=1e-5, rtol=0)
    assert physical.encoder.layers[1].self_attn.num_heads == 0
    assert physical.head_ids()["enc-self"][2] == [1, 3]
    assert len(present_heads(physical)) == 36 - len(pruned_heads)
    d, head_dim = 64, 16
    per_head = 3 * (d * head_dim + head_dim) + head_dim * d
    removed = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in physical.parameters())
    assert removed == len(pruned_heads) * per_head
    # masks keep the unpruned layout on a pruned model: ids refer to the original heads
    physical.set_head_mask(mask_without(physical, {("enc-self", 2, 3)}))
    with torch.no_grad():
        model.set_head_mask(mask_without(model, pruned_heads | {("enc-self", 2, 3)}))
        torch.testing.assert_close(physical(**sample["net_input"])[0], model(**sample["net_input"])[0],
                                   atol=1e-5, rtol=0)


def test_exported_checkpoint_reloads_and_translates_like_the_masked_model(loaded, tmp_path, evaluated_run):
    """The pruned checkpoint reloads in hprune and in stock fairseq-generate (same translations as masking)."""
    import os
    import re
    import subprocess

    from omegaconf import OmegaConf

    from conftest import HPRUNE
    from hprune import backend
    mask = mask_without(loaded.model, {("enc-self", 0, 0), ("dec-enc", 2, 0), ("dec-enc", 2, 1), ("dec-enc", 2, 2),
                                       ("dec-enc", 2, 3), ("dec-self", 1, 2)})
    path = tmp_path / "pruned.pt"
    backend.export_pruned(loaded, kept_ids(mask), path)
    reloaded = backend.load_model(path, Path(evaluated_run[1]["data_bin"]))
    assert reloaded.model.head_ids() == kept_ids(mask)
    gen = OmegaConf.create({"beam": 5, "lenpen": 1.0, "max_len_a": 1.2, "max_len_b": 10, "min_len": 1, "batch_size": 128,
                            "max_tokens": None})
    loaded.model.set_head_mask(mask)
    masked = backend.translate(loaded, gen, "test", 1).hypotheses
    assert backend.translate(reloaded, gen, "test", 1).hypotheses == masked
    cmd = [os.path.join(os.path.dirname(HPRUNE[0]), "fairseq-generate"), str(evaluated_run[1]["data_bin"]),
           "--path", str(path), "--user-dir", backend.PLUGIN_DIR, "--gen-subset", "test", "--beam", "5",
           "--max-len-a", "1.2", "--max-len-b", "10", "--batch-size", "128", "--cpu",
           "--required-batch-size-multiple", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hyps = dict(re.findall(r"^D-(\d+)\t[^\t]*\t(.*)$", proc.stdout, flags=re.M))
    assert [hyps[str(i)] for i in range(len(hyps))] == masked


def test_finetuning_leaves_masked_heads_untouched(loaded):
    """Fine-tuning after a step moves the kept heads and every other weight, never the masked heads: their
    gradient is exactly zero, so Adam leaves them as they were (and the model can be translated with again)."""
    from omegaconf import OmegaConf

    from hprune import backend
    gen = OmegaConf.create({"beam": 2, "lenpen": 1.0, "max_len_a": 1.2, "max_len_b": 10, "min_len": 1,
                            "batch_size": 128, "max_tokens": None})
    backend.translate(loaded, gen, "test", 1)  # fairseq then locks train(); fine-tuning must undo that
    m = loaded.model.decoder.layers[0].encoder_attn
    d = m.head_dim
    before = {name: p.detach().clone() for name, p in m.named_parameters()}
    loaded.model.set_head_mask(mask_without(loaded.model, {("dec-enc", 0, 1)}))
    backend.finetune(loaded, backend.build_criterion(loaded), updates=3, lr=1e-3, max_tokens=1000, seed=1)
    assert not loaded.model.training
    after = dict(m.named_parameters())
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        torch.testing.assert_close(after[name][d:2 * d], before[name][d:2 * d], atol=0, rtol=0)
        assert not torch.equal(after[name][:d], before[name][:d])
    torch.testing.assert_close(after["out_proj.weight"][:, d:2 * d], before["out_proj.weight"][:, d:2 * d], atol=0, rtol=0)
    assert not torch.equal(after["out_proj.bias"], before["out_proj.bias"])
    assert len(backend.translate(loaded, gen, "test", 1).hypotheses) == 100


def test_reestimated_importance_sees_the_current_mask(loaded):
    """Re-estimation after a step: masked heads score exactly 0, the others are scored afresh (no gradient state
    survives between rounds, unlike a reused mask leaf)."""
    from hprune import backend
    criterion, pad, sample = backend.build_criterion(loaded), loaded.task.target_dictionary.pad(), first_batch(loaded)
    pruned = {("enc-self", 0, 1), ("dec-enc", 2, 3), ("dec-self", 1, 0)}
    loaded.model.set_head_mask(mask_without(loaded.model, pruned))
    rounds = [scores.michel(loaded.model, criterion, [sample], pad)[0] for _ in range(2)]
    pd.testing.assert_frame_equal(rounds[0], rounds[1])
    is_pruned = [head in pruned for head in rounds[0][["type", "layer", "head"]].itertuples(index=False, name=None)]
    assert (rounds[0]["importance"][is_pruned] == 0).all() and (rounds[0]["importance"][[not p for p in is_pruned]] > 0).all()
    loaded.model.set_head_mask(None)
    unmasked = scores.michel(loaded.model, criterion, [sample], pad)[0]
    assert not np.allclose(unmasked["importance"], rounds[0]["importance"])


def test_exported_model_scripts_with_torchscript_and_translates_the_same(loaded, tmp_path, evaluated_run):
    """Deployment pipelines script fairseq models: a physically pruned hprune model scripts as a stock fairseq
    transformer does, and the scripted model (alone, and inside a scripted SequenceGenerator, incremental
    decoding included) computes what the eager one does."""
    from fairseq.sequence_generator import SequenceGenerator

    from hprune import backend
    mask = mask_without(loaded.model, {("enc-self", 1, 0), ("dec-self", 0, 3), ("dec-enc", 2, 1), ("dec-enc", 2, 2)})
    path = tmp_path / "pruned.pt"
    backend.export_pruned(loaded, kept_ids(mask), path)
    pruned = backend.load_model(path, Path(evaluated_run[1]["data_bin"])).model
    scripted = torch.jit.script(pruned)
    sample = first_batch(loaded, "test")
    with torch.no_grad():
        torch.testing.assert_close(scripted(**sample["net_input"])[0], pruned(**sample["net_input"])[0],
                                   atol=1e-5, rtol=0)
    dictionary = loaded.task.target_dictionary
    eager_search = SequenceGenerator([pruned], dictionary, beam_size=3, max_len_b=20)
    scripted_search = torch.jit.script(SequenceGenerator([pruned], dictionary, beam_size=3, max_len_b=20))
    net_input = {"net_input": {key: sample["net_input"][key] for key in ("src_tokens", "src_lengths")}}
    with torch.no_grad():
        eager = eager_search.generate([pruned], net_input)
        jit = scripted_search(net_input)
    assert [h[0]["tokens"].tolist() for h in jit] == [h[0]["tokens"].tolist() for h in eager]
