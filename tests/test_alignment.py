"""Roles on constructed attention maps, one per attention type, and the alignment error rate by hand."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hprune.analysis.alignment import (
    AlignmentStats,
    aer,
    eflomal_alignments,
    head_links,
    pharaoh_lines,
    read_pharaoh,
    word_ids,
    word_texts,
)
from hprune.analysis.roles import PreviousTokenStats, RoleStats
from hprune.errors import UserError


def test_aer_of_a_hand_worked_example(tmp_path):
    """Sure S = {0-0, 1-2}, possible P = S + {2-1}; A = {0-0, 2-1, 1-1}: |A∩S| = 1, |A∩P| = 2, so
    AER = 1 - (1 + 2) / (3 + 2) = 0.4."""
    (tmp_path / "gold.align").write_text("0-0 1-2 2?1\n0p0\n\n")
    alignments = read_pharaoh(tmp_path / "gold.align")
    sure, possible = alignments[0]
    assert sure == {(0, 0), (1, 2)} and possible == {(0, 0), (1, 2), (2, 1)}
    assert alignments[1] == (set(), {(0, 0)}) and alignments[2] == (set(), set())
    assert aer({(0, 0), (2, 1), (1, 1)}, sure, possible) == pytest.approx(0.4)
    assert aer(sure, sure, possible) == 0 and aer({(2, 2)}, sure, possible) == 1
    (tmp_path / "bad.align").write_text("0-0 1:2\n")
    with pytest.raises(UserError, match=r"bad.align:1: '1:2' is not a Pharaoh link"):
        read_pharaoh(tmp_path / "bad.align")


def test_pieces_join_into_words_as_the_post_processing_says():
    assert word_ids(["the", "mupi@@", "ba", "Kus@@", "ne@@", "s"], "subword_nmt") == [0, 1, 1, 2, 2, 2]
    assert word_ids(["\u2581the", "\u2581mu", "pi", "ba", "\u2581x"], "sentencepiece") == [0, 1, 1, 1, 2]
    assert word_ids(["a@@", "b"], None) == [0, 1]


def test_a_head_along_the_gold_alignment_is_an_alignment_head():
    """Source words: the(0) mu@@ pi(1) ga(2) </s>; target pieces: le(0) Na@@(1) me(1) </s>. Gold: 0-0, 1-1."""
    source_words, target_words = word_ids(["the", "mu@@", "pi", "ga"], "subword_nmt"), [0, 1, 1]
    sure = {(0, 0), (1, 1)}
    along = torch.zeros(4, 5)
    along[0, 0] = along[1, 1] = along[2, 2] = along[3, 4] = 1  # each target piece on a piece of its source word
    elsewhere = torch.zeros(4, 5)
    elsewhere[:, 3], elsewhere[:, 4] = 0.9, 0.1  # everything on the particle
    uniform = torch.full((4, 5), 0.2)
    stats = AlignmentStats(num_heads=3)
    stats.add(torch.stack([along, elsewhere, uniform]), source_words, target_words, sure, sure)
    assert head_links(torch.stack([along]), source_words, target_words) == [sure]  # EOS rows link nothing
    table, layer_aer = stats.table(max_aer=0.2)
    assert table["alignment_aer"].tolist() == pytest.approx([0.0, 1.0, 1 - 2 / 4])  # uniform: the argmax is 0
    assert table["alignment_share"].tolist() == pytest.approx([1.0, 0.0, 0.5])
    assert table["alignment"].tolist() == [True, False, False]
    # the mean of the three maps: 0.4 on each gold piece against 0.37 on the particle, so the gold links
    assert layer_aer == 0.0


def test_encoder_roles_on_constructed_maps():
    """Four heads over a sentence of 5 words and EOS: one looks at the previous token, one at the next, one at
    the rarest word (position 3), one from an amod arc's dependent (word 4) to its head (word 1 or 2, as the
    sentence has it, so that no fixed offset finds it more than half the time)."""
    n = 6  # 5 words + EOS
    stats = RoleStats(num_heads=4)
    for sentence in range(10):
        head_word = 1 + sentence % 2
        maps = torch.zeros(4, n, n)
        for q in range(n):
            maps[0, q, max(q - 1, 0)] = 1
            maps[1, q, min(q + 1, n - 1)] = 1
            maps[2, q, 3] = 1
            maps[3, q, head_word if q == 4 else q] = 1
        stats.add(maps, rarest=3, arcs=[("amod", head_word, 4)])
    table = stats.table()
    assert table["positional"].tolist() == [False, True, False, False]  # previous: 4 of 5 queries, < 90 %
    assert table["positional_prev"][0] == pytest.approx(0.8) and table["positional_next"][1] == pytest.approx(1.0)
    assert table["rare_token"][2] == pytest.approx(1.0)
    assert table["amod_dep->head"][3] == pytest.approx(1.0) and table["amod_dep->head_baseline"][3] == 0.5
    assert table["syntactic"].tolist() == [False, False, False, True]


def test_decoder_self_attention_positional_on_constructed_maps():
    n = 7
    previous = torch.zeros(n, n)
    previous[0, 0] = 1
    for q in range(1, n):
        previous[q, q - 1] = 1
    itself = torch.eye(n)
    stats = PreviousTokenStats(num_heads=2)
    stats.add(torch.stack([previous, itself]))
    table = stats.table()
    assert table["positional_prev"].tolist() == pytest.approx([1.0, 0.0])
    assert table["positional"].tolist() == [True, False]


def test_word_texts_join_pieces_as_the_word_ids_count_them():
    assert word_texts(["ba@@", "ko", "the", "Dos@@", "kal@@", "mek"], "subword_nmt") == ["bako", "the", "Doskalmek"]
    assert word_texts(["\u2581ba", "ko", "\u2581the"], "sentencepiece") == ["bako", "the"]
    assert word_texts(["ba@@", "ko"], None) == ["ba@@", "ko"]  # no subwords: every token a word


def test_eflomal_finds_a_known_alignment_and_pharaoh_text_reads_back(tmp_path):
    """A lexicon of 30 words translated one to one, the target in reverse order: eflomal, run on 600 sentences,
    should link word i of a 6-word sentence to target word 5 - i."""
    pytest.importorskip("eflomal")
    rng = np.random.default_rng(0)
    source = [[f"w{k}" for k in rng.choice(30, size=6, replace=False)] for _ in range(600)]
    target = [[f"t{word[1:]}" for word in reversed(sentence)] for sentence in source]
    found = eflomal_alignments(source, target, sentences=50)
    assert len(found) == 50 and all(sure <= possible for sure, possible in found)
    gold = {(i, 5 - i) for i in range(6)}
    total = sum(aer(sure, gold, gold) for sure, _ in found) / len(found)
    assert total < 0.05, total
    (tmp_path / "found.align").write_text(pharaoh_lines(found))
    assert read_pharaoh(tmp_path / "found.align") == found
