"""What a Marian (OPUS-MT) model computes differently from fairseq's Transformer, as options of
`hprune_transformer` (so an imported model is one of ours, and stock `fairseq-generate --user-dir` loads it):

  --marian-positions         sinusoids with position 0 at the first token (fairseq: padding_idx + 1) and
                             frequencies 10000^(-2i/d) (fairseq: 10000^(-i/(d/2 - 1))); not learned, not saved
  --decoder-start-embedding  the decoder's first input, fairseq's eos, has a vector of its own
                             (`decoder.embed_tokens.start`: Marian starts from <pad>'s, not eos's, embedding)
  --output-bias              a bias on the output projection (Marian's final_logits_bias)

Marian's swish FFN is fairseq's `--activation-fn swish`; its tied, scaled embeddings are fairseq's
`--share-all-embeddings` and default scaling.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from fairseq.modules import SinusoidalPositionalEmbedding
from torch import Tensor, nn


def marian_sinusoids(positions: int, dim: int) -> Tensor:
    """Marian's table: row p = [sin(p w_0), ..., sin(p w_{h-1}), cos(p w_0), ...], w_i = 10000^(-2i/dim)."""
    half = (dim + 1) // 2
    frequencies = torch.exp(torch.arange(half, dtype=torch.float64) * (-2 * math.log(10000) / dim))
    angles = torch.arange(positions, dtype=torch.float64).unsqueeze(1) * frequencies
    return torch.cat([torch.sin(angles), torch.cos(angles)[:, : dim - half]], dim=1).float()


class MarianPositionalEmbedding(SinusoidalPositionalEmbedding):
    """fairseq's sinusoidal module (padding ignored, incremental steps) over Marian's table: the first real
    token, at fairseq's position padding_idx + 1, gets Marian's row 0."""

    def __init__(self, num_positions: int, embedding_dim: int, padding_idx: int):
        super().__init__(embedding_dim, padding_idx, init_size=padding_idx + 1)
        table = torch.zeros(padding_idx + 1 + num_positions, embedding_dim)
        table[padding_idx + 1:] = marian_sinusoids(num_positions, embedding_dim)
        self.weights = table
        self.max_positions = num_positions

    def forward(self, input, incremental_state: Optional[Any] = None, timestep: Optional[Tensor] = None,
                positions: Optional[Any] = None):
        if self.padding_idx + 1 + input.size(1) > self.weights.size(0):  # fairseq would grow its own table
            raise ValueError(f"a sequence of {input.size(1)} tokens exceeds Marian's {self.max_positions} positions")
        return super().forward(input, incremental_state, timestep, positions)


class StartTokenEmbedding(nn.Embedding):
    """Token embeddings (the weight shared with `shared`) in which `start`, the token every decoder input
    begins with, is embedded by a vector of its own."""

    def __init__(self, shared: nn.Embedding, start: int):
        super().__init__(shared.num_embeddings, shared.embedding_dim, shared.padding_idx)
        self.weight = shared.weight
        self.start_index = start
        self.start = nn.Parameter(shared.weight.detach()[start].clone())

    def forward(self, tokens: Tensor) -> Tensor:
        embedded = super().forward(tokens)
        return torch.where(tokens.eq(self.start_index).unsqueeze(-1), self.start.to(embedded.dtype), embedded)


def add_output_bias(projection: nn.Linear) -> None:
    projection.bias = nn.Parameter(torch.zeros(projection.out_features, dtype=projection.weight.dtype))
