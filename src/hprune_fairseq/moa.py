"""Mixture of attention heads (Zhang et al. 2022, "MoA"): attention experts routed per token.

A layer has E experts. Expert e owns a query projection W_q^e (d_model -> head_dim) and an output projection
W_o^e (head_dim -> d_model); all experts share one key and one value projection (one head of head_dim, as in
multi-query attention, so the incremental-decoding cache is one head wide). A linear router, initialised to
zero (uniform routes), gives p = softmax(x W_g) per token; the top-k experts are kept, and
    y_t = Σ_{e ∈ TopK(t)} w_{t,e} · W_o^e Attn(W_q^e x_t, K, V)
with w = p (the released code) or, with `renormalize`, w = p / stopgrad(Σ_{TopK} p) (the paper; the
denominator carries no gradient). Pad tokens get no expert: their routes are zero and they count in no
statistic.

Computation, without a Python loop over experts and without host-device synchronisation:
  * k = E (the released base setting): every token uses every expert, so the queries are one matmul with all
    experts' W_q side by side, and the weighted outputs one matmul with all W_o stacked;
  * k < E: the (token, slot) pairs are sorted by expert into a buffer (`Dispatch`); one gather fills it, each
    projection is one grouped matmul over it, and one index_add sums the weighted outputs back per token. On
    the CPU the groups are jagged (torch's grouped_mm, streamed over row chunks by `ExpertLinear`); on a
    device each group is padded to whole blocks of rows and the buffer's size is a bound from the shapes
    alone, so no count travels to the host (CUDA's grouped_mm reads its offsets back for every dtype but bf16
    on sm90+).
The k query slots of a token attend the shared K/V as k rows of a single-head attention (the slots are
folded into the query length), so no key or value is ever copied per expert.

Auxiliary losses (per layer, kept in `aux_loss` after each forward; the criterion adds them per target token):
  switch  L_sw = E · Σ_e P̂_e f̂_e   (P̂: mean routing probability, f̂: share of routed slots; pads excluded)
  z-loss  L_z  = mean_t (logsumexp_e logit_{t,e})²   (logsumexp of fp32 logits: no overflow)
  CV²     L_cv = Var(G) / mean(G)²  (G_e: summed gate values of expert e)
Experts have the head interface of `HeadAttention` (total_heads, head_ids, set_head_mask, keep_heads, gates,
recorded outputs for Michel importance), so masks use the head-mask schema with one entry per expert. A masked
or removed expert leaves the router: its logit is -inf, so tokens are routed among the remaining experts, and
masking and physical removal compute the same thing. A Hard Concrete gate (Voita et al.) scales its expert's
contribution, and a gate at 0 takes the expert out of the router too, so a closed gate is a masked expert and
the gates fold exactly into W_o and a mask.
"""
from __future__ import annotations

import bisect
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

from .heads.units import HeadUnits, additive_mask, cached_keys_values


