"""FFN neurons as prunable units (Kwon et al.'s framework, issue 43): their mask gradients against autograd, their
removal against the mask in hprune, fairseq and CTranslate2 (a layer left with none included), their MACs in the
cost model against the counted ones, their mask tuning against a direct least-squares solve, and
`--method fisher prune.units=[heads,neurons]` end to end under one budget."""
from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import SMALL_DATA, hprune
from test_cli import assert_one_line_error

pytest.importorskip("fairseq")
FISHER = ["--method", "fisher", *SMALL_DATA, "device=cpu", "prune.calibration.sentences=128"]


@pytest.fixture(scope="module")
def loaded(trained_run, evaluated_run):
    from hprune import backend
    return backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))


def uneven_neuron_mask(model) -> dict:
    """Heads and neurons removed unevenly: half the neurons at random, encoder layer 1 and decoder layer 2 empty."""
    from hprune.pruning.heads import mask_without, present_neurons
    rng = random.Random(0)
    pruned = {n for n in present_neurons(model) if rng.random() < 0.5 or n[:2] in (("enc-ffn", 1), ("dec-ffn", 2))}
    return mask_without(model, pruned | {("enc-self", 0, 1), ("dec-enc", 1, 2)})


def test_neuron_gradients_removal_and_macs(loaded, tmp_path):
    """Per batch, the neurons' mask gradients are autograd's on an explicit mask on fc2's input; the model with the
    neurons physically removed (an empty FFN adds its fc2 bias alone) computes what the masked model computes, in
    hprune, reloaded by fairseq from the exported checkpoint, and in CTranslate2; the cost model's MACs for the
    mask equal those FlopCounterMode counts on the pruned model."""
    from hprune import backend
    from hprune.flops import Lengths, macs_per_token, mask_macs, unit_costs
    from hprune.pruning.heads import kept_ids, mask_without
    from hprune.pruning.scores import mask_gradients, nll

    model, pad = loaded.model, loaded.task.target_dictionary.pad()
    batches = backend.sampled_batches(loaded, "valid", 6, 3, seed=1)
    units, grads = mask_gradients(model, batches, pad, per="batch", neurons=True)
    d_ff = model.encoder.layers[0].fc2.in_features
    assert grads.shape == (2, 36 + 6 * d_ff) and units[36] == ("enc-ffn", 0, 0) and units[-1] == ("dec-ffn", 2, d_ff - 1)
    model.eval()
    for b, sample in enumerate(batches):
        leaves = []
        for _, _, block in model.ffn_layers():
            block.fc2.neuron_mask = torch.ones(d_ff, requires_grad=True)
            leaves.append(block.fc2.neuron_mask)
        loss, tokens = nll(model, sample, pad)
        (loss / tokens).backward()
        torch.testing.assert_close(torch.cat([leaf.grad for leaf in leaves]).double(), grads[b, 36:], rtol=1e-4,
                                   atol=1e-7)
        model.set_head_mask(None)

    mask = uneven_neuron_mask(model)
    sample = batches[0]
    with torch.no_grad():
        model.set_head_mask(mask)
        masked = model(**sample["net_input"])[0]
        model.set_head_mask(None)
        dest = tmp_path / "pruned.pt"
        pruned = backend.export_pruned(loaded, kept_ids(mask), dest)
        assert pruned.encoder.layers[1].fc1.out_features == 0 == pruned.decoder.layers[2].fc2.in_features
        reloaded = backend.load_model(dest, Path(loaded.cfg.task.data)).model  # fairseq builds it from the config
        for name, other in (("pruned", pruned), ("reloaded", reloaded)):
            torch.testing.assert_close(other(**sample["net_input"])[0], masked, rtol=0, atol=2e-5, msg=name)
    lengths = Lengths.of_sample(sample, pad)
    costs = unit_costs(model, lengths)
    types = ["enc-self", "dec-self", "dec-enc", "enc-ffn", "dec-ffn"]
    removed = mask_macs(costs, mask_without(model, (), neurons=True), types) - mask_macs(costs, mask, types)
    counted = macs_per_token(model, lengths)["macs_per_token"] - macs_per_token(pruned, lengths)["macs_per_token"]
    assert removed == pytest.approx(counted, abs=2)

    ctranslate2 = pytest.importorskip("ctranslate2")  # noqa: F841 (CTranslate2 reads each layer's width)
    from test_export import export_model, largest_log_prob_difference
    model_dir = export_model(loaded, mask, tmp_path)
    assert largest_log_prob_difference(loaded, Path(model_dir), "valid", mask) < 1e-4


