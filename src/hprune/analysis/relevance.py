"""Head relevance by layer-wise relevance propagation through a whole hprune model (Voita et al. 2019, §4).

For each sentence, teacher-forced on its reference, every target position p seeds relevance 1 on its top-1
logit; the relevance is propagated back through the decoder (self-attention, encoder attention, FFN, each
with its residual connection and layer norm), into the encoder through the encoder attentions' keys and
values, and down the encoder, with the α-β rule of lrp.py at every step. A head's relevance for seed p is
the relevance on its output neurons right after the output projection's relprop (the reference's
`out_conv.relprop` then `_split_heads`); it is summed over positions and averaged over every target token of
the split: the share of a prediction's relevance that passes through the head.

Where this follows the-story-of-heads (`transformer_lrp.py`, `attn_lrp.py`, `basic.py`): α = β = 0.5,
ε = 1e-5, the bias spread evenly over a layer's inputs, the full attention Jacobian, ReLU passed through (the
FFN's two linear maps only), the residual split by the α-β rule over its two addends, relevance conserved
after every step, the final layer norms of encoder and decoder passed through unchanged, seeds on the top-1
logit. Where it departs: relevance is conserved per seed and position rather than over a whole batch (the
notebook runs one seed at a time, which is the same thing); a masked head receives none (the reference
would give it its share of the bias); MoA layers (not in the reference) treat the router's weights as
constants, as the attention weights' own rule would, and an expert's relevance is that on its output slots.

The layers are recomputed from their inputs as the model ran them (captured by hooks), and each recomputed
output is checked against the model's own, so an unsupported layer fails loudly instead of giving wrong
numbers.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from . import lrp

CHECK_TOLERANCE = 1e-3  # largest |recomputed - model| of a layer output, relative to its scale
HEAD_CHUNK_ELEMENTS = 1 << 24  # heads propagated together: their key Jacobians stay under 64 MiB in fp32


class UnsupportedModel(ValueError):
    """The model has a layer this propagation does not know (it says which)."""


@dataclass
class Trace:
    """One sentence's propagation: per attention sublayer the relevance of each unit present (seeds, units), and
    the total relevance at every block boundary (seeds,), for conservation checks."""
    heads: Dict[Tuple[str, int], Tensor] = field(default_factory=dict)
    totals: List[Tuple[str, Tensor]] = field(default_factory=list)


# --------------------------------------------------------------------------------------- attention sublayers
def _is_moa(module) -> bool:
    return hasattr(module, "q_experts")


def _check_plain(module) -> None:
    if module.gate is not None:
        raise UnsupportedModel("LRP runs on plain models: fold or drop the head gates first")


def attend(module, x_q: Tensor, x_kv: Tensor, causal: bool) -> Tuple[Tensor, dict]:
    """The sublayer's output (T, d) for one sentence, and what its relprop needs."""
    _check_plain(module)
    if module.num_heads == 0:  # every unit removed: the sublayer adds a constant
        bias = getattr(getattr(module, "out_proj", None), "bias", None)
        out = x_q.new_zeros(x_q.shape) if bias is None else bias.expand(x_q.size(0), -1)
        return out, {"empty": True}
    if _is_moa(module):
        return _attend_moa(module, x_q, x_kv, causal)
    heads, dim = module.num_heads, module.head_dim
    q = F.linear(x_q, module.q_proj.weight, module.q_proj.bias).view(-1, heads, dim)
    k = F.linear(x_kv, module.k_proj.weight, module.k_proj.bias).view(-1, heads, dim)
    v = F.linear(x_kv, module.v_proj.weight, module.v_proj.bias).view(-1, heads, dim)
    allowed = torch.ones(q.size(0), k.size(0), dtype=torch.bool, device=q.device).tril() if causal else None
    logits = module.scaling * torch.einsum("thc,shc->hts", q, k)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    context = torch.einsum("hts,she->the", torch.softmax(logits, -1), v)
    alive = torch.ones(heads, dtype=torch.bool, device=q.device)
    if module.head_mask is not None:
        mask = module.head_mask.to(context.dtype).view(-1)
        context, alive = context * mask.view(1, -1, 1), mask != 0
    out = F.linear(context.reshape(context.size(0), -1), module.out_proj.weight, module.out_proj.bias)
    return out, {"q": q, "k": k, "v": v, "context": context, "alive": alive, "allowed": allowed}


