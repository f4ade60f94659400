"""Hard Concrete head gates and the L0 criterion against their closed forms."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")

from hprune_fairseq.mechanisms.gates import (  # noqa: E402
    GatesConfig,
    HardConcreteGate,
    add_gate,
    add_gates,
    budget_multiplier,
    gate_penalty,
    gated_heads,
)

LOG_ALPHAS = [-4.0, -2.0, -0.5, 0.0, 0.8, 2.5]


@pytest.mark.parametrize("log_alpha", LOG_ALPHAS)
def test_samples_match_the_closed_forms(log_alpha):
    """P(g ≠ 0) = sigmoid(log α + β ln 11), P(g = 1) = sigmoid(log α - β ln 11), g in [0, 1]; 400k samples."""
    torch.manual_seed(0)
    gate = HardConcreteGate(400_000, init=log_alpha).train()
    g = gate()
    shift = 0.33 * math.log(11)
    p_open, p_one = 1 / (1 + math.exp(-(log_alpha + shift))), 1 / (1 + math.exp(-(log_alpha - shift)))
    assert g.min() >= 0 and g.max() <= 1
    assert (g > 0).float().mean().item() == pytest.approx(p_open, abs=0.004)
    assert (g == 1).float().mean().item() == pytest.approx(p_one, abs=0.004)
    assert gate.p_open()[0].item() == pytest.approx(p_open, abs=1e-6)
    # two training calls draw fresh noise; eval mode is the deterministic gate
    assert not torch.equal(gate()[:100], gate()[:100]) or log_alpha in (-4.0,)
    expected = min(max(torch.sigmoid(torch.tensor(log_alpha)).item() * 1.2 - 0.1, 0.0), 1.0)
    assert gate.eval()()[0].item() == pytest.approx(expected, abs=1e-6)


def test_deterministic_gate_is_exactly_closed_or_open_beyond_ln_11():
    gate = HardConcreteGate(4)
    with torch.no_grad():
        gate.log_alpha.copy_(torch.tensor([-math.log(11) - 1e-3, -2.0, 2.0, math.log(11) + 1e-3]))
    values = gate.deterministic()
    assert values[0] == 0 and values[3] == 1 and 0 < values[1] < values[2] < 1


def test_glorot_initialisation_range():
    torch.manual_seed(0)
    log_alpha = HardConcreteGate(8).log_alpha
    bound = math.sqrt(3 / 8)  # Glorot for the reference code's [1, 8, 1, 1] shape: ±0.61
    assert log_alpha.abs().max() <= bound and log_alpha.abs().max() > 0.3


@pytest.fixture()
def gated(trained_run, evaluated_run):
    from hprune import backend
    loaded = backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))
    add_gates(loaded.model, ["enc-self", "dec-enc"], init=0.5)
    return loaded


def test_gradients_reach_log_alpha_and_penalties_follow_their_normalisation(gated):
    from hprune import backend
    from hprune_fairseq.criterion import HpruneCriterion
    model = gated.model
    gates = [m.gate for _, _, m in gated_heads(model)]
    assert len(gates) == 6
    p_open = torch.sigmoid(torch.tensor(0.5 + 0.33 * math.log(11))).item()
    assert gate_penalty(model, "sum").item() == pytest.approx(24 * p_open, rel=1e-5)
    assert gate_penalty(model, "layer_mean").item() == pytest.approx(4 * p_open, rel=1e-5)

    sample = next(backend.batches(gated, "valid", 600, 1))
    model.train()
    losses = {}
    for lam in (0.0, 2.0):
        model.gate_settings = dataclasses.replace(model.gate_settings, l0_lambda=lam, l0_normalize="sum")
        criterion = HpruneCriterion(gated.task, False, 0.1)
        torch.manual_seed(3)  # the same gate noise and dropout for both
        loss, sample_size, logging = criterion(model, sample)
        grads = torch.autograd.grad(loss, [g.log_alpha for g in gates])
        # the translation loss reaches log α through every sampled gate strictly inside (0, 1) (a clipped
        # sample passes no gradient: that is the Hard Concrete); the penalty reaches every gate
        nonzero = torch.cat(grads).ne(0)
        assert nonzero.all() if lam else nonzero.any()
        losses[lam] = (loss.item(), sample_size, grads)
        assert logging["open_heads"].item() == pytest.approx(24 * p_open, rel=1e-5)
    # the penalty adds λ · Σ P(open) per target token, and λ · ∂P/∂log α to each gate's gradient
    (loss0, size, grads0), (loss2, _, grads2) = losses[0.0], losses[2.0]
    assert loss2 - loss0 == pytest.approx(2.0 * 24 * p_open * size, rel=1e-4)
    dp = p_open * (1 - p_open)
    for g0, g2 in zip(grads0, grads2):
        torch.testing.assert_close(g2 - g0, torch.full_like(g0, 2.0 * dp * size), rtol=1e-3, atol=1e-3)


def test_gated_model_loads_an_ungated_checkpoint_and_prunes_its_gates(gated, trained_run):
    """Gates are new parameters: loading a converged ungated checkpoint keeps their initial values; physical
    pruning slices them with their heads."""
    from hprune_fairseq.safe_load import load_checkpoint
    state = load_checkpoint(trained_run / "checkpoints" / "checkpoint_best.pt")["model"]
    gated.model.load_state_dict(state, strict=True)
    module = gated.model.encoder.layers[0].self_attn
    assert torch.equal(module.gate.log_alpha, torch.full((4,), 0.5))
    with torch.no_grad():
        module.gate.log_alpha.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    module.keep_heads([1, 3])
    assert module.gate.log_alpha.tolist() == [2.0, 4.0]


def test_fairseq_train_parses_the_gate_and_criterion_flags():
    """The criterion's dataclass becomes fairseq-train flags (a postponed-annotations module would break this)."""
    from fairseq import options

    from hprune.backend import PLUGIN_DIR
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["data", "--user-dir", PLUGIN_DIR, "--arch", "hprune_transformer",
                                                "--criterion", "hprune", "--l0-lambda", "0.05",
                                                "--l0-normalize", "layer_mean", "--head-gates", "enc-self,dec-enc"])
    assert (args.l0_lambda, args.l0_normalize, args.head_gates) == (0.05, "layer_mean", "enc-self,dec-enc")


