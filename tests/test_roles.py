"""Head-role detectors on hand-built attention maps with known answers."""
from __future__ import annotations

import pytest
import torch

from hprune.analysis.roles import RoleStats

WORDS = 20  # + EOS: a previous-token head is right on 19 of 20 queries (95 %)


def sentence_maps(rarest: int, arcs) -> torch.Tensor:
    """Head 0 attends to the previous token, head 1 follows the arcs (dependent -> head word), head 2 to the
    rarest token, head 3 uniformly."""
    n = WORDS + 1
    maps = torch.zeros(4, n, n)
    for t in range(n):
        maps[0, t, max(t - 1, 0)] = 1.0
        maps[1, t, t] = 1.0
        maps[2, t, rarest] = 1.0
    for _, head, dependent in arcs:
        maps[1, dependent] = 0.0
        maps[1, dependent, head] = 1.0
    maps[3] = 1.0 / n
    return maps


def test_each_detector_finds_its_head():
    stats = RoleStats(num_heads=4)
    # amod arcs at relative offsets +1, +2 and -1 (head word minus dependent): the baseline is right on 1 of 3
    sentences = [(7, [("amod", 5, 4)]), (12, [("amod", 10, 8)]), (3, [("amod", 2, 3)])]
    for rarest, arcs in sentences:
        stats.add(sentence_maps(rarest, arcs), rarest, arcs)
    table = stats.table().set_index("head")
    assert table["positional"].tolist() == [True, False, False, False]
    assert table.loc[0, "positional_prev"] == pytest.approx(57 / 60)  # every word but the first, 3 sentences
    assert table["syntactic"].tolist() == [False, True, False, False]
    assert table.loc[1, "amod_dep->head"] == 1.0 and table.loc[1, "amod_dep->head_baseline"] == pytest.approx(1 / 3)
    assert table.loc[0, "amod_dep->head"] == pytest.approx(1 / 3)  # only the arc at offset -1
    # the previous-token head hits the rarest word once a sentence (from the next word); the arc head from the
    # word itself, except in the third sentence, where that word is the dependent and looks at its head
    assert table["rare_token"].tolist() == [pytest.approx(3 / 60), pytest.approx(2 / 60), 1.0, 0.0]


def test_a_head_just_under_the_positional_share_is_not_positional():
    stats = RoleStats(num_heads=1)
    maps = torch.zeros(1, 11, 11)  # 10 words: previous token on 8 of them (80 %)
    for t in range(11):
        maps[0, t, t - 1 if 2 <= t else t] = 1.0
    stats.add(maps, rarest=0)
    table = stats.table()
    assert table.loc[0, "positional_prev"] == pytest.approx(0.8) and not table.loc[0, "positional"]