def test_neuron_tuning_is_the_least_squares_solution(loaded):
    """Student: a third of encoder layer 1's neurons masked; teacher: the unpruned model. The normal equations
    built from the Gram of fc2's columns give the scales a direct solve gives on the stacked (tokens·d, kept)
    system, built here from the FFN's input; they lower the error."""
    from hprune import backend
    from hprune.methods.fisher import forward_order, neuron_least_squares
    from hprune.pruning.heads import mask_without

    model, teacher = copy.deepcopy(loaded.model).eval(), copy.deepcopy(loaded.model).eval()
    pad = loaded.task.target_dictionary.pad()
    d_ff = model.encoder.layers[1].fc2.in_features
    model.set_head_mask(mask_without(model, {("enc-ffn", 1, n) for n in range(0, d_ff, 3)}))
    units = [n for n in range(d_ff) if n % 3]
    batches = list(backend.batches(loaded, "valid", 600, 2))
    gram, target = neuron_least_squares(model, teacher, "enc-ffn", 1, batches, pad, units)
    ours = torch.linalg.lstsq(gram, target.unsqueeze(-1)).solution.squeeze(-1)

    block_s = model.encoder.layers[1]
    rows, goals = [], []
    for sample in batches:
        caught = {}
        for who, net in (("teacher", teacher), ("student", model)):
            sink = []
            with net.capture_residuals(forward_order(net)["enc-ffn", 1], sink), torch.no_grad():
                net(**sample["net_input"])
            caught[who] = sink[0]
        (update_t, residual_t), (_, residual_s) = caught["teacher"], caught["student"]
        with torch.no_grad():
            h = block_s.final_layer_norm(residual_s) if block_s.normalize_before else residual_s
            act = block_s.activation_fn(block_s.fc1(h)) * block_s.fc2.neuron_mask
        real = sample["net_input"]["src_tokens"].ne(pad).t()
        columns = block_s.fc2.weight[:, units].detach()  # (d, kept)
        design = act[real][:, units].unsqueeze(1) * columns.unsqueeze(0)  # (tokens, d, kept): each neuron's share
        rows.append(design.reshape(-1, len(units)).double())
        goals.append((update_t + residual_t - residual_s - block_s.fc2.bias.detach())[real].reshape(-1).double())
    a, b = torch.cat(rows), torch.cat(goals)
    direct = torch.linalg.lstsq(a, b.unsqueeze(-1)).solution.squeeze(-1)
    torch.testing.assert_close(ours, direct, rtol=1e-5, atol=1e-6)
    error = lambda scales: (a @ scales - b).pow(2).sum()  # noqa: E731
    assert error(ours) < error(torch.ones(len(units), dtype=torch.float64))


