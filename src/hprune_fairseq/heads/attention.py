"""One attention module for every attention in the model: fairseq's MultiheadAttention with head control.

Compared with the stock module it adds, in one place:
  * `head_mask`: 1 keeps a head and 0 drops it; applied to each head's output (the context vector) before
    `out_proj`, so a dropped head contributes exactly nothing (a value in between scales it); the attention
    weights returned are those of the heads it keeps, as a physically pruned module returns them;
  * `record_weights` / `record_outputs` / `record_contributions`: keep the last call's per-head attention weights,
    per-head outputs (for head roles and gradient importance; `head_outputs` stays in the autograd graph) and
    each head's share of the output (for mask tuning);
  * `keep_heads`: physical removal of heads (q/k/v rows and out_proj columns); a module left with no head
    returns its out_proj bias;
  * `gate`: a pruning mechanism's optional gate per head (mechanisms/: Hard Concrete, DSP's selection),
    multiplying the head outputs (computed as a scaling of the head's out_proj columns);
  * torch SDPA whenever no attention weights are needed.
Heads keep their original ids (`head_ids`) through pruning, so masks always have the unpruned layout.
It never takes fairseq's fast path (`F.multi_head_attention_forward`), which would silently skip the mask
and return head-averaged weights even when per-head ones are asked for.
Parameters and state-dict keys are the stock module's, so stock weights load unchanged. The module scripts with
TorchScript, as the stock one does (recording weights and outputs is left out of a scripted module).
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from .units import HeadUnits, additive_mask, cached_keys_values


class HeadAttention(HeadUnits, MultiheadAttention):
    """head_mask: (heads present,) floats, or anything that broadcasts against (batch, heads present, tgt_len, 1);
    head_weights (batch, heads present, tgt_len, src_len) and head_outputs (batch, heads present, tgt_len,
    head_dim) when recorded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias_k is not None or self.add_zero_attn or self.use_xformers:
            raise NotImplementedError("HeadAttention supports neither add_bias_kv, add_zero_attn nor xformers")
        self._init_units(self.num_heads)

    def _fold(self, values: Tensor) -> None:
        """Each head's out_proj columns scaled by its gate value."""
        self.scale_units(values)

    @torch.no_grad()
    def scale_units(self, values: Tensor) -> None:
        """Each head's out_proj columns scaled by its value."""
        self.out_proj.weight.mul_(values.repeat_interleave(self.head_dim).to(self.out_proj.weight.dtype))

    def _keep_units(self, local) -> None:
        """q/k/v rows and out_proj columns of the kept heads are sliced out; out_proj's bias stays."""
        rows = torch.tensor([i * self.head_dim + d for i in local for d in range(self.head_dim)], dtype=torch.long,
                            device=self.q_proj.weight.device)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.weight = torch.nn.Parameter(proj.weight.index_select(0, rows))
            if proj.bias is not None:
                proj.bias = torch.nn.Parameter(proj.bias.index_select(0, rows))
            proj.out_features = len(rows)
        self.out_proj.weight = torch.nn.Parameter(self.out_proj.weight.index_select(1, rows))
        self.out_proj.in_features = len(rows)
        self.num_heads = len(local)

    def _heads(self, x: Tensor) -> Tensor:
        """(len, batch, heads*head_dim) -> (batch, heads, len, head_dim)"""
        return x.view(x.size(0), x.size(1), self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if before_softmax:
            raise NotImplementedError("HeadAttention does not return pre-softmax scores")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, _ = query.size()
        H, D = self.num_heads, self.head_dim
        if H == 0:  # every head removed: the sublayer adds its out_proj bias, nothing else
            out = query.new_zeros(tgt_len, bsz, self.out_proj.out_features)
            return (out if self.out_proj.bias is None else out + self.out_proj.bias.to(out.dtype)), None

        saved_state = self.input_buffer(incremental_state) if incremental_state is not None else None
        if saved_state is not None and static_kv and "prev_key" in saved_state:
            key = value = None  # encoder keys/values were cached at the first step

        q = self._heads(self.q_proj(query))
        k: Optional[Tensor] = None
        v: Optional[Tensor] = None
        if self.self_attention:
            k, v = self._heads(self.k_proj(query)), self._heads(self.v_proj(query))
        elif key is not None:
            if self.encoder_decoder_attention:
                if self.beam_size > 1 and bsz == key.size(1):  # beams share one copy of the encoder states
                    key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                    if key_padding_mask is not None:
                        key_padding_mask = key_padding_mask.view(-1, self.beam_size, key_padding_mask.size(1))[:, 0]
                value = key
            assert value is not None
            k, v = self._heads(self.k_proj(key)), self._heads(self.v_proj(value))

        if saved_state is not None:  # cached as (batch, heads, len, head_dim), the stock layout
            k, v, key_padding_mask = cached_keys_values(saved_state, k, v, key_padding_mask, static_kv, time_dim=2)
            self.store_input_buffer(incremental_state, saved_state)
        assert k is not None and v is not None
        kv_bsz, src_len = k.size(0), k.size(2)
        beams = bsz // kv_bsz
        if beams > 1:  # fold the beams into the query length: (kv_bsz, H, beams*tgt_len, D)
            q = q.reshape(kv_bsz, beams, H, tgt_len, D).transpose(1, 2).reshape(kv_bsz, H, beams * tgt_len, D)

        mask = additive_mask(attn_mask, key_padding_mask, kv_bsz, src_len, q)  # (kv_bsz, H, q_len, src_len)

        dropout_p = self.dropout_module.p if (self.training or self.dropout_module.apply_during_inference) else 0.0
        weights: Optional[Tensor] = None
        if need_weights or self.record_weights:
            scores = torch.matmul(q * self.scaling, k.transpose(-1, -2))
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores.float(), dim=-1).type_as(scores)
            context = torch.matmul(self.dropout_module(weights), v)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=self.scaling)

        if beams > 1:  # unfold back to (bsz, H, tgt_len, ...)
            context = context.reshape(kv_bsz, H, beams, tgt_len, D).transpose(1, 2).reshape(bsz, H, tgt_len, D)
            if weights is not None:
                weights = weights.reshape(kv_bsz, H, beams, tgt_len, src_len).transpose(1, 2)
                weights = weights.reshape(bsz, H, tgt_len, src_len)
        if self.head_mask is not None:
            mask = self.head_mask.to(context.dtype)
            context = context * (mask.view(1, H, 1, 1) if mask.dim() == 1 else mask)
        gate: Optional[Tensor] = None
        if self.gate is not None:
            gate = self.gate().to(context.dtype)
        if self.record_weights or self.record_outputs or self.record_contributions:
            if gate is not None and (self.record_outputs or self.record_contributions):  # recorded: the gated ones
                context, gate = context * gate.view(1, H, 1, 1), None
            self._record(weights, context)

        context = context.permute(2, 0, 1, 3).reshape(tgt_len, bsz, H * D)
        if gate is None:
            out = self.out_proj(context)
        else:  # each gate scales its head's out_proj columns: the same product as gating the head outputs, on
            # a d x H·D weight instead of every token's activations (forward and backward: 5 % of a CPU step)
            weight = self.out_proj.weight * gate.repeat_interleave(D).view(1, H * D)
            out = F.linear(context, weight, self.out_proj.bias)
        if not need_weights or weights is None:
            return out, None
        # stock layout: (heads, batch, tgt, src) per head, else the mean over heads (batch, tgt, src)
        weights = weights.float().transpose(0, 1)
        if self.head_mask is not None:  # the heads it keeps, as a pruned module's (not a per-sentence mask)
            keep = self.head_mask
            if keep.dim() == 1:
                weights = weights[keep.to(weights.device) != 0]
                if weights.size(0) == 0:
                    return out, None
        return out, (weights if need_head_weights else weights.mean(dim=0))

    @torch.jit.unused
    def _record(self, weights: Optional[Tensor], context: Tensor) -> None:
        """Keep this call's per-head weights and outputs (analysis and importance only: not in a scripted model)."""
        if self.record_weights:
            self.head_weights = weights
        if self.record_outputs:
            self.head_outputs = context
        if self.record_contributions:  # (batch, heads, len, d_model): context_h W_o[:, h]ᵀ
            weight = self.out_proj.weight.view(-1, self.num_heads, self.head_dim)
            self.unit_contributions = torch.einsum("bhtd,ohd->bhto", context, weight.to(context.dtype))