def _attend_moa(module, x_q: Tensor, x_kv: Tensor, causal: bool) -> Tuple[Tensor, dict]:
    """A MoA layer: each token's k slots (expert queries) attend the shared keys and values."""
    weights, experts, _, _ = module.route(x_q, None)
    if experts.size(1) == module.num_heads:  # dense routing: slots in expert order
        weights = weights.new_zeros(weights.shape).scatter(1, experts, weights)
        experts = torch.arange(module.num_heads, device=x_q.device).expand_as(experts)
    n, slots = experts.shape
    w_q = module.q_experts[experts]  # (T, k, d, hd)
    queries = torch.einsum("td,tkdc->tkc", x_q, w_q)
    keys, values = F.linear(x_kv, module.k_proj.weight), F.linear(x_kv, module.v_proj.weight)
    allowed = None
    if causal:
        allowed = torch.ones(n, keys.size(0), dtype=torch.bool, device=x_q.device).tril().repeat_interleave(slots, 0)
    logits = module.scaling * queries.reshape(n * slots, -1) @ keys.t()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    context = (torch.softmax(logits, -1) @ values).view(n, slots, -1)
    w_o = module.o_experts[experts] * weights.unsqueeze(-1).unsqueeze(-1).to(x_q.dtype)  # (T, k, hd, d)
    out = torch.einsum("tkc,tkcd->td", context, w_o)
    return out, {"moa": True, "queries": queries, "keys": keys, "values": values, "context": context,
                 "w_q": w_q, "w_o": w_o, "experts": experts, "allowed": allowed}