def test_fisher_prunes_heads_and_neurons_under_one_budget(trained_run, tmp_path):
    """prune.units=[heads,neurons] at half the MACs of heads and FFN: the budget met in the cost model and in the
    MACs counted on the physically pruned export (which translates as the masked model); the search's choice is
    the best of the reference's sweep (each number of heads, the neurons filling the rest) by summed Fisher."""
    out = tmp_path / "run"
    hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={out}", *FISHER, "prune.macs_budget=0.5",
           "prune.units=[heads,neurons]", "prune.calibration.sentences=64")
    m = json.loads((out / "metrics.json").read_text())
    assert m["macs_kept"] <= 0.5 * m["macs_pool"] + 1e-6 and m["kept_neurons"] < m["neurons_pool"]
    counted = m["macs_per_token_unpruned"] - m["macs_per_token_pruned"]
    assert counted == pytest.approx(m["macs_pool"] - m["macs_kept"], abs=3)  # the pool's MACs removed, no other
    assert m["export_same_translations"] and m["export_max_abs_diff"] < 1e-4 and m["bleu"] == m["export_bleu"]
    stages = pd.read_csv(out / "stages.csv")
    assert (stages["kept_neurons"] == m["kept_neurons"]).all() and (stages["macs_pct"] <= 50.0).all()

    table = pd.read_csv(out / "fisher.csv")
    heads, neurons = table[~table["type"].str.endswith("ffn")], table[table["type"].str.endswith("ffn")]
    assert len(heads) == 36 and len(neurons) == m["neurons_pool"]
    from hprune import backend
    from hprune.flops import unit_costs
    loaded = backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(m["data_bin"]))
    costs = unit_costs(loaded.model, backend.split_lengths(loaded, "valid"))  # the loss split, all of it
    cost = lambda rows: sum(costs[(r.type, r.layer)].per_unit for r in rows.itertuples())  # noqa: E731
    budget, best = 0.5 * m["macs_pool"], -1.0
    h_order = heads.sort_values("fisher", ascending=False, kind="stable")
    n_order = neurons.sort_values("fisher", ascending=False, kind="stable")
    n_cost = n_order.apply(lambda r: costs[(r.type, r.layer)].per_unit, axis=1).cumsum()
    for n in range(1, 37):
        left = budget - cost(h_order.head(n))
        if left >= 0:
            fit = int((n_cost <= left + 1e-6).sum())
            best = max(best, h_order.head(n)["fisher"].sum() + n_order.head(fit)["fisher"].sum())
    assert table.loc[table["kept_search"] == 1, "fisher"].sum() == pytest.approx(best, rel=1e-9)
    # the tuning's teacher (the search at the square root of the budget) keeps every unit the student keeps
    assert (table["teacher"] >= table["kept"]).all() and table["teacher"].sum() > table["kept"].sum()

    proc = hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'bad'}", *FISHER,
                  "prune.units=[heads,experts]", check=False)
    assert_one_line_error(proc, "prune.units")


def test_the_neurons_damped_solve_converges_to_its_closed_form():
    """The FFN scales' LSMR (damp=1, the reference's solver) reaches δ = (G² + I)⁻¹ G (t − G·1) on a Gram built
    as the tuning builds it, (WᵀW) ∘ (AᵀA)."""
    from hprune.methods.fisher import damped_toward_one
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=generator, dtype=torch.float64) * 0.05
    a = torch.relu(torch.randn(200, 300, generator=generator, dtype=torch.float64))
    gram = (w.t() @ w) * (a.t() @ a)
    target = gram @ (1 + 0.1 * torch.randn(300, generator=generator, dtype=torch.float64)) \
        + torch.randn(300, generator=generator, dtype=torch.float64)
    ones = torch.ones(300, dtype=torch.float64)
    closed = ones + torch.linalg.solve(gram @ gram + torch.eye(300, dtype=torch.float64), gram @ (target - gram @ ones))
    assert torch.allclose(damped_toward_one(gram, target), closed, atol=1e-5)
    assert not torch.allclose(closed, ones, atol=1e-2)  # the system moves the scales


def test_latency_table_predicts_each_familys_saving_less_their_interaction():
    """A mask's latency: the unpruned model's less what its head counts per stack save (each measured with the rest
    unpruned) and what each layer's FFN width saves (its stack's saving at that width, linear between the widths
    timed, shared by its layers), plus γ Σ_{f<g} s_f s_g / unpruned, γ fitted on the joint points."""
    from hprune.deploy.latency import LatencyTable, interaction
    table = LatencyTable(unpruned=10.0, encoder_heads={1: 8.0, 2: 9.0, 4: 10.0}, decoder_heads={1: 6.0, 4: 10.0},
                         encoder_ffn={0: 7.0, 8: 10.0}, decoder_ffn={0: 4.0, 4: 7.0, 8: 10.0},
                         layers={"encoder": 2, "decoder": 3})
    assert table.predict({"encoder": 4, "decoder": 4}, {"encoder": [8, 8], "decoder": [8, 8, 8]}) == 10.0
    # encoder 2 heads saves 1; decoder 1 head saves 4 (3 heads: 4 · 1/3, linear); an encoder layer at width 4
    # saves (10 - 8.5) / 2; a decoder layer at width 2 saves (10 - 5.5) / 3, at 0 saves 6 / 3
    mask = ({"encoder": 2, "decoder": 1}, {"encoder": [4, 8], "decoder": [2, 0, 8]})
    assert table.predict(*mask) == pytest.approx(10 - 1 - 4 - 0.75 - 1.5 - 2.0)
    assert table.heads_saving("decoder", 3) == pytest.approx(4 / 3)
    assert table.shares() == pytest.approx({"heads": (2 + 4) / 10, "ffn": (3 + 6) / 10})
    pairs = (1 * 4 + 1 * 0.75 + 1 * 3.5 + 4 * 0.75 + 4 * 3.5 + 0.75 * 3.5) / 10
    table.interaction = 0.5
    assert table.predict(*mask) == pytest.approx(10 - 9.25 + 0.5 * pairs)
    # γ: least squares on the joint points (each family's saving alone, then measured together)
    joint = {"heads": [4, 4], "ffn": [4, 4]}  # savings 0, 0, 1.5, 3: pairs 4.5 / 10
    table.joint = {"joint 2": {**joint, "seconds": 10 - 4.5 + 0.25 * 0.45, "additive": 5.5}}
    assert interaction(table, 2, 3) == pytest.approx(0.25)


