"""The head interface that dense attention (HeadAttention) and MoA attention (MoAAttention) share: units
(heads, or experts) under one mask schema, recorded per unit, physically removable, gated; and the
incremental-decoding cache and additive-mask code both attention modules run.

A unit keeps its original id (`head_ids`) through pruning, so masks always have the unpruned layout of
`total_heads` entries. A mechanism a pruning procedure trains (mechanisms/) puts a `gate` on the module: called,
this step's value per unit present; `deterministic()`, the test-time values; `keep(local)`, where it can be
sliced by physical pruning. A subclass says how many units it has now (`num_heads`), how a mask value becomes its
stored mask (`_unit_mask`), what removing units slices (`_keep_units`) and how a gate folds in (`_fold`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor


class HeadUnits:
    def _init_units(self, count: int) -> None:
        self.total_heads = count  # before any pruning: the length of a mask
        self.head_ids = list(range(count))  # original ids of the units still present
        self.head_mask = None
        self.gate = None
        self.record_weights = self.record_outputs = self.record_contributions = False
        self.head_weights = None  # per-unit attention weights of the last call, when recorded
        self.head_outputs = None  # per-unit outputs of the last call (in the autograd graph), when recorded
        self.unit_contributions = None  # (batch, units, len, d_model): each unit's share of the output, bias aside

    def _unit_mask(self, values: Tensor) -> Tensor:
        """The stored form of a mask over the units present (float 0/1 for heads)."""
        return values.float()

    def _keep_units(self, local: List[int]) -> None:
        raise NotImplementedError

    def _fold(self, values: Tensor) -> None:
        raise NotImplementedError

    def scale_units(self, values: Tensor) -> None:
        """Multiply each present unit's contribution to the output by its value (any sign)."""
        raise NotImplementedError

    def input_buffer(self, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]
                     ) -> Dict[str, Optional[Tensor]]:
        """This module's incremental-decoding cache (fairseq's incremental-state API, key "attn_state")."""
        cached = self.get_incremental_state(incremental_state, "attn_state")
        if cached is not None:
            return cached
        empty: Dict[str, Optional[Tensor]] = {}
        return empty

    def store_input_buffer(self, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
                           buffer: Dict[str, Optional[Tensor]]):
        assert incremental_state is not None  # (for TorchScript: a cache is stored only where there is a state)
        return self.set_incremental_state(incremental_state, "attn_state", buffer)

    def set_head_mask(self, mask) -> None:
        """mask: one value per original unit (total_heads), 0 drops the unit; None keeps every unit present."""
        if mask is not None:
            mask = torch.as_tensor(mask, device=next(self.parameters()).device)
            if mask.shape != (self.total_heads,):
                raise ValueError(f"head mask has shape {tuple(mask.shape)}, expected ({self.total_heads},)")
            mask = self._unit_mask(mask[self.head_ids])
        self.head_mask = mask

    @torch.no_grad()
    def keep_heads(self, keep_ids) -> None:
        """Physically keep only the units whose original ids are in keep_ids; computes what masking the others
        computes."""
        unknown = set(keep_ids) - set(self.head_ids)
        if unknown:
            raise ValueError(f"heads {sorted(unknown)} are not present (present: {self.head_ids})")
        keep = set(keep_ids)
        local = [i for i, h in enumerate(self.head_ids) if h in keep]
        self._keep_units(local)
        if self.head_mask is not None and self.head_mask.dim() == 1:
            self.head_mask = self.head_mask[local]
        if self.gate is not None:
            if not hasattr(self.gate, "keep"):  # a view of a model-wide selector (DSP's) cannot be sliced
                raise ValueError("fold the gates into the weights before removing heads")
            self.gate.keep(local)
        self.head_ids = [self.head_ids[i] for i in local]

    @torch.no_grad()
    def fold_gate(self, values: Optional[Tensor] = None) -> Tensor:
        """Remove the gate, folding its deterministic values (or `values`, one per head) into the weights so that
        the module computes exactly what the gated module computed at test time. Returns the values folded in."""
        values = self.gate.deterministic() if values is None else values
        self._fold(values)
        self.gate = None
        return values


def append_key_padding(key_padding_mask: Optional[Tensor], cached: Optional[Tensor], batch: int, src_len: int,
                       static_kv: bool) -> Optional[Tensor]:
    """Incremental decoding: the key padding mask (batch, src_len) of the keys after this step's are appended to
    the cached ones, as floats (1 = padded). A step or the cache may have none (padding enters and leaves the
    window): the missing part is unpadded. Encoder keys (static_kv) keep the cached mask."""
    if cached is not None and static_kv:
        return cached
    if cached is not None and key_padding_mask is not None:
        return torch.cat([cached.float(), key_padding_mask.float()], dim=1)
    present = cached if cached is not None else key_padding_mask
    if present is None:
        return None
    missing = src_len - present.size(1)
    if missing <= 0:
        return present.float()
    filler = torch.zeros((batch, missing), device=present.device)
    parts = [present.float(), filler] if cached is not None else [filler, present.float()]
    return torch.cat(parts, dim=1)


def cached_keys_values(saved_state: Dict[str, Optional[Tensor]], k: Optional[Tensor], v: Optional[Tensor],
                       key_padding_mask: Optional[Tensor], static_kv: bool, time_dim: int
                       ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Incremental decoding: append this step's keys and values (along `time_dim`) to the cached ones, or take
    the cached encoder keys (static_kv); extend the key padding mask the same way; update the cache."""
    if "prev_key" in saved_state:
        prev_k, prev_v = saved_state["prev_key"], saved_state["prev_value"]
        assert prev_k is not None and prev_v is not None
        if static_kv or k is None or v is None:
            k, v = prev_k, prev_v
        else:
            k, v = torch.cat([prev_k, k], dim=time_dim), torch.cat([prev_v, v], dim=time_dim)
    assert k is not None and v is not None
    key_padding_mask = append_key_padding(key_padding_mask, saved_state.get("prev_key_padding_mask"), k.size(0),
                                          k.size(time_dim), static_kv)
    saved_state["prev_key"], saved_state["prev_value"] = k, v
    saved_state["prev_key_padding_mask"] = key_padding_mask
    return k, v, key_padding_mask


def additive_mask(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], batch: int, src_len: int,
                  like: Tensor, repeat: int = 1) -> Optional[Tensor]:
    """The causal/attention mask (rows repeated `repeat` times, for queries folded into the length) plus -inf on
    padded keys, additive, broadcasting to (batch, heads, queries, src_len); None when there is neither."""
    mask: Optional[Tensor] = None
    if attn_mask is not None:
        mask = attn_mask.to(like.dtype)
        if repeat > 1:
            mask = mask.repeat_interleave(repeat, dim=0)
    if key_padding_mask is not None and key_padding_mask.dim() == 2:
        padding = torch.zeros(batch, 1, 1, src_len, dtype=like.dtype, device=like.device)
        padding = padding.masked_fill(key_padding_mask.view(batch, 1, 1, src_len).to(torch.bool), float("-inf"))
        mask = padding if mask is None else mask + padding
    return mask
