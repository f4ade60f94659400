"""Floating-point operations counted by torch's FlopCounterMode (matmuls and attention), not estimated."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# torch counts the CUDA attention kernels but not the CPU one SDPA dispatches to
_EXTRA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa}


def count_flops(fn: Callable, *args, **kwargs) -> int:
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_EXTRA) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()