def test_a_latency_budget_is_searched_again_from_both_sides_in_measurement():
    """deploy/latency.calibrated, against closed forms: a table whose masks lie every 5 % (the largest within the
    target) and a machine 25 % slower than the table: 60 % finds the 60 % mask, measured 75 %; the target scaled by
    60 / 75 is 48 %, whose mask (45 %) measures 56.25 %; halfway between the targets, 54 %, the 50 % mask measures
    62.5 %: the 45 % mask is kept."""
    from hprune.deploy.latency import calibrated
    from hprune.errors import UserError

    def search(step: float):
        def at(target: float) -> float:
            if target < 0.3:
                raise UserError("the table has no mask this fast")
            return round(math.floor(target / step + 1e-9) * step, 4)
        return at

    def measured(rounds):
        return [(r["target"], r["measured"]) for r in rounds]

    found, target, fraction, rounds = calibrated(search(0.05), lambda mask, target: mask * 1.25, 0.6, 3)
    assert (found, target, fraction) == pytest.approx((0.45, 0.48, 0.5625))
    assert measured(rounds) == [(0.6, 0.75), (0.48, 0.5625), (0.54, 0.625)]
    # a machine 20 % faster: 64 % finds 60 %, measured 48 %, far within; looser, 64 * 64 / 48 = 85.33 % finds 85 %,
    # measured 68 %; halfway, 74.67 % finds 70 %, measured 56 %: the slowest within the budget
    found, target, fraction, rounds = calibrated(search(0.05), lambda mask, target: mask * 0.8, 0.64, 3)
    assert (found, target, fraction) == pytest.approx((0.7, 0.7467, 0.56), abs=1e-4)
    assert measured(rounds) == [(0.64, 0.48), (0.8533, 0.68), (0.7467, 0.56)]
    # within the tolerance (1 % below 61 %): kept at once
    assert calibrated(search(0.05), lambda mask, target: mask, 0.61, 3)[2:] == (0.6, [{"target": 0.61,
                                                                                          "measured": 0.6}])
    # masks 10 % apart and a machine 10 % slower: 65 % finds 60 %, measured 66 %; the same mask is not measured
    # again, the target shrinks by 65 / 66 until the 50 % mask is found (the sixth step), measured 55 %; no mask
    # lies between the two: bisection finds only those two, and stops
    found, target, fraction, rounds = calibrated(search(0.1), lambda mask, target: mask * 1.1, 0.65, 3)
    assert found == pytest.approx(0.5) and target == pytest.approx(0.65 * (0.65 / 0.66) ** 6, abs=1e-4)
    assert len(rounds) == 2 and fraction == pytest.approx(0.55)
    # the table has nothing faster (the first mask stays), the measurements run out, and rounds=0 trusts the table
    assert calibrated(search(0.05), lambda mask, target: mask * 3, 0.6, 3) == (0.6, 0.6, 1.8, [{"target": 0.6,
                                                                                              "measured": 1.8}])
    assert len(calibrated(search(0.05), lambda mask, target: mask * 1.25, 0.6, 1)[3]) == 1
    assert calibrated(search(0.05), lambda mask, target: 1 / 0, 0.6, 0) == (0.6, 0.6, None, [])