def test_folding_the_gates_gives_the_gated_outputs_without_gates():
    """fold_gate scales each head's out_proj columns by its deterministic gate: same eval-mode output."""
    from hprune_fairseq.heads import HeadAttention
    torch.manual_seed(0)
    module = HeadAttention(32, 4, self_attention=True).eval()
    add_gate(module)
    with torch.no_grad():
        module.gate.log_alpha.copy_(torch.tensor([-3.0, -1.0, 0.5, 4.0]))  # gates 0, 0.22, 0.63, 1
    x = torch.randn(5, 3, 32)
    gated, _ = module(x, x, x)
    values = module.fold_gate()
    assert module.gate is None and values[0] == 0 and values[3] == 1 and 0 < values[1] < values[2] < 1
    folded, _ = module(x, x, x)
    torch.testing.assert_close(folded, gated, rtol=1e-5, atol=1e-6)


def test_gates_on_out_proj_columns_equal_gating_the_head_outputs():
    """In training the gates scale out_proj's columns; with record_outputs they multiply the head outputs
    instead (those are recorded gated). Same gate sample: the same output and the same gradients."""
    from hprune_fairseq.heads import HeadAttention
    torch.manual_seed(0)
    module = HeadAttention(32, 8, self_attention=True).train()
    add_gate(module, init=0.0)
    x = torch.randn(5, 3, 32, requires_grad=True)
    results = []
    for record in (False, True):
        module.record_outputs = record
        torch.manual_seed(2)  # the same gate sample, six of eight strictly inside (0, 1)
        out, _ = module(x, x, x, need_weights=False)
        params = [module.gate.log_alpha, module.out_proj.weight, module.q_proj.weight, x]
        results.append((out, torch.autograd.grad(out.pow(2).sum(), params)))
    (out, grads), (reference, reference_grads) = results
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    assert grads[0].ne(0).sum() >= 2  # gates sampled strictly inside (0, 1) pass a gradient
    for grad, reference_grad in zip(grads, reference_grads):
        torch.testing.assert_close(grad, reference_grad, rtol=1e-4, atol=1e-6)


class BudgetModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("budget_state", torch.zeros(2, dtype=torch.long))


def test_budget_multiplier_follows_the_target_staircase():
    """λ = gain · (kept − target); the target falls one head at a time from the start count to K over the
    warm-up, and is K afterwards. The schedule runs on the updates taken (budget_state[0], which fairseq's
    update count sets), so the batches of one update get the same λ; training batches record the start."""
    settings = GatesConfig(l0_budget=6, l0_budget_gain=0.05, l0_budget_warmup=100)
    model = BudgetModel()
    kept = torch.tensor(12)
    assert budget_multiplier(model, settings, kept, advance=True).item() == 0  # target 12 at the start
    assert model.budget_state.tolist() == [0, 12]
    assert budget_multiplier(model, settings, torch.tensor(12), advance=True).item() == 0  # a second batch of it
    model.budget_state[0] = 50  # target 6 + ceil(6 · 50 / 100) = 9
    assert budget_multiplier(model, settings, torch.tensor(12), advance=False).item() == pytest.approx(0.15)
    model.budget_state[0] = 99  # ceil(6 / 100) = 1 head above the budget
    assert budget_multiplier(model, settings, torch.tensor(7), advance=False).item() == pytest.approx(0.0)
    model.budget_state[0] = 500
    assert budget_multiplier(model, settings, torch.tensor(5), advance=True).item() == pytest.approx(-0.05)
    assert model.budget_state.tolist() == [500, 12]  # the start count is kept from the first update


