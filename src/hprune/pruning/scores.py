"""Per-head scores that order heads for pruning; a higher score means a more important head (the math; the
registered orders that use it are in methods/orders.py).

Each function returns a DataFrame (type, layer, head, importance) over the heads the model still has.

* `michel`: Michel et al. 2019's head importance, as their MT code computed it. With ctx_{h,t} a head's output
  before out_proj at token t, I_h = (1/N_tokens) Σ_t |⟨ctx_{h,t}, ∂L/∂ctx_{h,t}⟩| = E_t |∂L/∂ξ_{h,t}| at ξ = 1,
  L the training criterion in eval mode. One forward and one backward per batch give every head of every
  attention type; the backward asks autograd only for the head outputs' gradients, so no weight gradient is
  computed.
* `confidence`: Voita et al. 2019's mean maximum attention weight, EOS excluded.
* `magnitude`: Σ|W| + Σ|b| of the head's q/k/v rows, the L1 criterion of fairseq's
  `MultiheadAttention._get_reserve_head_index` (used for RoBERTa).
* `random`: uniform scores from a seeded generator.
`mask_gradients` gives Kwon et al.'s head-mask gradients of the negative log-likelihood, per sentence (the
paper's empirical Fisher) or per batch (their code's), whose squares sum to the diagonal Fisher information
their retraining-free pruning ranks heads by (methods/fisher.py).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Tuple

import pandas as pd
import torch

from ..attention_types import FFN_TYPES
from .heads import moa_layers, moa_types


def _table(model, values: Dict[Tuple[str, int], torch.Tensor]) -> pd.DataFrame:
    """{(type, layer): (heads present,) scores} -> rows, heads under their original ids."""
    rows = []
    for attn_type, layer, module in model.attention_modules():
        for local, h in enumerate(module.head_ids):
            rows.append((attn_type, layer, h, float(values[(attn_type, layer)][local])))
    return pd.DataFrame(rows, columns=["type", "layer", "head", "importance"])


def _non_pad(sample: dict, pad: int) -> Dict[str, torch.Tensor]:
    """Query positions that are real tokens, per attention (and FFN) type: (batch, len) booleans."""
    source = sample["net_input"]["src_tokens"].ne(pad)
    target = sample["target"].ne(pad)
    return {"enc-self": source, "dec-self": target, "dec-enc": target, "enc-ffn": source, "dec-ffn": target}


def nll(model, sample: dict, pad: int) -> Tuple[torch.Tensor, int]:
    """The summed negative log-likelihood of the sample's targets (no label smoothing, no auxiliary loss), and
    the target tokens it sums over."""
    logits = model(**sample["net_input"])
    lprobs = model.get_normalized_probs(logits, log_probs=True)
    target = sample["target"]
    picked = lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1).float()
    real = target.ne(pad)
    return -(picked * real).sum(), int(real.sum())


def _output_gradients(model, loss_of: Callable, batches: Iterable[dict], per_token_loss: bool = False,
                      neurons: bool = False):
    """For each batch: the sample and, per attention sublayer, (type, layer, head outputs, their gradient) after
    one forward and one backward of `loss_of(model, sample) -> (summed loss, sample size, ...)` in eval mode
    (gradient None where no head reaches the loss). `per_token_loss`: the loss divided by its sample size
    (target tokens), as a mean-loss training step sees it. `neurons`: each FFN too, (FFN type, layer, its
    neurons' activations (len, batch, neurons), their gradient)."""
    model.eval()
    modules = [(attn_type, layer, m, "head_outputs") for attn_type, layer, m in model.attention_modules()]
    if neurons:
        modules += [(ffn_type, layer, block.fc2, "neuron_inputs") for ffn_type, layer, block in model.ffn_layers()]
    model.record_heads(outputs=True)
    model.record_neurons(inputs=neurons)
    try:
        for sample in batches:
            loss, sample_size = loss_of(model, sample)[:2]
            if per_token_loss:
                loss = loss / sample_size
            recorded = [(unit_type, layer, getattr(m, name)) for unit_type, layer, m, name in modules
                        if getattr(m, name) is not None]
            grads = torch.autograd.grad(loss, [out for _, _, out in recorded], allow_unused=True)
            yield sample, [(unit_type, layer, out.detach(), grad) for (unit_type, layer, out), grad in zip(recorded, grads)]
    finally:
        model.record_heads()
        model.record_neurons()


def _mask_gradient_per_token(out: torch.Tensor, grad: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """∂L/∂ξ_h at each real query token, (batch, heads, len): a head mask ξ multiplies the head's output, so its
    gradient is the output · the output's gradient (0 at padding)."""
    return (out.float() * grad.float()).sum(-1) * real.unsqueeze(1)


def michel(model, criterion, batches: Iterable[dict], pad: int) -> Tuple[pd.DataFrame, Dict[str, int]]:
    """Head importance summed over batches, divided by the non-pad query tokens of its side (source tokens for
    enc-self, target tokens for the decoder's two). Returns the table and the token counts."""
    totals = {(attn_type, layer): torch.zeros(m.num_heads, dtype=torch.float64)
              for attn_type, layer, m in model.attention_modules()}
    tokens = {"enc-self": 0, "dec-self": 0, "dec-enc": 0}
    for sample, recorded in _output_gradients(model, criterion, batches):  # the training loss, as Michel's code
        real = _non_pad(sample, pad)
        for attn_type, layer, out, grad in recorded:
            if grad is None:  # a head set that cannot reach the loss (all masked)
                continue
            totals[(attn_type, layer)] += _mask_gradient_per_token(out, grad, real[attn_type]).abs().sum((0, 2)).double().cpu()
        for attn_type in tokens:
            tokens[attn_type] += int(real[attn_type].sum())
    if not tokens["enc-self"]:
        raise ValueError("no batches: head importance needs at least one sentence")
    values = {(attn_type, layer): total / tokens[attn_type] for (attn_type, layer), total in totals.items()}
    return _table(model, values), tokens


def mask_gradients(model, batches: Iterable[dict], pad: int, per: str = "sentence",
                   neurons: bool = False) -> Tuple[list, torch.Tensor]:
    """∂L/∂ξ_h at ξ = 1 of every head present, L the negative log-likelihood (Kwon et al.'s head-mask gradients:
    signed sums, not Σ|per token| as Michel's importance). per="sentence": one row per sentence, L its summed
    NLL (the paper's per-example Fisher; the sentences of a batch do not interact, so the per-token products
    ⟨ctx_h, ∂L/∂ctx_h⟩ of one backward, summed over each sentence's tokens, are its gradients); per="batch": one
    row per batch, L the batch's mean NLL per target token (the reference code's). `neurons`: the FFN neurons'
    too, a mask on each neuron's activation (fc2's input; Kwon et al.'s neuron mask), ⟨a_n, ∂L/∂a_n⟩ summed
    over the same tokens. Returns the units, as (type, layer, original id) in the model's order (heads, then
    neurons), and the (rows, units) gradients."""
    if per not in ("sentence", "batch"):
        raise ValueError(f"per={per}: mask gradients are per sentence or per batch")
    sublayers = [(attn_type, layer, m.head_ids) for attn_type, layer, m in model.attention_modules()]
    if neurons:
        sublayers += [(ffn_type, layer, block.fc2.neuron_ids) for ffn_type, layer, block in model.ffn_layers()]
    units = [(unit_type, layer, u) for unit_type, layer, ids in sublayers for u in ids]
    rows = []
    loss_of = lambda model_, sample: nll(model_, sample, pad)  # noqa: E731
    for sample, recorded in _output_gradients(model, loss_of, batches, per_token_loss=per == "batch",
                                              neurons=neurons):
        real = _non_pad(sample, pad)
        found = {(unit_type, layer): (out, grad) for unit_type, layer, out, grad in recorded}
        block = []
        for unit_type, layer, ids in sublayers:
            out, grad = found.get((unit_type, layer), (None, None))
            if grad is None:
                block.append(torch.zeros(len(sample["id"]), len(ids), dtype=torch.float64))
            elif unit_type in FFN_TYPES:  # (len, batch, neurons), time-major as fairseq's layers
                block.append((out.float() * grad.float() * real[unit_type].t().unsqueeze(-1)).sum(0).double().cpu())
            else:
                block.append(_mask_gradient_per_token(out, grad, real[unit_type]).sum(2).double().cpu())  # (sentences, heads)
        block = torch.cat(block, dim=1)
        rows.append(block if per == "sentence" else block.sum(0, keepdim=True))
    if not rows:
        raise ValueError("no batches: head-mask gradients need at least one sentence")
    return units, torch.cat(rows)


@torch.no_grad()
def confidence(model, batches: Iterable[dict], pad: int, eos: int) -> pd.DataFrame:
    """Mean over real query tokens of the largest weight a head puts on a real key other than EOS (fairseq's
    decoder input starts with EOS, so dec-self's first position, which can only see it, is left out)."""
    model.eval()
    modules = list(model.attention_modules())
    if moa_types(model):
        raise ValueError("confidence needs per-head attention maps, which MoA experts do not have; "
                         "rank MoA experts with michel, magnitude or random")
    totals = {(attn_type, layer): torch.zeros(m.num_heads, dtype=torch.float64) for attn_type, layer, m in modules}
    counts = {(attn_type, layer): 0 for attn_type, layer, _ in modules}
    model.record_heads(weights=True)
    try:
        for sample in batches:
            model(**sample["net_input"])
            source, decoder_in = sample["net_input"]["src_tokens"], sample["net_input"]["prev_output_tokens"]
            real = _non_pad(sample, pad)
            for attn_type, layer, m in modules:
                if m.head_weights is None:
                    continue
                keys = decoder_in if attn_type == "dec-self" else source
                key_ok = keys.ne(pad) & keys.ne(eos)  # (batch, src_len)
                reachable = key_ok.unsqueeze(1)  # (batch, 1 or tgt_len, src_len)
                if attn_type == "dec-self":
                    causal = torch.ones(keys.size(1), keys.size(1), dtype=torch.bool, device=keys.device).tril()
                    reachable = reachable & causal
                query_ok = real[attn_type] & reachable.any(-1)
                best = m.head_weights.float().masked_fill(~key_ok[:, None, None, :], 0.0).amax(-1)
                totals[(attn_type, layer)] += (best * query_ok.unsqueeze(1)).sum((0, 2)).double().cpu()
                counts[(attn_type, layer)] += int(query_ok.sum())
    finally:
        model.record_heads()
    return _table(model, {key: total / max(counts[key], 1) for key, total in totals.items()})


@torch.no_grad()
def magnitude(model) -> pd.DataFrame:
    values = {}
    experts = {(attn_type, layer) for attn_type, layer, _ in moa_layers(model)}
    for attn_type, layer, m in model.attention_modules():
        if (attn_type, layer) in experts:  # Σ|W_q^e| + Σ|W_o^e| (the shared K/V belong to no expert)
            values[(attn_type, layer)] = (m.q_experts.abs().double().sum((1, 2))
                                     + m.o_experts.abs().double().sum((1, 2))).cpu()
            continue
        per_head = torch.zeros(m.num_heads, dtype=torch.float64)
        for proj in (m.q_proj, m.k_proj, m.v_proj):
            per_head += proj.weight.abs().double().sum(1).view(m.num_heads, m.head_dim).sum(1).cpu()
            if proj.bias is not None:
                per_head += proj.bias.abs().double().view(m.num_heads, m.head_dim).sum(1).cpu()
        values[(attn_type, layer)] = per_head
    return _table(model, values)


def random(model, seed: int) -> pd.DataFrame:
    """Uniform scores drawn per head in the unpruned layout, so a head's score does not depend on which other
    heads were removed."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for attn_type, layer, m in model.attention_modules():
        values[(attn_type, layer)] = torch.rand(m.total_heads, generator=generator, dtype=torch.float64)[m.head_ids]
    return _table(model, values)


def normalize_by_layer(scores: pd.DataFrame) -> pd.DataFrame:
    """I_{l,h} / ||I_l||_2 within each (type, layer), as Michel et al.'s --normalize-by-layer."""
    norms = scores.groupby(["type", "layer"])["importance"].transform(lambda s: (s.pow(2).sum()) ** 0.5 + 1e-20)
    return scores.assign(importance=scores["importance"] / norms)