def test_a_latency_budget_is_met_in_ctranslate2_and_its_table_is_kept(trained_run, tmp_path):
    """prune.latency_budget: a per_stack mask whose predicted latency meets the budget, measured afterwards in
    CTranslate2 (metrics); the latency table is measured once and read again by the next run, which, asked for
    a budget no mask meets, says the fastest reachable in one line; a free layout is refused in one line."""
    pytest.importorskip("ctranslate2")
    from test_prune_cli import is_per_stack
    quick = ["latency.sentences=24", "latency.rounds=1", "latency.min_seconds=0.1", "prune.layout=per_stack",
             "prune.units=[heads,neurons]",
             "prune.calibration.sentences=32", "prune.export=false",
             f"paths.data_root={tmp_path / 'data'}"]
    out = tmp_path / "run"
    hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={out}", *FISHER, *quick, "prune.latency_budget=0.8")
    m = json.loads((out / "metrics.json").read_text())
    assert m["latency_pct_predicted"] <= 100 * m["latency_target"] + 1e-6 and m["kept_neurons"] > 0
    rounds = m["latency_calibration"]  # measured, and searched again on a tighter target while over the budget
    assert 1 <= len(rounds) <= 4 and rounds[0]["target"] == 0.8
    assert all(r["predicted"] <= r["target"] + 1e-4 for r in rounds)  # each mask found fits its target
    kept = [r for r in rounds if r["target"] == m["latency_target"]]
    assert len(kept) == 1 and m["latency_pct_measured"] == pytest.approx(100 * kept[0]["measured"], abs=0.01)
    within = [r["measured"] for r in rounds if r["measured"] <= 0.8]  # the slowest within the budget is kept
    assert m["latency_met"] == bool(within) and (not within or kept[0]["measured"] == max(within))
    # the tuning's teacher, the search at the square root of the target, may choose other head counts per stack:
    # it is given every unit the student keeps
    table = pd.read_csv(out / "fisher.csv")
    assert (table["teacher"] >= table["kept"]).all()
    assert is_per_stack({k: v for k, v in json.loads((out / "head_mask.json").read_text()).items() if "ffn" not in k})
    tables = list((tmp_path / "data" / "latency").glob("*.json"))
    assert [t.stem for t in tables] == [m["latency_table"]]
    # the next run reads the table kept under its key: one whose every curve saves 1 % at its fewest units, so that
    # the fastest mask is predicted at 96 % of the unpruned latency whatever this machine measured
    table = json.loads(tables[0].read_text())
    table["unpruned"], table["interaction"] = 1.0, 0.0
    for family in ("encoder_heads", "decoder_heads", "encoder_ffn", "decoder_ffn"):
        fewest = min(table[family], key=int)
        table[family] = {k: (0.99 if k == fewest else 1.0) for k in table[family]}
    tables[0].write_text(json.dumps(table))
    written = tables[0].read_text()
    proc = hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'bad'}", *FISHER, *quick,
                  "prune.latency_budget=0.9", check=False)
    assert_one_line_error(proc, "heads hold 2 % and FFN neurons 2 % of this model's time",
                          "the fastest the table predicts is 96.0 %", "raise prune.latency_budget")
    assert tables[0].read_text() == written and not (tmp_path / "bad" / "metrics.json").exists()
    proc = hprune("prune", f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'free'}", *FISHER,
                  "prune.latency_budget=0.5", check=False)
    assert_one_line_error(proc, "prune.layout=per_stack")