def test_schedules_end_at_the_same_update_on_one_worker_with_update_freq_2_and_on_two_workers(gated):
    """Voita's head-budget warm-up and DSP's temperature run on fairseq's update count, which its task sets on
    the model before every training batch (model.set_num_updates): one worker with update_freq 2 sees each update
    twice, each of two workers once, and the schedules give the same value at every update (counting batches,
    they ran twice as fast on the one worker)."""
    from hprune_fairseq.mechanisms.subset import SubsetSelector
    settings = GatesConfig(l0_budget=6, l0_budget_gain=0.05, l0_budget_warmup=10)
    model = gated.model

    def run(batches_per_update: int) -> list:
        model.budget_state.zero_()
        selector = SubsetSelector(count=8, k=3, cooldown=10).train()
        seen = []
        for update in range(14):
            for _ in range(batches_per_update):
                model.set_num_updates(update)  # as fairseq's task.train_step does
                selector.set_num_updates(update)  # (a submodule of a DSP model: reached by the same call)
                selector.sample()
                seen.append((update, budget_multiplier(model, settings, torch.tensor(12), advance=True).item(),
                             selector.temperature()))
        return sorted(set(seen))
    one_worker_update_freq_2, each_of_two_workers = run(2), run(1)
    assert one_worker_update_freq_2 == each_of_two_workers
    warm = [update for update, multiplier, _ in each_of_two_workers if multiplier == pytest.approx(0.3)]
    assert warm[0] == 10  # the target reaches K = 6 at update 10 (λ = 0.05 · (12 − 6))
    assert [t for u, _, t in each_of_two_workers if u >= 10] == [1e-8] * 4  # cooled at update 10


def test_logged_gate_and_moa_values_are_the_same_on_two_workers_and_on_one_with_update_freq_2():
    """fairseq hands reduce_metrics the update's logging outputs one by one on one worker, and summed into one
    dict on several (the criterion's outputs can be summed): the logged means must not see the difference (they
    came out 2x here, one worker of two with one batch each)."""
    from fairseq.logging import metrics

    from hprune_fairseq.criterion import HpruneCriterion
    batches = [{"loss": 10.0, "nll_loss": 8.0, "ntokens": 20, "nsentences": 2, "sample_size": 20, "open_heads": 9.5,
                "alive_heads": 9, "kept_heads": 10, "l0_lambda": 0.2, "moa_aux": 0.03, "extra_batches": 1},
               {"loss": 12.0, "nll_loss": 9.0, "ntokens": 22, "nsentences": 2, "sample_size": 22, "open_heads": 8.5,
                "alive_heads": 8, "kept_heads": 9, "l0_lambda": 0.1, "moa_aux": 0.05, "extra_batches": 1}]
    summed = {key: sum(batch[key] for batch in batches) for key in batches[0]}  # fairseq's _fast_stat_sync_sum

    def logged(outputs) -> dict:
        with metrics.aggregate(new_root=True) as agg:
            HpruneCriterion.reduce_metrics(outputs)
        return {key: round(float(value), 6) for key, value in agg.get_smoothed_values().items()}
    one_worker, two_workers = logged(batches), logged([summed])
    assert one_worker == two_workers
    assert (one_worker["open_heads"], one_worker["alive_heads"], one_worker["l0_lambda"], one_worker["moa_aux"]) == \
        (9.0, 8.5, 0.15, 0.04)


def test_budget_state_is_saved_with_the_model(gated, trained_run):
    """A resumed budget run continues its controller: the state is a model buffer; an ungated checkpoint
    loads with it at zero."""
    from hprune_fairseq.safe_load import load_checkpoint
    model = gated.model
    state = load_checkpoint(trained_run / "checkpoints" / "checkpoint_best.pt")["model"]
    model.load_state_dict(state, strict=True)
    assert model.budget_state.tolist() == [0, 0]
    model.budget_state.copy_(torch.tensor([7, 12]))
    assert model.state_dict()["budget_state"].tolist() == [7, 12]
    model.fold_mechanisms()
    assert "budget_state" not in model.state_dict() and not list(gated_heads(model)) and not model.mechanisms()
