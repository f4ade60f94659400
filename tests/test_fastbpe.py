"""fastBPE codes (fairseq's WMT19 models) applied through subword-nmt after conversion: the same segmentation
as fastBPE's merge rules give, derived here by applying the rules by hand."""
from __future__ import annotations

import pytest

from hprune.data.processing import fastbpe_codes_to_subword_nmt, line_function
from hprune.errors import UserError

# fastBPE's format: `left right count`, in merge order; the last character of a word carries </w>
CODES = """t h 900
i n 800
th e</w> 700
e r</w> 600
a n 500
an d</w> 400
in g</w> 300
h e 250
r in 200
o th 150
s in 120
"""
WORDS = "the there other and sand ringing thin hex a x sing singing her then".split()


def by_hand(word: str, merges: list[tuple[str, str]]) -> str:
    """fastBPE's rule: start from characters (</w> on the last); while some adjacent pair has a merge, merge
    every occurrence of the highest-priority one, left to right; pieces but the last get @@."""
    rank = {pair: i for i, pair in enumerate(merges)}
    symbols = list(word[:-1]) + [word[-1] + "</w>"]
    while len(symbols) > 1:
        best = min((rank.get(pair, len(rank)), pair) for pair in zip(symbols, symbols[1:]))
        if best[0] == len(rank):
            break
        merged, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best[1]:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return " ".join(s[:-len("</w>")] if s.endswith("</w>") else s + "@@" for s in symbols)


def test_converted_codes_segment_as_fastbpe_rules_do(tmp_path):
    (tmp_path / "bpecodes").write_text(CODES)
    converted = fastbpe_codes_to_subword_nmt(tmp_path / "bpecodes", tmp_path / "codes.subword_nmt")
    assert converted.read_text().splitlines()[:2] == ["#version: 0.2", "t h"]
    merges = [tuple(line.split()[:2]) for line in CODES.splitlines()]
    expected = [by_hand(word, merges) for word in WORDS]
    assert expected[:3] == ["the", "th@@ e@@ r@@ e", "oth@@ er"]  # the hand rule itself, on three words worked on paper
    assert line_function("subword_nmt", str(converted))(" ".join(WORDS)) == " ".join(expected)
    # codes already in subword-nmt's format pass through unchanged
    again = fastbpe_codes_to_subword_nmt(converted, tmp_path / "again")
    assert again.read_text() == converted.read_text()


def test_codes_that_are_not_fastbpe_are_one_line(tmp_path):
    (tmp_path / "bpecodes").write_text("t h 900\nthis is not a merge\n")
    with pytest.raises(UserError, match=r"bpecodes:2 is not a fastBPE merge \('left right count'\)"):
        fastbpe_codes_to_subword_nmt(tmp_path / "bpecodes", tmp_path / "out")
    assert not (tmp_path / "out").exists()