def test_the_frontier_marks_the_runs_no_other_beats_in_both():
    """Per model: a run is on the accuracy-latency frontier unless another run of the same model has at least its
    BLEU at no more latency, and is better in one; runs without a measured latency are left out."""
    from hprune.reporting.collect import Collection
    from hprune.reporting.tables import frontier
    runs = pd.DataFrame({"checkpoint": ["a", "a", "a", "a", "b"], "run": ["r1", "r2", "r3", "r4", "r5"],
                         "method": ["fisher"] * 5, "bleu": [90.0, 80.0, 85.0, 70.0, 10.0],
                         "latency_pct_measured": [80.0, 70.0, 90.0, float("nan"), 99.0],
                         "macs_per_token_pruned": [50.0, float("nan"), 60.0, 40.0, 90.0],
                         "macs_per_token_unpruned": [100.0] * 5})
    table = frontier(Collection(runs, pd.DataFrame()))
    assert dict(zip(table["run"], table["frontier"])) == {"r1": True, "r2": True, "r3": False, "r5": True}
    assert dict(zip(table["run"], table["model MACs %"])) == pytest.approx({"r1": 50.0, "r2": float("nan"), "r3": 60.0,
                                                                           "r5": 90.0}, nan_ok=True)


def test_the_frontier_holds_the_unpruned_model_each_recovery_and_the_timing_noise(tmp_path):
    """The unpruned model is the reference point (100 %, its BLEU); a run whose latency is within its timing rounds
    of the unpruned model's is beaten by it (faster- or slower-looking by noise is neither); a recovery (a run's own stage,
    or `hprune recover` of the run) is a point at the pruned model's latency and MACs; every point has its MACs."""
    from hprune.reporting.collect import Collection
    from hprune.reporting.tables import frontier
    nan = float("nan")
    fisher = tmp_path / "fisher"
    runs = pd.DataFrame({
        "checkpoint": ["a"] * 5, "run": ["michel", str(fisher), "close", "all", str(tmp_path / "kd")],
        "verb": ["prune", "prune", "prune", "prune", "recover"], "method": ["michel", "fisher", "fisher", "michel", nan],
        "bleu": [90.0, 70.0, 99.5, 100.0, nan], "bleu_unpruned": [100.0, 100.0, 100.0, 100.0, nan],
        "latency_pct_measured": [105.0, 80.0, 99.0, 96.0, nan], "latency_pct_low": [98.0, 78.0, 96.0, 94.0, nan],
        "latency_pct_high": [110.0, 83.0, 103.0, 101.0, nan],
        "macs_per_token_pruned": [60.0, 50.0, 90.0, 100.0, nan],
        "macs_per_token_unpruned": [100.0, 100.0, 100.0, 100.0, nan],
        "bleu_recovered": [nan, 95.0, nan, nan, 97.0], "bleu_before_recovery": [nan, 70.0, nan, nan, 70.0],
        "recovery_loss": [nan, "word", nan, nan, "sequence"], "recovery_updates": [nan, 300, nan, nan, 300],
        "recovery_seconds": [nan, 60.0, nan, nan, 70.0], "p_recovered_vs_pruned": [nan, 0.001, nan, nan, 0.001],
        "p_recovered_vs_unpruned": [nan, 0.01, nan, nan, 0.2],
        "mask": [nan, nan, nan, nan, str(fisher / "head_mask.json")]})
    table = frontier(Collection(runs, pd.DataFrame()))
    table["name"] = table["method"] + " " + table["stage"]
    assert sorted(table["name"]) == ["fisher + sequence recovered", "fisher + word recovered", "fisher pruned",
                                     "fisher pruned", "michel pruned", "michel pruned", "unpruned unpruned"]
    # "all": every head kept, timed at 96 % (94-101 %): noise; the unpruned model stands for it
    assert set(table.loc[table["frontier"], "name"]) == {"unpruned unpruned", "fisher + sequence recovered"}
    recovered = table[table["stage"] == "recovered"]
    assert (recovered["latency %"] == 80.0).all() and (recovered["model MACs %"] == 50.0).all()
    assert not table["model MACs %"].isna().any()
    from hprune.reporting.plots import frontier as draw
    assert draw(table, tmp_path / "frontier.png").stat().st_size > 0


def test_settings_that_cannot_work_are_refused(monkeypatch):
    """Before any work, one line each: a latency budget without ctranslate2 (names the extra), outside (0, 1],
    units that are not heads or neurons (an MoA model's experts are its heads)."""
    import importlib.util

    from omegaconf import OmegaConf

    from hprune.errors import UserError
    from hprune.methods.fisher import FisherSettings, check_settings
    settings = OmegaConf.structured(FisherSettings(types=["enc-self"], layout="per_stack", latency_budget=0.5))
    check_settings(settings)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ctranslate2" else real(name, *a))
    with pytest.raises(UserError, match=r"needs the ctranslate2 package.*hprune\[deploy\]"):
        check_settings(settings)
    monkeypatch.undo()
    for key, value, words in (("latency_budget", 1.5, "outside"), ("units", ["experts"], "experts are pruned as its heads")):
        bad = settings.copy()
        bad[key] = value
        with pytest.raises(UserError, match=words):
            check_settings(bad)


