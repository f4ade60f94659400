"""Floating-point operations counted by torch's FlopCounterMode (matmuls and attention), not estimated."""
from __future__ import annotations

from typing import Callable

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
