"""Attention maps of chosen sentences, as `hprune analyze dump=N` writes them: `attention/<sentence id>.npz`,
one file a sentence, read by `numpy.load` (docs/methods.md, "Attention maps").

  source_tokens   the source pieces, then `</s>`                                          (S,)
  decoder_tokens  the decoder's inputs: `</s>`, then the target pieces but the last       (T,)
  target_tokens   what each decoder position predicts: the target pieces, then `</s>`     (T,)
  enc_self        (encoder layers, heads, S, S)   row: query, column: key
  dec_self        (decoder layers, heads, T, T)
  dec_enc         (decoder layers, heads, T, S)
Heads keep their original numbering: a head pruned away is NaN. A MoA layer's experts keep no maps: its type
is left out. `bertviz_inputs(path)` gives the arguments of bertviz's encoder-decoder `model_view` and
`head_view` as they are: `model_view(**bertviz_inputs(path))`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import numpy as np

from ..files import replaced_atomically

KEYS = {"enc-self": "enc_self", "dec-self": "dec_self", "dec-enc": "dec_enc"}


def layer_stack(maps: List[np.ndarray], head_ids: List[List[int]], heads: int) -> np.ndarray:
    """Per-layer maps (heads present, rows, columns) into (layers, heads, rows, columns), NaN where a head is gone."""
    rows, columns = maps[0].shape[1:]
    stack = np.full((len(maps), heads, rows, columns), np.nan, dtype=np.float32)
    for layer, (weights, ids) in enumerate(zip(maps, head_ids)):
        stack[layer, ids] = weights
    return stack


def write(path: Path, tokens: Dict[str, List[str]], maps: Dict[str, np.ndarray]) -> None:
    """One sentence's file, written under a temporary name and renamed."""
    arrays = {name: np.array(values) for name, values in tokens.items()}
    arrays.update({KEYS[attn_type]: stack for attn_type, stack in maps.items()})
    with replaced_atomically(path) as tmp, open(tmp, "wb") as f:  # a file object: numpy adds no suffix
        np.savez_compressed(f, **arrays)


def bertviz_inputs(path: str | Path) -> dict:
    """The keyword arguments of bertviz's `model_view` / `head_view` for an encoder-decoder model: per layer a
    (1, heads, rows, columns) tensor, and the tokens (pruned heads as zeros)."""
    import torch

    data = np.load(path)

    def layers(key: str) -> tuple:
        return tuple(torch.from_numpy(np.nan_to_num(layer))[None] for layer in data[key])

    found = {"encoder_attention": "enc_self", "decoder_attention": "dec_self", "cross_attention": "dec_enc"}
    inputs = {name: layers(key) for name, key in found.items() if key in data}
    inputs["encoder_tokens"] = data["source_tokens"].tolist()
    inputs["decoder_tokens"] = data["decoder_tokens"].tolist()
    return inputs
