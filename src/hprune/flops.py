"""Floating-point operations counted by torch's FlopCounterMode (matmuls and attention), not estimated."""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
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


@contextmanager
def flops_written_to(path: Optional[str]) -> Iterator[None]:
    """Count every FLOP the block runs (forward, backward, beam search; its own thread's, as fairseq's one-worker
    training runs) and write {"flops": n} to `path` at its end, whether it ends well or not; a no-op for None.
    The CLI does it for a verb when HPRUNE_FLOPS_TO names a file (scripts/bench/real_sizes.py: what a verb
    would cost on a GPU)."""
    if not path:
        yield
        return
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA)
    try:
        with counter:
            yield
    finally:
        Path(path).write_text(json.dumps({"flops": counter.get_total_flops()}))


@dataclass(frozen=True)
class Lengths:
    """The sentences MACs are counted over, as their source and target lengths in tokens (eos included): a whole
    split (`of_split`), or one batch's sentences without their padding (`of_sample`)."""
    source: np.ndarray
    target: np.ndarray

    @classmethod
    def of_sample(cls, sample: dict, pad: int) -> "Lengths":
        return cls(sample["net_input"]["src_lengths"].cpu().numpy(), sample["target"].ne(pad).sum(1).cpu().numpy())

    def moments(self) -> np.ndarray:
        """Σ of each monomial of (S, T) a module's MACs are a polynomial of, over the sentences."""
        s, t = self.source.astype(np.float64), self.target.astype(np.float64)
        return np.array([s.size, s.sum(), t.sum(), (s * s).sum(), (t * t).sum(), (s * t).sum()])


# A transformer's MACs on one sentence are a polynomial of degree 2 in its source and target lengths (projections
# are linear in them; attention scores and contexts: S², T², S·T): counted at these six (S, T), which determine
# such a polynomial, its sum over any number of sentences follows exactly from their moments. The seventh checks it.
_PROBES = [(2, 2), (3, 2), (4, 2), (2, 3), (2, 4), (3, 3)]
_CHECK = (7, 5)


def _monomials(s: int, t: int) -> List[float]:
    return [1.0, s, t, s * s, t * t, s * t]


def _probe_input(model, source: int, target: int) -> dict:
    """A sentence of `source` tokens and a teacher-forced target of `target` (eos throughout: never padding; which
    tokens they are does not change a dense model's MACs)."""
    device = next(model.parameters()).device
    src_eos, tgt_eos = model.encoder.dictionary.eos(), model.decoder.dictionary.eos()
    return {"src_tokens": torch.full((1, source), src_eos, device=device),
            "src_lengths": torch.tensor([source], device=device),
            "prev_output_tokens": torch.full((1, target), tgt_eos, device=device)}


def counted_macs(model, lengths: Lengths) -> Dict[str, float]:
    """MACs per target token of every module (FlopCounterMode's names, "Global" the whole model) of teacher-forced
    translation of the sentences of `lengths`, each at its own length, without padding: Σ_sentences MACs / Σ T."""
    counts = [_counted(model, **_probe_input(model, s, t)).get_flop_counts() for s, t in _PROBES + [_CHECK]]
    names = set().union(*counts)
    flops = np.array([[sum(count.get(name, {}).values()) for name in sorted(names)] for count in counts], dtype=np.float64)
    coefficients = np.linalg.solve(np.array([_monomials(s, t) for s, t in _PROBES]), flops[:-1])
    predicted = np.array(_monomials(*_CHECK)) @ coefficients
    if not np.allclose(predicted, flops[-1], rtol=1e-9, atol=0.5):
        raise RuntimeError("this model's MACs are not a quadratic of the sentence lengths; flops.counted_macs "
                           "cannot sum them from probes")
    total = lengths.moments() @ coefficients / 2 / float(lengths.target.sum())
    return dict(zip(sorted(names), total.tolist()))


def macs_per_token(model, lengths: Lengths) -> dict:
    """Forward multiply-accumulates of teacher-forced translation per target token, over the sentences of
    `lengths`: the whole model, and its attention sublayers alone (MACs = FLOPs / 2, as counted above)."""
    by_module = counted_macs(model, lengths)
    attention = sum(macs for name, macs in by_module.items() if name.endswith((".self_attn", ".encoder_attn")))
    return {"macs_per_token": round(by_module["Global"]), "attention_macs_per_token": round(attention)}


def pruned_macs(unpruned, pruned, lengths: Lengths) -> dict:
    """macs_per_token of a model and of its physically pruned copy, as metrics.json keeps them (`<key>_unpruned`,
    `<key>_pruned`), and the share of the whole model's MACs removed (`macs_removed_pct`)."""
    counted = {"unpruned": macs_per_token(unpruned, lengths), "pruned": macs_per_token(pruned, lengths)}
    return {**{f"{key}_{name}": value for name, macs in counted.items() for key, value in macs.items()},
            "macs_removed_pct": round(100 * (1 - counted["pruned"]["macs_per_token"]
                                             / counted["unpruned"]["macs_per_token"]), 2)}


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


def unit_costs(model, lengths: Lengths) -> Dict[Tuple[str, int], UnitCost]:
    """Each attention sublayer's UnitCost, from the MACs counted (as above) over the sentences of `lengths` with
    the units it has now: a model pruned to any mask runs sum(cost.macs(kept)) MACs per target token in attention.
    Each FFN's too (its neurons; an encoder neuron's cost per target token counts the source tokens it runs on)."""
    by_module = counted_macs(model, lengths)
    names = {id(module): f"{type(model).__name__}.{name}" for name, module in model.named_modules()}

    def macs(module) -> float:
        return by_module.get(names[id(module)], 0.0)

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
