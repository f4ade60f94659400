"""Hard Concrete head gates and the L0 criterion against their closed forms."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")

from hprune_fairseq.gates import HardConcreteGate  # noqa: E402

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
    loaded.model.add_gates(["enc-self", "dec-enc"], init=0.5)
    return loaded


def test_gradients_reach_log_alpha_and_penalties_follow_their_normalisation(gated):
    from hprune import backend
    from hprune_fairseq.criterion import L0Criterion
    model = gated.model
    gates = [m.gate for _, _, m in model.gates()]
    assert len(gates) == 6
    p_open = torch.sigmoid(torch.tensor(0.5 + 0.33 * math.log(11))).item()
    assert model.gate_penalty("sum").item() == pytest.approx(24 * p_open, rel=1e-5)
    assert model.gate_penalty("layer_mean").item() == pytest.approx(4 * p_open, rel=1e-5)

    sample = next(backend.batches(gated, "valid", 600, 1))
    model.train()
    losses = {}
    for lam in (0.0, 2.0):
        criterion = L0Criterion(gated.task, False, 0.1, l0_lambda=lam, l0_normalize="sum")
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
    module.prune_heads([1, 3])
    assert module.gate.log_alpha.tolist() == [2.0, 4.0]


def test_fairseq_train_parses_the_gate_and_criterion_flags():
    """The criterion's dataclass becomes fairseq-train flags (a postponed-annotations module would break this)."""
    from fairseq import options

    from hprune.backend import PLUGIN_DIR
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["data", "--user-dir", PLUGIN_DIR, "--arch", "hprune_transformer",
                                                "--criterion", "hprune_l0", "--l0-lambda", "0.05",
                                                "--l0-normalize", "layer_mean", "--head-gates", "enc-self,dec-enc"])
    assert (args.l0_lambda, args.l0_normalize, args.head_gates) == (0.05, "layer_mean", "enc-self,dec-enc")