def relprop_attention(module, record: dict, relevance: Tensor, x_q: Tensor, x_kv: Tensor, self_attention: bool
                      ) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """Relevance of the sublayer's output (P, T, d) -> relevance of its query input, of its key/value input
    (None for self-attention, where both are the query input) and of each unit present (P, units)."""
    seeds = relevance.size(0)
    if record.get("empty"):  # a constant: no input gets relevance through it (the block gives it to the residual)
        r_kv = None if self_attention else x_kv.new_zeros(seeds, *x_kv.shape)
        return torch.zeros_like(relevance), r_kv, relevance.new_zeros(seeds, 0)
    if record.get("moa"):
        return _relprop_moa(module, record, relevance, x_q, x_kv, self_attention)
    heads, dim = module.num_heads, module.head_dim
    context, alive = record["context"], record["alive"]
    n_q = context.size(0)
    columns = alive.repeat_interleave(dim)
    r_context = relevance.new_zeros(seeds, n_q, heads * dim)
    r_context[..., columns] = lrp.linear(relevance, context.reshape(n_q, -1)[:, columns],
                                         module.out_proj.weight[:, columns], module.out_proj.bias)
    r_context = r_context.view(seeds, n_q, heads, dim)
    r_q, r_k, r_v = (relevance.new_zeros(seeds, record[name].size(0), heads, dim) for name in ("q", "k", "v"))
    live = alive.nonzero().flatten()
    for chunk in live.split(max(1, HEAD_CHUNK_ELEMENTS // (n_q * record["k"].size(0) * dim * dim))):
        parts = lrp.attention(r_context[:, :, chunk].transpose(1, 2), *(record[name][:, chunk].transpose(0, 1)
                              for name in ("q", "k", "v")), module.scaling, record["allowed"])
        for whole, part in zip((r_q, r_k, r_v), parts):
            whole[:, :, chunk] = part.transpose(1, 2)
    r_q, r_k, r_v = (r.flatten(2) for r in (r_q, r_k, r_v))
    w = [module.q_proj, module.k_proj, module.v_proj]
    bias = [p.bias if p.bias is not None else p.weight.new_zeros(p.weight.size(0)) for p in w]
    if self_attention:
        r_x = lrp.linear(torch.cat([r_q, r_k, r_v], -1), x_q, torch.cat([p.weight for p in w]), torch.cat(bias))
        return r_x, None, r_context.sum((1, 3))
    r_x = lrp.linear(r_q, x_q, w[0].weight, bias[0])
    r_kv = lrp.linear(torch.cat([r_k, r_v], -1), x_kv, torch.cat([w[1].weight, w[2].weight]), torch.cat(bias[1:]))
    return r_x, r_kv, r_context.sum((1, 3))


def _relprop_moa(module, record: dict, relevance: Tensor, x_q: Tensor, x_kv: Tensor, self_attention: bool):
    context, experts = record["context"], record["experts"]
    n, slots, hd = context.shape
    seeds = relevance.size(0)
    w_out = record["w_o"].permute(0, 3, 1, 2).reshape(n, -1, slots * hd)  # per token (d, k·hd)
    r_context = lrp.linear(relevance, context.reshape(n, -1), w_out).view(seeds, n, slots, hd)
    units = relevance.new_zeros(seeds, module.num_heads)
    units.index_add_(1, experts.reshape(-1), r_context.sum(-1).reshape(seeds, -1))
    r_q, r_k, r_v = (r[:, 0] for r in lrp.attention(
        r_context.reshape(seeds, 1, n * slots, hd), record["queries"].reshape(1, n * slots, hd),
        record["keys"].unsqueeze(0), record["values"].unsqueeze(0), module.scaling, record["allowed"]))
    w_query = record["w_q"].permute(0, 1, 3, 2).reshape(n, slots * hd, -1)  # per token (k·hd, d)
    w_k, w_v = module.k_proj.weight, module.v_proj.weight
    r_q = r_q.reshape(seeds, n, slots * hd)
    if self_attention:
        combined = torch.cat([w_query, w_k.expand(n, -1, -1), w_v.expand(n, -1, -1)], 1)
        return lrp.linear(torch.cat([r_q, r_k, r_v], -1), x_q, combined), None, units
    return lrp.linear(r_q, x_q, w_query), lrp.linear(torch.cat([r_k, r_v], -1), x_kv, torch.cat([w_k, w_v])), units


# --------------------------------------------------------------------------------------- layers
def _norm(module, x: Tensor) -> Tensor:
    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def _relprop_norm(module, relevance: Tensor, x: Tensor) -> Tensor:
    return lrp.layer_norm(relevance, x, module.weight, module.bias, module.eps)


def _check_layer(layer) -> None:
    for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid"):
        if getattr(layer, name, None) is not None:
            raise UnsupportedModel(f"LRP does not support decoder layers with {name} (NormFormer-style layers)")
    if getattr(layer, "cross_self_attention", False):
        raise UnsupportedModel("LRP does not support cross_self_attention")


class Block:
    """One residual sublayer (attention or FFN) of a layer, pre- or post-norm, recomputed and propagated."""

    def __init__(self, norm, pre_norm: bool, attn_type: Optional[str] = None, layer: int = 0, attention=None,
                 ffn=None, causal: bool = False):
        self.norm, self.pre_norm, self.attn_type, self.layer = norm, pre_norm, attn_type, layer
        self.attention, self.ffn, self.causal = attention, ffn, causal

    def forward(self, x: Tensor, memory: Optional[Tensor] = None) -> Tensor:
        self.x, self.memory = x, memory
        inner = _norm(self.norm, x) if self.pre_norm else x
        self.inner = inner
        if self.attention is not None:
            kv = inner if memory is None else memory
            self.update, self.record = attend(self.attention, inner, kv, self.causal)
        else:
            fc1, fc2, activation = self.ffn
            self.hidden = activation(F.linear(inner, fc1.weight, fc1.bias))
            self.update = F.linear(self.hidden, fc2.weight, fc2.bias)
        self.sum = x + self.update
        return self.sum if self.pre_norm else _norm(self.norm, self.sum)

    def relprop(self, relevance: Tensor, trace: Trace) -> Tuple[Tensor, Optional[Tensor]]:
        """Relevance of the block's output -> of its input and, for encoder attention, of the encoder output."""
        original = relevance
        if not self.pre_norm:
            relevance = _relprop_norm(self.norm, relevance, self.sum)
        r_residual, r_update = lrp.add(relevance, self.x, self.update)
        r_memory = None
        if self.attention is not None:
            kv = self.inner if self.memory is None else self.memory
            r_inner, r_memory, units = relprop_attention(self.attention, self.record, r_update, self.inner, kv,
                                                         self.memory is None)
            trace.heads[(self.attn_type, self.layer)] = units
        else:
            fc1, fc2, _ = self.ffn
            r_hidden = lrp.linear(r_update, self.hidden, fc2.weight, fc2.bias)
            r_inner = lrp.linear(r_hidden, self.inner, fc1.weight, fc1.bias)
        r_sub = _relprop_norm(self.norm, r_inner, self.x) if self.pre_norm else r_inner
        parts = [r_residual + r_sub] + ([r_memory] if r_memory is not None else [])
        conserved = lrp.conserve(original, *parts, dims=(-2, -1))
        return (conserved[0], conserved[1]) if r_memory is not None else (conserved, None)


def blocks(model) -> tuple[List[Block], List[Block]]:
    """The encoder's and the decoder's residual sublayers in forward order (the plugin's description of a layer),
    as blocks relevance is propagated through."""
    out: dict = {"encoder": [], "decoder": []}
    for s in model.sublayers():
        _check_layer(s.block)
        extra = (dict(attention=s.module, causal=s.attn_type == "dec-self") if s.attn_type is not None
                 else dict(ffn=(s.block.fc1, s.block.fc2, s.block.activation_fn)))
        out[s.stack].append(Block(s.norm, s.block.normalize_before, s.attn_type, s.layer, **extra))
    return out["encoder"], out["decoder"]


# --------------------------------------------------------------------------------------- the whole model
def _capture(model, src: Tensor, prev: Tensor) -> dict:
    """Run the model on one sentence; keep every layer's input, the last layer outputs and the logits."""
    seen: dict = {"enc": [], "dec": []}
    hooks = []
    for side in ("enc", "dec"):
        layers = model.encoder.layers if side == "enc" else model.decoder.layers
        for layer in layers:
            hooks.append(layer.register_forward_pre_hook(
                lambda _, args, side=side: seen[side].append(args[0][:, 0].detach())))
    hooks.append(model.encoder.layers[-1].register_forward_hook(
        lambda _, args, out: seen.__setitem__("enc_last", (out[0] if isinstance(out, tuple) else out)[:, 0])))
    hooks.append(model.decoder.layers[-1].register_forward_hook(
        lambda _, args, out: seen.__setitem__("dec_last", out[0][:, 0])))
    try:
        logits, extra = model(src.unsqueeze(0), torch.tensor([src.numel()], device=src.device), prev.unsqueeze(0))
    finally:
        for hook in hooks:
            hook.remove()
    seen["logits"] = logits[0]
    return seen


def _same(computed: Tensor, expected: Tensor, where: str) -> None:
    scale = expected.abs().max().clamp(min=1.0)
    if (computed - expected).abs().max() > CHECK_TOLERANCE * scale:
        raise UnsupportedModel(f"LRP's recomputation of {where} differs from the model's own output "
                               f"(max |diff| {(computed - expected).abs().max():.2e}): a layer it does not support")


@torch.no_grad()
def propagate(model, src: Tensor, prev: Tensor) -> Trace:
    """src: source token ids (S,), prev: decoder input ids (T,), one sentence without padding."""
    for part in ("project_in_dim", "project_out_dim"):
        if getattr(model.decoder, part, None) is not None:
            raise UnsupportedModel(f"LRP does not support a decoder with {part}")
    seen = _capture(model, src, prev)
    enc_blocks, dec_blocks = blocks(model)

    def run(blocks: List[Block], inputs: List[Tensor], last: Tensor, side: str, memory=None) -> Tensor:
        x = inputs[0]
        per_layer = len(blocks) // len(inputs)
        for i, block in enumerate(blocks):
            if i and i % per_layer == 0:
                _same(x, inputs[i // per_layer], f"{side} layer {i // per_layer - 1}")
                x = inputs[i // per_layer]
            x = block.forward(x, memory if block.attn_type == "dec-enc" else None)
        _same(x, last, f"{side} layer {len(inputs) - 1}")
        return last

    encoded = run(enc_blocks, seen["enc"], seen["enc_last"], "encoder")
    if model.encoder.layer_norm is not None:
        encoded = _norm(model.encoder.layer_norm, encoded)
    decoded = run(dec_blocks, seen["dec"], seen["dec_last"], "decoder", memory=encoded)
    final = _norm(model.decoder.layer_norm, decoded) if model.decoder.layer_norm is not None else decoded

    # seeds: the top-1 logit of each target position, relevance 1 each, through the output projection
    projection = model.decoder.output_projection
    chosen = seen["logits"].argmax(-1)  # (T,)
    steps = chosen.numel()
    z = projection.weight[chosen] * final  # (T, d): the chosen logit's contributions, seed p at position p
    if getattr(projection, "bias", None) is not None:
        z = z + (projection.bias[chosen] / final.size(-1)).unsqueeze(-1)
    relevance = final.new_zeros(steps, steps, final.size(-1))
    diagonal = torch.arange(steps, device=final.device)
    relevance[diagonal, diagonal] = lrp.transition(z.unsqueeze(1)).squeeze(1)
    relevance = lrp.conserve(torch.ones(steps, 1, 1, device=z.device, dtype=z.dtype), relevance, dims=(-2, -1))

    trace = Trace()
    memory = torch.zeros(steps, *encoded.shape, dtype=encoded.dtype, device=encoded.device)
    for block in reversed(dec_blocks):  # the decoder's final layer norm is passed through, as the reference
        relevance, r_memory = block.relprop(relevance, trace)
        if r_memory is not None:
            memory = memory + r_memory
        trace.totals.append((f"dec {block.attn_type or 'ffn'} {block.layer}", _total(relevance) + _total(memory)))
    kept = _total(relevance)  # what stays on the decoder side (its embeddings)
    relevance = memory  # the encoder's final layer norm is passed through too
    for block in reversed(enc_blocks):
        relevance, _ = block.relprop(relevance, trace)
        trace.totals.append((f"enc {block.attn_type or 'ffn'} {block.layer}", _total(relevance) + kept))
    return trace


def _total(relevance: Tensor) -> Tensor:
    return relevance.abs().sum((-2, -1))


def sentences(batches: Iterable[dict], pad: int) -> Iterable[Tuple[Tensor, Tensor]]:
    """(source, decoder input) of every sentence of teacher-forcing batches, padding removed."""
    for sample in batches:
        src_tokens, prev = sample["net_input"]["src_tokens"], sample["net_input"]["prev_output_tokens"]
        for b in range(src_tokens.size(0)):
            yield src_tokens[b][src_tokens[b].ne(pad)], prev[b][prev[b].ne(pad)]


def head_relevance(model, batches: Iterable[dict], pad: int) -> Tuple[pd.DataFrame, int]:
    """Mean relevance per target token of every head present (type, layer, head, importance: the share of a
    prediction's relevance through the head), and the number of target tokens it was averaged over. A model in
    fp16 or bf16 is propagated in an fp32 copy (ε = 1e-5 is below their resolution)."""
    if any(p.dtype not in (torch.float32, torch.float64) for p in model.parameters()):
        model = copy.deepcopy(model).float()
    model.eval()
    totals: Dict[Tuple[str, int], Tensor] = {}
    tokens = 0
    for src, prev in sentences(batches, pad):
        trace = propagate(model, src, prev)
        for key, units in trace.heads.items():
            summed = units.sum(0).double().cpu()
            totals[key] = totals[key] + summed if key in totals else summed
        tokens += prev.numel()
    if not tokens:
        raise ValueError("no sentences: head relevance needs at least one")
    rows = [(attn_type, layer, h, float(totals[(attn_type, layer)][local]) / tokens if (attn_type, layer) in totals else 0.0)
            for attn_type, layer, module in model.attention_modules() for local, h in enumerate(module.head_ids)]
    return pd.DataFrame(rows, columns=["type", "layer", "head", "importance"]), tokens
