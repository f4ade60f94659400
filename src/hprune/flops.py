"""Floating-point operations counted by torch's FlopCounterMode (matmuls and attention), not estimated."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """(rows, in) jagged over groups @ (groups, in, out): each row meets one group's matrix."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


# torch counts neither the CPU kernel SDPA dispatches to nor grouped matmuls (MoA experts)
_EXTRA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
          torch.ops.aten._grouped_mm: _grouped_mm}


def _counted(fn: Callable, *args, **kwargs) -> FlopCounterMode:
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_EXTRA) as counter:
        fn(*args, **kwargs)
    return counter


def count_flops(fn: Callable, *args, **kwargs) -> int:
    return _counted(fn, *args, **kwargs).get_total_flops()


def macs_per_token(model, sample: dict) -> dict:
    """Forward multiply-accumulates of teacher-forced translation of one batch, per target token: the whole
    model, and its attention sublayers alone (MACs = FLOPs / 2, as counted above)."""
    counter = _counted(model, **sample["net_input"])
    tokens = int(sample["ntokens"])
    by_module = counter.get_flop_counts()
    attention = sum(sum(ops.values()) for name, ops in by_module.items()
                    if name.endswith((".self_attn", ".encoder_attn")))
    return {"macs_per_token": round(counter.get_total_flops() / 2 / tokens),
            "attention_macs_per_token": round(attention / 2 / tokens)}


@dataclass(frozen=True)
class UnitCost:
    """MACs per target token of one attention sublayer as a function of the units (heads, experts) it keeps:
    `shared` once the layer keeps any (MoA's key and value), `per_unit` for each kept unit (a head's q/k/v rows,
    attention and out_proj columns; an expert's router row), and `per_slot` for each of the min(kept, top_k)
    expert slots a token uses (MoA's expert query, attention and output; None for heads)."""
    shared: float
    per_unit: float
    per_slot: float = 0.0
    top_k: Optional[int] = None

    def macs(self, kept: int) -> float:
        if kept == 0:
            return 0.0
        slots = min(kept, self.top_k) * self.per_slot if self.top_k is not None else 0.0
        return self.shared + kept * self.per_unit + slots


def unit_costs(model, sample: dict) -> Dict[Tuple[str, int], UnitCost]:
    """Each attention sublayer's UnitCost, from the MACs counted (as above) on one teacher-forced batch with the
    units it has now: a model pruned to any mask runs sum(cost.macs(kept)) MACs per target token in attention.
    Each FFN's too (its neurons; an encoder neuron's cost per target token counts the source tokens it runs on)."""
    by_module = _counted(model, **sample["net_input"]).get_flop_counts()
    tokens = int(sample["ntokens"])
    names = {id(module): f"{type(model).__name__}.{name}" for name, module in model.named_modules()}

    def macs(module) -> float:
        return sum(by_module.get(names[id(module)], {}).values()) / 2 / tokens

    costs = {}
    for attn_type, layer, module in model.attention_modules():
        units = module.num_heads
        if units == 0:
            costs[(attn_type, layer)] = UnitCost(0.0, 0.0)
        elif hasattr(module, "top_k"):  # MoA: shared K/V, a router row per expert, top-k slots per token
            shared = macs(module.k_proj) + macs(module.v_proj)
            router = macs(module.router)
            slots = min(module.top_k, units)
            costs[(attn_type, layer)] = UnitCost(shared, router / units, (macs(module) - shared - router) / slots,
                                            module.top_k)
        else:
            costs[(attn_type, layer)] = UnitCost(0.0, macs(module) / units)
    for ffn_type, layer, block in model.ffn_layers():  # a neuron: its fc1 row and its fc2 column
        neurons = block.fc2.in_features
        costs[(ffn_type, layer)] = UnitCost(0.0, (macs(block.fc1) + macs(block.fc2)) / neurons if neurons else 0.0)
    return costs


def mask_macs(costs: Dict[Tuple[str, int], UnitCost], mask: dict, types) -> float:
    """MACs per target token of the sublayers of `types` under a mask (head-mask schema): attention types, and FFN
    types where the mask has their neuron rows."""
    return sum(costs[(attn_type, layer)].macs(int(sum(row))) for attn_type in types for layer, row in enumerate(mask[attn_type]))