def test_timing_noise_is_pooled_into_a_monotone_curve():
    """Pool adjacent violators: the closest non-decreasing curve in least squares (a worked case)."""
    from hprune.deploy.latency import monotone
    assert monotone({0: 1.0, 1: 3.0, 2: 2.0, 3: 4.0}) == {0: 1.0, 1: 2.5, 2: 2.5, 3: 4.0}
    assert monotone({1: 5.0, 2: 1.0, 3: 0.0}) == {1: 2.0, 2: 2.0, 3: 2.0}


def test_a_timing_lasts_at_least_min_seconds(monkeypatch):
    """A batch that takes 20 ms, timed with min_seconds=0.1: translated again until the timing has lasted 0.1 s (5
    or 6 passes after the warm-up), the speed counted over every pass; without it, one pass."""
    import time
    from types import SimpleNamespace

    from hprune.deploy import ctranslate2 as writer
    calls = []

    class Translator:
        def __init__(self, path, **_):
            self.path = path

        def translate_batch(self, sources, **_):
            calls.append(self.path)
            time.sleep(0.02)

    monkeypatch.setattr(writer, "import_ctranslate2", lambda *_: SimpleNamespace(Translator=Translator))
    sources = [["a", "b"]] * 10
    speed = writer.sentences_per_s({"m": "m"}, sources, beam=1, rounds=1, lengths=(5,), min_seconds=0.1)[5]["m"]
    assert 5 <= len(calls) - 1 <= 6 and speed == pytest.approx(10 / 0.02, rel=0.25)
    calls.clear()
    writer.sentences_per_s({"m": "m"}, sources, beam=1, rounds=1, lengths=(5,))
    assert len(calls) == 2


def test_the_table_times_each_point_beside_the_unpruned_model_two_models_at_most(monkeypatch, tmp_path):
    """ratios_to_unpruned: each point's best timing over the unpruned model's best timing beside it, the point's
    model written, timed and removed in its turn (never more than two loaded), on a machine whose speed halves
    half-way through (the ratio to the neighbouring unpruned timing does not move)."""
    import time
    from types import SimpleNamespace

    from hprune.deploy import latency
    loaded, slow = {"now": 0}, {"factor": 1.0}

    class Translator:
        def __init__(self, path, **_):
            self.cost = float((Path(path) / "cost").read_text())
            loaded["now"] += 1

        def translate_batch(self, sources, **_):
            time.sleep(0.004 * self.cost * slow["factor"])

        def __del__(self):
            loaded["now"] -= 1

    monkeypatch.setattr(latency, "import_ctranslate2", lambda *_: SimpleNamespace(Translator=Translator))
    monkeypatch.setattr(latency, "model_spec", lambda model, *_: model)
    monkeypatch.setattr(latency, "save", lambda cost, folder, _: (Path(folder) / "cost").write_text(str(cost)))
    most = []

    def build(cost: float):
        def built():
            most.append(loaded["now"])
            if cost == 2.0:
                slow["factor"] = 2.0  # the machine slows down from the third point on
            return cost
        return built

    settings = latency.LatencySettings(rounds=2, min_seconds=0.0)
    ratios, references = latency.ratios_to_unpruned(build(5.0), {"a": build(4.0), "b": build(2.5), "c": build(2.0)},
                                                    None, ("src", "tgt"), [["x"]] * 4, 3, settings)
    assert ratios == pytest.approx({"a": 0.8, "b": 0.5, "c": 0.4}, rel=0.2)
    assert references[0] == pytest.approx(0.005, rel=0.3) and references[2] == pytest.approx(0.01, rel=0.3)
    assert max(most) <= 1 and loaded["now"] == 0  # the unpruned one loaded beside each point built; none left

