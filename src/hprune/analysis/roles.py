"""Head roles of Voita et al. 2019 from attention maps: positional, syntactic, rare-token.

Each encoder self-attention head is judged by where its maximum attention weight (its argmax) lands, one query
token at a time:
  positional  share of queries whose argmax is the previous (-1) or the next (+1) token; a head is positional
              when one of the two shares is >= 90 %;
  syntactic   per dependency relation and direction, the share of arcs whose dependent (or head) word attends
              most to its head (or dependent) word, against the baseline that always guesses the relation's
              most frequent relative position; syntactic when some relation beats its baseline by >= 10 points;
  rare-token  share of queries whose argmax is the sentence's least frequent token (EOS excluded).
The fourth role measure, confidence, is `hprune.pruning.scores.confidence` (it also orders heads for pruning).
Maps are one sentence at a time, without padding: (heads, length, length), the last position EOS.
A decoder self-attention head can only look back: it is positional when >= 90 % of its queries (every target
position but the first) attend most to the token before (`PreviousTokenStats`). Encoder-decoder heads align
words: analysis/alignment.py.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import pandas as pd
import torch

POSITIONAL_SHARE, SYNTACTIC_MARGIN = 0.9, 0.10
ENCODER_ROLES = ("positional", "syntactic", "rare")  # the role columns of an encoder self-attention head


@dataclass
class RoleStats:
    """Accumulates one layer's head statistics over sentences; `table()` gives one row per head."""
    num_heads: int
    queries: int = 0
    previous: torch.Tensor = None
    following: torch.Tensor = None
    rare: torch.Tensor = None
    # (relation, direction) -> per-head hits, the arcs' relative offsets
    arc_hits: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)
    arc_offsets: Dict[Tuple[str, str], List[int]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self):
        zeros = lambda: torch.zeros(self.num_heads, dtype=torch.float64)  # noqa: E731
        self.previous, self.following, self.rare = zeros(), zeros(), zeros()

    def add(self, weights: torch.Tensor, rarest: int, arcs: Sequence[Tuple[str, int, int]] = ()) -> None:
        """weights: (heads, n, n) of one sentence whose last token is EOS; rarest: position of its least frequent
        word; arcs: (relation, head word, dependent word) positions."""
        n = weights.size(-1)
        words = n - 1  # queries: the words, not EOS
        if words < 1:
            return
        weights = weights[:, :words].double()
        argmax = weights.argmax(-1)  # (heads, words)
        position = torch.arange(words)
        self.queries += words
        self.previous += (argmax == position - 1).sum(-1)
        self.following += (argmax == position + 1).sum(-1)
        self.rare += (argmax == rarest).sum(-1)
        for relation, head, dependent in arcs:
            for direction, query, key in (("dep->head", dependent, head), ("head->dep", head, dependent)):
                hits = self.arc_hits.setdefault((relation, direction), torch.zeros(self.num_heads, dtype=torch.float64))
                hits += (argmax[:, query] == key).double()
                self.arc_offsets[(relation, direction)].append(key - query)

    def table(self) -> pd.DataFrame:
        q = max(self.queries, 1)
        rows = {"positional_prev": self.previous / q, "positional_next": self.following / q,
                "rare_token": self.rare / q}
        table = pd.DataFrame({name: values.numpy() for name, values in rows.items()})
        table.insert(0, "head", range(self.num_heads))
        table["positional"] = table[["positional_prev", "positional_next"]].max(axis=1) >= POSITIONAL_SHARE
        best_margin = pd.Series([float("-inf")] * self.num_heads)
        for (relation, direction), hits in sorted(self.arc_hits.items()):
            offsets = self.arc_offsets[(relation, direction)]
            baseline = Counter(offsets).most_common(1)[0][1] / len(offsets)
            accuracy = (hits / len(offsets)).numpy()
            table[f"{relation}_{direction}"] = accuracy
            table[f"{relation}_{direction}_baseline"] = baseline
            best_margin = best_margin.combine(pd.Series(accuracy - baseline), max)
        table["syntactic"] = best_margin >= SYNTACTIC_MARGIN
        return table


@dataclass
class PreviousTokenStats:
    """Decoder self-attention: per head, the share of queries whose argmax is the position before."""
    num_heads: int
    queries: int = 0
    previous: torch.Tensor = None

    def __post_init__(self):
        self.previous = torch.zeros(self.num_heads, dtype=torch.float64)

    def add(self, weights: torch.Tensor) -> None:
        """weights: (heads, n, n) of one target sentence (decoder inputs: EOS, then the words)."""
        n = weights.size(-1)
        if n < 2:
            return
        argmax = weights[:, 1:].argmax(-1)  # the first position has nothing before it
        self.queries += n - 1
        self.previous += (argmax == torch.arange(n - 1)).sum(-1)

    def table(self) -> pd.DataFrame:
        share = (self.previous / max(self.queries, 1)).numpy()
        return pd.DataFrame({"head": range(self.num_heads), "positional_prev": share,
                             "positional": share >= POSITIONAL_SHARE})