@with_incremental_state
class MoAAttention(HeadUnits, nn.Module):
    def __init__(self, embed_dim: int, num_experts: int, top_k: int, head_dim: int, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, dropout: float = 0.0, self_attention: bool = False,
                 encoder_decoder_attention: bool = False, renormalize: bool = False, switch_loss: float = 0.01,
                 z_loss: float = 0.001, cv_loss: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoA needs 1 <= k <= E, got k={top_k} and E={num_experts}")
        if head_dim < 1:
            raise ValueError(f"MoA head_dim must be positive, got {head_dim}")
        self.embed_dim, self.head_dim, self.top_k = embed_dim, head_dim, top_k
        self.self_attention, self.encoder_decoder_attention = self_attention, encoder_decoder_attention
        self.renormalize = renormalize
        self.switch_loss, self.z_loss, self.cv_loss = switch_loss, z_loss, cv_loss
        self.scaling = head_dim ** -0.5
        self.k_proj = nn.Linear(kdim or embed_dim, head_dim, bias=False)
        self.v_proj = nn.Linear(vdim or embed_dim, head_dim, bias=False)
        self.q_experts = nn.Parameter(torch.empty(num_experts, embed_dim, head_dim))  # W_q^e, (in, out)
        self.o_experts = nn.Parameter(torch.empty(num_experts, head_dim, embed_dim))  # W_o^e, (in, out)
        self.router = nn.Linear(embed_dim, num_experts, bias=False)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.reset_parameters()

        self._init_units(num_experts)  # head_mask: (experts present,) booleans; None: all experts routable
        self.query_padding_mask: Optional[Tensor] = None  # (batch, len), set by the encoder/decoder per forward
        self.aux_loss: Optional[Tensor] = None  # this layer's weighted auxiliary loss, from the last forward
        self.record_routing = False
        # Michel importance on experts: with record_outputs, each expert's contribution at each token is scaled
        # by a recorded all-ones tensor, so its gradient is ⟨expert output, ∂L/∂expert output⟩ (zero where the
        # expert was not routed); shaped (batch, experts present, len, 1) like HeadAttention's head outputs.
        # Per-expert attention maps are not kept (head_weights stays None: no head roles for MoA).
        self.routing: Optional[Dict[str, Tensor]] = None  # accumulated statistics while record_routing

    def reset_parameters(self) -> None:
        # Xavier-uniform, as the released code: K/V with gain 1/sqrt(2), each expert's projections on their own
        nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
        for weight in (self.q_experts, self.o_experts):
            bound = math.sqrt(6.0 / (weight.size(1) + weight.size(2)))
            nn.init.uniform_(weight, -bound, bound)
        nn.init.zeros_(self.router.weight)

    @property
    def num_heads(self) -> int:
        """Experts present (the head interface of HeadAttention)."""
        return self.q_experts.size(0)

    # ------------------------------------------------------------------------------------ routing
    def route(self, tokens: Tensor, real: Optional[Tensor], gates: Optional[Tensor] = None
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """tokens (N, d_model), real (N,) booleans or None, gate values (E,) or None -> slot weights (N, k),
        slot experts (N, k), probabilities (N, E) and router logits (N, E), in fp32. Masked experts and experts
        whose gate is 0 are out of the router."""
        logits = self.router(tokens).float()
        closed = None if self.head_mask is None else ~self.head_mask
        if gates is not None:
            closed = gates == 0 if closed is None else closed | (gates == 0)
        if closed is not None:
            logits = logits.masked_fill(closed, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # NaN: every expert masked, the layer adds nothing
        if real is not None:
            probs = probs * real.unsqueeze(1)
        weights, experts = probs.topk(min(self.top_k, self.num_heads), dim=-1)
        if self.renormalize:  # the paper: renormalised over the selected experts, the sum as a constant
            weights = weights / (weights.sum(-1, keepdim=True).detach() + 1e-6)
        return weights, experts, probs, logits

    def auxiliary_loss(self, probs: Tensor, logits: Tensor, weights: Tensor, experts: Tensor,
                       real: Optional[Tensor]) -> Tensor:
        """sw·L_sw + z·L_z + cv·L_cv over the real tokens (module docstring)."""
        n_real = real.sum() if real is not None else torch.tensor(probs.size(0), device=probs.device)
        n_real = n_real.clamp(min=1).float()
        routed = (weights > 0).float()  # pads and removed experts have zero weight
        slots = self._per_expert(experts, routed)  # routed slots per expert
        importance = probs.sum(0)
        share = slots / slots.sum().clamp(min=1)
        switch = self.num_heads * (importance / importance.sum().clamp(min=1e-9) * share).sum()
        lse = torch.logsumexp(logits, dim=-1)
        lse = torch.where(torch.isfinite(lse), lse, 0.0)  # -inf: every expert masked
        z = ((lse.square() * real).sum() if real is not None else lse.square().sum()) / n_real
        loss = self.switch_loss * switch + self.z_loss * z
        if self.cv_loss:
            gates = self._per_expert(experts, weights.float())
            loss = loss + self.cv_loss * gates.var() / (gates.mean().square() + 1e-10)
        return loss

    def _per_expert(self, experts: Tensor, values: Tensor) -> Tensor:
        """Σ of per-slot values by expert (scatter_add, not bincount, which reads its size back to the host)."""
        totals = torch.zeros(self.num_heads, dtype=values.dtype, device=values.device)
        return totals.scatter_add(0, experts.reshape(-1), values.reshape(-1))

    @torch.no_grad()
    def _record(self, probs: Tensor, weights: Tensor, experts: Tensor, real: Optional[Tensor]) -> None:
        """Accumulate expert load (routed slots per expert), router entropy and token counts."""
        keep = real if real is not None else torch.ones(probs.size(0), dtype=torch.bool, device=probs.device)
        slots = torch.zeros(self.total_heads, dtype=torch.float64, device=probs.device)
        ids = torch.tensor(self.head_ids, device=probs.device)[experts]
        slots.index_add_(0, ids.reshape(-1), ((weights > 0) & keep.unsqueeze(1)).reshape(-1).double())
        entropy = -(probs * torch.log(probs.clamp(min=1e-12))).sum(-1)
        stats = {"slots": slots, "entropy": (entropy * keep).sum().double(), "tokens": keep.sum().double()}
        if self.routing is None:
            self.routing = stats
        else:
            for key, value in stats.items():
                self.routing[key] += value

    # ------------------------------------------------------------------------------------ experts
    def _queries(self, tokens: Tensor, plan: Optional["Dispatch"]) -> Tensor:
        """(N, d_model) -> each slot's query (N, slots, head_dim)."""
        if plan is None:  # dense routing: all experts, in expert order, in one matmul
            stacked = self.q_experts.permute(1, 0, 2).reshape(self.embed_dim, -1)
            return (tokens @ stacked.to(tokens.dtype)).view(tokens.size(0), self.num_heads, self.head_dim)
        queries = plan.gather_project(tokens, self.q_experts)
        return queries.index_select(0, plan.row_of_slot).view(tokens.size(0), -1, self.head_dim)

    def _outputs(self, context: Tensor, weights: Tensor, plan: Optional["Dispatch"]) -> Tensor:
        """Each slot's context (N, slots, head_dim) -> Σ_slots w · W_o^e context, (N, d_model)."""
        n = context.size(0)
        weighted = context * weights.unsqueeze(-1).to(context.dtype)
        if plan is None:
            return weighted.reshape(n, -1) @ self.o_experts.reshape(-1, self.embed_dim).to(context.dtype)
        return plan.project_scatter(plan.rows_of_slots(weighted.reshape(-1, self.head_dim)), self.o_experts, n)

    def _contributions(self, context: Tensor, weights: Tensor, experts: Tensor, plan: Optional["Dispatch"]) -> Tensor:
        """Each expert's share of every token's output, (N, experts present, d_model) (mask tuning only)."""
        weighted = context * weights.unsqueeze(-1).to(context.dtype)
        if plan is None:  # dense: slots in expert order
            return torch.einsum("neh,ehd->ned", weighted, self.o_experts.to(context.dtype))
        per_slot = torch.einsum("nkh,nkhd->nkd", weighted, self.o_experts[experts].to(context.dtype))
        shares = per_slot.new_zeros(per_slot.size(0), self.num_heads, per_slot.size(-1))
        return shares.scatter_add(1, experts.unsqueeze(-1).expand_as(per_slot), per_slot)

    # ------------------------------------------------------------------------------------ forward
    def _keys_values(self, query, key, value, key_padding_mask, incremental_state, static_kv):
        """The shared keys and values, (batch, src_len, head_dim) each, and the key padding mask, with the
        incremental-decoding cache read and updated (encoder keys are computed once, at the first step)."""
        saved_state = self.input_buffer(incremental_state) if incremental_state is not None else None
        if saved_state is not None and static_kv and "prev_key" in saved_state:
            key = None
        k = v = None
        if self.self_attention:
            k, v = self.k_proj(query).transpose(0, 1), self.v_proj(query).transpose(0, 1)
        elif key is not None:
            k, v = self.k_proj(key).transpose(0, 1), self.v_proj(key if value is None else value).transpose(0, 1)
        if saved_state is not None:  # cached as (batch, len, head_dim): one shared head
            k, v, key_padding_mask = cached_keys_values(saved_state, k, v, key_padding_mask, static_kv, time_dim=1)
            self.store_input_buffer(incremental_state, saved_state)
        assert k is not None and v is not None
        return k, v, key_padding_mask

    def _attend(self, queries, k, v, attn_mask, key_padding_mask, slots: int, need_weights: bool):
        """Single-head attention of the (batch, 1, tgt_len*slots, head_dim) slot queries over the shared keys and
        values: the context, and the weights when asked for (else SDPA)."""
        bsz, src_len = k.size(0), k.size(1)
        # additive, broadcast to (batch, 1, tgt_len*slots, src_len)
        mask = additive_mask(attn_mask, key_padding_mask, bsz, src_len, queries, repeat=slots)
        keys, values = k.unsqueeze(1).to(queries.dtype), v.unsqueeze(1).to(queries.dtype)
        if need_weights:
            scores = queries @ keys.transpose(-1, -2)
            if mask is not None:
                scores = scores + mask
            attention = torch.softmax(scores.float(), dim=-1).type_as(scores)
            return self.dropout_module(attention) @ values, attention
        dropout_p = self.dropout_module.p if (self.training or self.dropout_module.apply_during_inference) else 0.0
        context = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=1.0)
        return context, None

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
        """fairseq's attention interface: (len, batch, d_model) in and out; attention weights (batch, len,
        src_len) averaged over a token's k slots, or per slot (k, batch, len, src_len) with need_head_weights."""
        if before_softmax:
            raise NotImplementedError("MoA attention does not return pre-softmax scores")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, _ = query.shape
        if self.num_heads == 0:  # every expert removed: the sublayer adds nothing
            self.aux_loss = None
            return query.new_zeros(tgt_len, bsz, self.embed_dim), None

        k, v, key_padding_mask = self._keys_values(query, key, value, key_padding_mask, incremental_state, static_kv)
        src_len = k.size(1)

        tokens = query.transpose(0, 1).reshape(bsz * tgt_len, self.embed_dim)  # batch-major (b, t) rows
        real = None
        if self.query_padding_mask is not None:
            real = ~self.query_padding_mask[:, -tgt_len:].reshape(-1)
        gates = self.gate() if self.gate is not None else None  # in training, one sample per expert and batch
        weights, experts, probs, logits = self.route(tokens, real, gates)
        if incremental_state is None:
            self.aux_loss = self.auxiliary_loss(probs, logits, weights, experts, real)
        if self.record_routing:
            self._record(probs, weights, experts, real)

        plan = None
        if experts.size(1) == self.num_heads:  # dense: slots in expert order, weighted by the probabilities
            weights = weights.new_zeros(probs.shape).scatter(1, experts, weights)
        else:
            row_bytes = tuple(width * query.element_size() for width in (self.embed_dim, self.head_dim))
            plan = Dispatch.plan(experts, self.num_heads, row_bytes)
        if gates is not None:  # an open gate scales its expert's contribution
            weights = weights * (gates if plan is None else gates[experts]).to(weights.dtype)
        if self.record_outputs:
            self.head_outputs = weights.new_ones(bsz, self.num_heads, tgt_len, 1, requires_grad=True)
            scale = self.head_outputs.permute(0, 2, 1, 3).reshape(bsz * tgt_len, self.num_heads)
            weights = weights * (scale if plan is None else scale.gather(1, experts))
        slots = weights.size(1)
        queries = self._queries(tokens, plan) * self.scaling
        # the slots of a token are rows of one single-head attention over the shared K/V: (b, t*slots, d)
        queries = queries.view(bsz, 1, tgt_len * slots, self.head_dim)
        context, attention = self._attend(queries, k, v, attn_mask, key_padding_mask, slots, need_weights)
        context = context.view(bsz * tgt_len, slots, self.head_dim)
        out = self._outputs(context, weights, plan).view(bsz, tgt_len, self.embed_dim).transpose(0, 1)
        if self.record_contributions:
            self.unit_contributions = self._contributions(context, weights, experts, plan).view(
                bsz, tgt_len, self.num_heads, self.embed_dim).transpose(1, 2)
        if attention is not None:
            attention = attention.float().view(bsz, tgt_len, slots, src_len)
            attention = attention.permute(2, 0, 1, 3) if need_head_weights else attention.mean(2)
        return out, attention

    # ------------------------------------------------------------------------------------ experts as heads
    def _unit_mask(self, values: Tensor) -> Tensor:
        """0 takes the expert out of the router."""
        return values != 0

    def _fold(self, values: Tensor) -> None:
        """Each expert's W_o scaled by its gate value; experts whose gate is 0 masked out of the router."""
        self.scale_units(values)
        self.head_mask = (values > 0) if self.head_mask is None else self.head_mask & (values > 0)

    @torch.no_grad()
    def scale_units(self, values: Tensor) -> None:
        """Each expert's W_o scaled by its value (the router is left as it is)."""
        self.o_experts.mul_(values.view(-1, 1, 1).to(self.o_experts.dtype))

    def _keep_units(self, local) -> None:
        """The kept experts' router rows, W_q and W_o."""
        index = torch.tensor(local, dtype=torch.long, device=self.router.weight.device)
        self.q_experts = nn.Parameter(self.q_experts.index_select(0, index))
        self.o_experts = nn.Parameter(self.o_experts.index_select(0, index))
        self.router.weight = nn.Parameter(self.router.weight.index_select(0, index))
        self.router.out_features = len(local)

    # ------------------------------------------------------------------------------------ incremental state
    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Beam search reorders (or shrinks) the batch: the cached keys, values and masks follow it."""
        buffer = self.input_buffer(incremental_state)
        if buffer:
            for name, cached in buffer.items():
                if cached is not None:
                    buffer[name] = cached.index_select(0, new_order)
            incremental_state = self.store_input_buffer(incremental_state, buffer)
        return incremental_state

    # the cache under the names fairseq's decoder layer calls on its attention modules
    def _get_input_buffer(self, incremental_state) -> Dict[str, Optional[Tensor]]:
        return self.input_buffer(incremental_state)

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        return self.store_input_buffer(incremental_state, buffer)


class Dispatch:
    """Where each (token, slot) of a top-k routing goes in an expert-sorted buffer, and the expert projections in
    and out of that buffer. Two layouts:

    * jagged (the CPU): the rows are the slots sorted by expert, `offsets` ends each expert's group, and a
      projection is a `grouped_mm` over the groups (`ExpertLinear`, which streams the rows in chunks).
    * blocks (devices, or `jagged_on_cpu = False`): each expert's slots fill whole blocks of `block` rows (the
      last one padded), so block j belongs to expert `block_expert[j]`, and a projection is one bmm of the
      blocks against their experts' weights. The number of blocks is a bound from the shapes alone,
      ceil((A + E (b-1)) / b) for A slots, so no count travels to the host (CUDA's grouped_mm reads its
      offsets back for every dtype but bf16 on sm90+); unused rows read a zero row.
    Measured at 8K32E64D, 2048 tokens, forward + backward on 2 CPU cores: jagged 87 ms, blocks 176 ms."""

    jagged_on_cpu = True  # the tests also run the blocks layout on the CPU

    def __init__(self, token_of_row, slot_of_row, row_of_slot, offsets=None, block_expert=None, blocks=0):
        self.token_of_row, self.slot_of_row, self.row_of_slot = token_of_row, slot_of_row, row_of_slot
        self.offsets, self.block_expert, self.blocks = offsets, block_expert, blocks
        self._chunks: Dict[int, list] = {}

    def rows_of_slots(self, values: Tensor) -> Tensor:
        """Per-slot values (A, width), in slot order -> in buffer-row order (padding rows read zeros)."""
        if self.offsets is None:
            values = torch.cat([values, values.new_zeros(1, values.size(1))])
        return values.index_select(0, self.slot_of_row)

    def gather_project(self, tokens: Tensor, weight: Tensor) -> Tensor:
        """Each buffer row's token (N, in) @ its expert's weight (E, in, out) -> (buffer rows, out)."""
        weight = weight.to(tokens.dtype)
        if self.offsets is not None:
            return ExpertLinear.apply(tokens, weight, self.token_of_row, self.chunks(tokens), True, 0)
        padded = torch.cat([tokens, tokens.new_zeros(1, tokens.size(1))])  # the last row feeds padding rows
        return self._bmm(padded.index_select(0, self.token_of_row), weight)

    def project_scatter(self, rows: Tensor, weight: Tensor, n: int) -> Tensor:
        """Buffer rows (rows, in) @ their expert's weight (E, in, out), summed per token -> (n, out)."""
        weight = weight.to(rows.dtype)
        if self.offsets is not None:
            return ExpertLinear.apply(rows, weight, self.token_of_row, self.chunks(rows, weight.size(-1)), False, n)
        outputs = self._bmm(rows, weight)
        return outputs.new_zeros(n + 1, weight.size(-1)).index_add(0, self.token_of_row, outputs)[:n]

    def _bmm(self, rows: Tensor, weight: Tensor) -> Tensor:
        blocks = rows.view(self.blocks, -1, rows.size(-1))
        return torch.bmm(blocks, weight.index_select(0, self.block_expert)).reshape(-1, weight.size(-1))

    chunk_bytes = 2 << 20  # the wide side of a chunk of rows: 2 MiB (1, 4 and 8 MiB measured slower)

    def chunks(self, like: Tensor, width: Optional[int] = None) -> list:
        """The jagged buffer cut into consecutive row ranges whose wide side (`width`, by default like's) is about
        `chunk_bytes`: (start, stop, the slice of experts the range meets, their group ends within the range).
        The group ends are read to the host: this layout only runs on the CPU, where that costs nothing."""
        rows = max(1, self.chunk_bytes // ((width or like.size(1)) * like.element_size()))
        if rows not in self._chunks:
            ends, total, chunks = self.offsets.tolist(), self.token_of_row.numel(), []
            for start in range(0, total, rows):
                stop = min(start + rows, total)
                first, last = bisect.bisect_right(ends, start), bisect.bisect_left(ends, stop)
                local_ends = (self.offsets[first:last + 1] - start).clamp(0, stop - start)
                chunks.append((start, stop, slice(first, last + 1), local_ends))
            self._chunks[rows] = chunks
        return self._chunks[rows]

    @staticmethod
    def block_size(assignments: int, experts: int) -> int:
        """About half an expert's average share, a power of two in [8, 256]: big enough for efficient matmuls,
        small enough that padding (half a block per expert on average) stays a fraction of the rows (measured
        at 8K32E64D, 2048 tokens: 256 beat 128, 512 and 1024)."""
        return max(8, min(256, 1 << max(assignments // (2 * experts), 1).bit_length() - 1))

    @classmethod
    def plan(cls, experts: Tensor, num_experts: int, row_bytes: Tuple[int, ...] = ()) -> "Dispatch":
        """row_bytes: the byte widths of the projections' rows; grouped_mm (the jagged layout) needs them to be
        multiples of 16, else the blocks layout serves."""
        n, k = experts.shape
        assignments, device = n * k, experts.device
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # slots grouped by expert
        counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add(0, flat, torch.ones_like(flat))
        if device.type == "cpu" and cls.jagged_on_cpu and all(width % 16 == 0 for width in row_bytes):
            row_of_slot = torch.empty_like(order).index_copy(0, order, torch.arange(assignments))
            return cls(order // k, order, row_of_slot, offsets=counts.cumsum(0).to(torch.int32))
        block = cls.block_size(assignments, num_experts)
        blocks = -(-(assignments + num_experts * (block - 1)) // block)
        padded = (counts + block - 1) // block * block
        first_row = padded.cumsum(0) - padded  # first buffer row of each expert
        sorted_experts = flat[order]
        rank = torch.arange(assignments, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
        rows = first_row[sorted_experts] + rank  # buffer row of each slot, in sorted order
        size = blocks * block
        slot_of_row = torch.full((size,), assignments, dtype=torch.long, device=device).index_copy(0, rows, order)
        token_of_row = torch.full((size,), n, dtype=torch.long, device=device).index_copy(0, rows, order // k)
        row_of_slot = torch.empty_like(rows).index_copy(0, order, rows)
        starts = torch.arange(blocks, device=device) * block
        block_expert = torch.searchsorted(padded.cumsum(0), starts, right=True).clamp(max=num_experts - 1)
        return cls(token_of_row, slot_of_row, row_of_slot, block_expert=block_expert, blocks=blocks)


class ExpertLinear(torch.autograd.Function):
    """The jagged layout's expert projection, y_r = x_r W^{e_r} for the buffer rows r (sorted by expert), either
    gathering its input rows from tokens (`gather`: x_r = inputs[index_r], y is (rows, out)) or summing its output
    rows into tokens (scatter: y is Σ_r into out[index_r], (n, out)). It runs over row chunks, one grouped_mm
    per chunk over the experts the chunk meets, and keeps no gathered or per-row wide matrix: the backward pass
    gathers again. A full one (rows x d_model: 32 MiB at 2048 tokens, k=8, d=512) is above glibc's mmap limit,
    so each step would fault its pages in anew; measured at 8K32E64D (forward + backward, 2 CPU cores),
    streaming takes 88 ms where whole matrices take 144 ms, with 200-2,000 page faults a step instead of 33,600."""

    @staticmethod
    def forward(ctx, inputs: Tensor, weight: Tensor, index: Tensor, chunks: list, gather: bool, n: int) -> Tensor:
        out = inputs.new_empty(index.numel(), weight.size(-1)) if gather else inputs.new_zeros(n, weight.size(-1))
        for start, stop, experts, ends in chunks:
            rows = inputs.index_select(0, index[start:stop]) if gather else inputs[start:stop]
            projected = F.grouped_mm(rows, weight[experts], offs=ends)
            if gather:
                out[start:stop] = projected
            else:
                out.index_add_(0, index[start:stop], projected)
        ctx.save_for_backward(inputs, weight, index)
        ctx.chunks, ctx.gather = chunks, gather
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        inputs, weight, index = ctx.saved_tensors
        grad = grad.contiguous()
        grad_inputs = (torch.zeros_like(inputs) if ctx.gather else torch.empty_like(inputs)) \
            if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        transposed = weight.transpose(1, 2)
        for start, stop, experts, ends in ctx.chunks:
            grad_out = grad[start:stop] if ctx.gather else grad.index_select(0, index[start:stop])
            if grad_inputs is not None:
                grad_rows = F.grouped_mm(grad_out, transposed[experts], offs=ends)
                if ctx.gather:
                    grad_inputs.index_add_(0, index[start:stop], grad_rows)
                else:
                    grad_inputs[start:stop] = grad_rows
            if grad_weight is not None:
                rows = inputs.index_select(0, index[start:stop]) if ctx.gather else inputs[start:stop]
                grad_weight[experts] += F.grouped_mm(rows.t(), grad_out, offs=ends)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_inputs, grad_weight, None, None, None, None
