"""Heads as table rows, the shared head-mask schema, and choosing which heads to prune.

A head is (type, layer, head) with the head's original id, so a physically pruned model keeps its ids.
A head mask is `{"enc-self": [[1, 0, ...] per layer], "dec-self": ..., "dec-enc": ...}` (1 = alive), over the
unpruned layout; Michel et al.'s `E:layer:head` ids (1-based; E enc-self, D dec-self, A dec-enc) are a view of it.
A mask that prunes FFN neurons too holds them in the same form under `enc-ffn` / `dec-ffn` (a neuron is
(FFN type, layer, neuron), a unit like a head); a mask without those rows keeps every neuron.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pandas as pd

from ..attention_types import ATTENTION_TYPES, FFN_TYPES, STACK
from ..errors import UserError

MICHEL_PREFIX = {"enc-self": "E", "dec-self": "D", "dec-enc": "A"}
# prune.layout: `free` prunes any heads; `per_stack` keeps the same number of heads in every sublayer of a stack,
# the decoder's self- and cross-attention sharing one count: the masks CTranslate2 holds without padding
LAYOUTS = ("free", "per_stack")
Head = Tuple[str, int, int]
Mask = Dict[str, List[List[int]]]


class HeadMask(dict):
    """A head mask as an object a user builds, combines and saves; still the schema's dict, so everything that
    takes a mask takes it. `a & b` keeps the heads both keep, `a | b` those either keeps (soft values: their
    minimum, maximum); `without(...)` removes heads (or neurons); `save` writes the head_mask.json the CLI's
    `mask=` reads."""

    @classmethod
    def full(cls, model, neurons: bool = False) -> "HeadMask":
        """Every present head of `model` kept (with neuron rows: every present neuron)."""
        return cls(mask_without(model, (), neurons))

    @classmethod
    def read(cls, path: str | Path, model, soft: bool = False) -> "HeadMask":
        return cls(read_mask(path, layout(model), soft=soft, optional=ffn_layout(model)))

    def without(self, *units: Head) -> "HeadMask":
        """This mask with `units` ((type, layer, head) each, or Michel's "E:1:3") removed as well."""
        mask = HeadMask({unit_type: [list(row) for row in rows] for unit_type, rows in self.items()})
        for unit in units:
            unit_type, layer, h = from_michel_id(unit) if isinstance(unit, str) else unit
            if unit_type not in mask or not 0 <= layer < len(mask[unit_type]) or not 0 <= h < len(mask[unit_type][layer]):
                raise UserError(f"{unit} is not a unit of this mask (its shape: "
                                f"{ {t: [len(row) for row in rows] for t, rows in self.items()} })")
            mask[unit_type][layer][h] = 0
        return mask

    def _combined(self, other: Mask, pick) -> "HeadMask":
        if {t: [len(row) for row in rows] for t, rows in self.items()} != \
                {t: [len(row) for row in rows] for t, rows in other.items()}:
            raise UserError("masks of different shapes cannot be combined (they belong to different models)")
        return HeadMask({t: [[pick(a, b) for a, b in zip(row, other_row)] for row, other_row in zip(rows, other[t])]
                         for t, rows in self.items()})

    def __and__(self, other: Mask) -> "HeadMask":
        return self._combined(other, min)

    def __or__(self, other: Mask) -> "HeadMask":
        return self._combined(other, max)

    # (a dict's own | merges keys: a mask on either side, or |=, combines heads instead)
    __ror__ = __ior__ = __or__
    __rand__ = __iand__ = __and__

    @property
    def removed(self) -> List[Head]:
        """The units this mask removes, in the schema's order."""
        return [(t, layer, h) for t, rows in self.items() for layer, row in enumerate(rows)
                for h, value in enumerate(row) if not alive(value)]

    @property
    def kept(self) -> Dict[str, int]:
        """Units kept per type: {"enc-self": 9, ...}."""
        return {t: sum(alive(v) for row in rows for v in row) for t, rows in self.items()}

    def save(self, path: str | Path) -> Path:
        from ..files import write_json

        return write_json(path, dict(self))

    def __repr__(self) -> str:
        sizes, kept = {t: sum(len(row) for row in rows) for t, rows in self.items()}, self.kept
        order = sorted(self, key=lambda t: (*ATTENTION_TYPES, *FFN_TYPES).index(t))
        return "HeadMask(" + ", ".join(f"{t} {kept[t]}/{sizes[t]}" for t in order) + " kept)"


def present_heads(model) -> List[Head]:
    """Every head the model still has, in a fixed order (type, layer, original id)."""
    return [(attn_type, layer, h) for attn_type, layer, module in model.attention_modules() for h in module.head_ids]


def present_neurons(model) -> List[Head]:
    """Every FFN neuron the model still has, as units (FFN type, layer, original id), in a fixed order."""
    return [(ffn_type, layer, n) for ffn_type, layer, block in model.ffn_layers() for n in block.fc2.neuron_ids]


def pool_of(model, types: Iterable[str]) -> Set[Head]:
    """The units a method may prune: every present head of the attention `types`, and every present neuron of
    the FFN types among them."""
    types = set(types)
    units = present_heads(model) + (present_neurons(model) if types & set(FFN_TYPES) else [])
    return {unit for unit in units if unit[0] in types}


def moa_types(model) -> Set[str]:
    """The attention types whose layers are MoA layers (their "heads" are experts)."""
    return {attn_type for attn_type, _, _ in moa_layers(model)}


def moa_layers(model) -> List[Tuple[str, int, object]]:
    """(type, layer, module) of the model's MoA layers; none for a plain hprune_transformer."""
    return list(model.moa_layers())


def layout(model) -> Dict[str, List[int]]:
    """{type: [unpruned heads per layer]}: the shape of a head mask for this model."""
    shape: Dict[str, List[int]] = {}
    for attn_type, _, module in model.attention_modules():
        shape.setdefault(attn_type, []).append(module.total_heads)
    return shape


def ffn_layout(model) -> Dict[str, List[int]]:
    """{FFN type: [unpruned neurons per layer]}: the shape of a mask's neuron rows."""
    shape: Dict[str, List[int]] = {}
    for ffn_type, _, block in model.ffn_layers():
        shape.setdefault(ffn_type, []).append(block.fc2.total_neurons)
    return shape


def mask_without(model, pruned: Iterable[Head], neurons: bool = False) -> Mask:
    """The mask that keeps every present head except `pruned` (heads already removed stay 0); with neuron rows
    where `neurons` or where `pruned` holds neurons, which keep every present neuron but those."""
    pruned = set(pruned)
    neurons = neurons or any(unit[0] in FFN_TYPES for unit in pruned)
    shape = {**layout(model), **(ffn_layout(model) if neurons else {})}
    mask = {unit_type: [[0] * n for n in per_layer] for unit_type, per_layer in shape.items()}
    for unit_type, layer, h in present_heads(model) + (present_neurons(model) if neurons else []):
        mask[unit_type][layer][h] = 0 if (unit_type, layer, h) in pruned else 1
    return mask


def read_mask(path: str | Path, expected: Dict[str, List[int]], key: str = "mask", soft: bool = False,
              optional: Optional[Dict[str, List[int]]] = None) -> Mask:
    """A head_mask.json that fits `expected` ({type: [heads per layer]}, see layout), and may hold the rows of
    `optional` (ffn_layout: neurons); `key` names the setting in the error message. Its values are 0 (removed)
    or 1 (kept); soft: any finite number, each head's output multiplied by it (what a verb that only masks, eval,
    can run; a verb that removes heads cannot)."""
    try:
        mask = json.loads(Path(path).read_text())
        shape = {attn_type: [len(row) for row in rows] for attn_type, rows in mask.items()}
    except (OSError, json.JSONDecodeError, AttributeError, TypeError) as err:
        raise UserError(f"{key}={path} cannot be read as a head_mask.json ({err})") from None
    optional = optional or {}
    if {t: n for t, n in shape.items() if t not in optional} != expected or \
            any(n != optional[t] for t, n in shape.items() if t in optional):
        raise UserError(f"{key}={path} does not fit this model: it needs heads per layer {expected}"
                        + (f" (neurons per layer, if any: {optional})" if optional else ""))
    for attn_type, rows in mask.items():
        for layer, row in enumerate(rows):
            for h, value in enumerate(row):
                number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                if not number or (not soft and value not in (0, 1)):
                    raise UserError(
                        f"{key}={path} has {json.dumps(value)} for {attn_type} layer {layer} head {h}: "
                        + ("a head's value is a finite number (its output is multiplied by it)" if soft else
                           "a mask that removes heads holds 0 (removed) or 1 (kept); `hprune eval mask=` also "
                           "runs values in between (each head's output multiplied by its value)"))
    return {attn_type: [[int(v) if not soft else v for v in row] for row in rows] for attn_type, rows in mask.items()}


def is_soft(mask: Mask) -> bool:
    """Whether a mask scales some head by a value other than 0 or 1."""
    return any(value not in (0, 1) for rows in mask.values() for row in rows for value in row)


def alive(value: float) -> bool:
    """A head a mask keeps: any value but 0 (a soft mask's heads still compute)."""
    return value != 0


def kept_ids(mask: Mask) -> Dict[str, List[List[int]]]:
    """{type: [[ids of alive heads] per layer]}, the form physical pruning stores in a checkpoint."""
    return {attn_type: [[h for h, value in enumerate(row) if alive(value)] for row in rows] for attn_type, rows in mask.items()}


def kept_columns(mask: Mask) -> Dict[str, int]:
    """Alive heads per attention type, as flat metrics/table columns: {"kept_enc_self": 9, ...} (a soft mask's
    heads with a value other than 0)."""
    return {f"kept_{attn_type.replace('-', '_')}": sum(alive(v) for row in rows for v in row) for attn_type, rows in mask.items()}


def describe_kept(metrics: dict) -> str:
    """The kept_columns counts among `metrics` as a summary line's words: "enc-self 9, dec-self 12, dec-enc 12"."""
    return ", ".join(f"{attn_type} {metrics['kept_' + attn_type.replace('-', '_')]}" for attn_type in ATTENTION_TYPES)


def michel_id(head: Head) -> str:
    attn_type, layer, h = head
    return f"{MICHEL_PREFIX[attn_type]}:{layer + 1}:{h + 1}"


def from_michel_id(head_id: str) -> Head:
    """(type, layer, head) of Michel et al.'s id ("E:1:3": enc-self, layer 0, head 2)."""
    types = {prefix: attn_type for attn_type, prefix in MICHEL_PREFIX.items()}
    try:
        prefix, layer, h = head_id.split(":")
        return types[prefix], int(layer) - 1, int(h) - 1
    except (KeyError, ValueError):
        raise UserError(f"'{head_id}' is not a head id: Michel et al.'s form is E|D|A:layer:head, 1-based, "
                        "e.g. E:1:3") from None


def heads_to_prune(pool: int, pct: float) -> int:
    """ceil(pool * pct / 100), as Michel et al.'s prune.py counts; exact for decimal percentages."""
    return math.ceil(round(pool * pct / 100, 9))


def check_layout(layout: str, types: Iterable[str]) -> None:
    """Refuse a prune.layout that is unknown, or that the pool `types` cannot honour."""
    if layout not in LAYOUTS:
        raise UserError(f"prune.layout={layout} is not a layout; choose free (any heads) or per_stack (one head count "
                        "per encoder layer and one per decoder layer, as CTranslate2 holds them)")
    decoder = [attn_type for attn_type in ("dec-self", "dec-enc") if attn_type in types]
    if layout == "per_stack" and len(decoder) == 1:
        other = {"dec-self": "dec-enc", "dec-enc": "dec-self"}[decoder[0]]
        raise UserError(f"prune.layout=per_stack keeps one head count for a decoder layer's self- and cross-attention, "
                        f"so {decoder[0]} cannot be pruned while {other} keeps every head; add {other} to prune.types "
                        "or use prune.layout=free")


def layer_floor(layout: str, min_heads_per_layer: int) -> int:
    """The fewest heads a sublayer of the pool keeps: per_stack keeps at least one (CTranslate2 holds no stack
    without attention heads)."""
    return max(1, min_heads_per_layer) if layout == "per_stack" else min_heads_per_layer


def max_prunable(pool_heads: Iterable[Head], min_heads_per_layer: int, layout: str = "free") -> int:
    floor = layer_floor(layout, min_heads_per_layer)
    per_layer: Dict[Tuple[str, int], int] = {}
    for attn_type, layer, _ in pool_heads:
        per_layer[(attn_type, layer)] = per_layer.get((attn_type, layer), 0) + 1
    return sum(max(0, n - floor) for n in per_layer.values())


def per_stack_masks(pool: Set[Head], scores: Dict[Head, float], floor: int) -> List[Set[Head]]:
    """Every head set of the per_stack layout within `pool`, as the heads kept: each stack keeps K heads in every
    sublayer (fewer where the pool has fewer), its K highest-scored (ties: the lower id), for each K from `floor`
    to the stack's largest sublayer. At most (heads + 1)² sets: small enough to search exhaustively."""
    sublayers: Dict[Tuple[str, int], List[Head]] = {}
    for head in pool:
        sublayers.setdefault(head[:2], []).append(head)
    stacks: Dict[str, List[List[Head]]] = {}
    for (attn_type, _), heads in sorted(sublayers.items()):
        stacks.setdefault(STACK[attn_type], []).append(sorted(heads, key=lambda h: (-scores[h], h[2])))
    choices = []
    for layers in stacks.values():
        largest = max(map(len, layers))
        choices.append([{h for heads in layers for h in heads[:k]} for k in range(min(floor, largest), largest + 1)])
    return [set().union(*combination) for combination in itertools.product(*choices)]


def per_stack_kept(pool: Set[Head], scores: Dict[Head, float], floor: int, keep: int) -> Set[Head]:
    """The per_stack head set that keeps at most `keep` heads of `pool`: the one keeping the most, then the one
    with the highest total score."""
    fitting = [kept for kept in per_stack_masks(pool, scores, floor) if len(kept) <= keep]
    if not fitting:
        raise UserError(f"prune.layout=per_stack cannot keep only {keep} of {len(pool)} heads: every stack keeps at "
                        f"least {floor} head(s) per layer; prune fewer heads or use prune.layout=free")
    return max(fitting, key=lambda kept: (len(kept), sum(scores[h] for h in kept)))


def ranked(scores: pd.DataFrame) -> pd.DataFrame:
    """Scores sorted from least to most important; ties broken by type, layer and head, so the order is the
    same on every run. Adds `rank` (1 = most important)."""
    order = scores.assign(_type=scores["type"].map(ATTENTION_TYPES.index))
    order = order.sort_values(["importance", "_type", "layer", "head"], kind="stable").drop(columns="_type")
    order["rank"] = range(len(order), 0, -1)
    return order.reset_index(drop=True)


def scores_by_head(table: pd.DataFrame, column: str) -> Dict[Head, float]:
    """{(type, layer, head): score} of a table with one row per head."""
    return {(r.type, int(r.layer), int(r.head)): float(getattr(r, column)) for r in table.itertuples(index=False)}


def extend_pruned(scores: pd.DataFrame, pruned: Set[Head], n_total: int, pool: Set[Head],
                  min_heads_per_layer: int, layout: str = "free") -> Set[Head]:
    """Add the least important pool heads to `pruned` until it holds n_total heads, never leaving a layer
    with fewer than min_heads_per_layer alive heads. per_stack: the per_stack set of the still alive heads that
    prunes at least n_total heads in all, and of those the fewest, then the least important
    (per_stack_kept)."""
    pruned = set(pruned)
    if layout == "per_stack":
        alive_heads = pool - pruned
        by_head = scores_by_head(scores, "importance")
        kept = per_stack_kept(alive_heads, by_head, layer_floor(layout, min_heads_per_layer), len(pool) - n_total)
        return pruned | (alive_heads - kept)
    alive: Dict[Tuple[str, int], int] = {}
    for attn_type, layer, h in pool - pruned:
        alive[(attn_type, layer)] = alive.get((attn_type, layer), 0) + 1
    for row in ranked(scores).itertuples(index=False):
        if len(pruned) >= n_total:
            break
        head = (row.type, int(row.layer), int(row.head))
        if head not in pool or head in pruned or alive[head[:2]] <= min_heads_per_layer:
            continue
        pruned.add(head)
        alive[head[:2]] -= 1
    if len(pruned) < n_total:
        raise UserError(f"cannot prune {n_total} heads: only {len(pruned)} can go with "
                        f"prune.min_heads_per_layer={min_heads_per_layer}; lower the percentage or that minimum")
    return pruned
