"""Word alignments read from encoder-decoder attention heads, scored against reference alignments.

Reference alignments are in Pharaoh format: one line a sentence, `i-j` a sure link between source word i and
target word j (0-based), `i?j` or `ipj` a possible one. Words are what the model's pieces join into (BPE pieces
at `@@`, sentencepiece pieces at `▁`): the tokenized text. A data set's `<split>.exclude` beside its
`<split>.align` lists, a line a sentence, the target words its reference leaves out of alignment (punctuation in
a manual alignment): links to them are not scored.

A head's alignment links each target piece to the source piece it attends to most, as a link between their
words: a pair of words is linked when any pair of their pieces is, the usual rule for subword models. The EOS
on either side links nothing. A layer's alignment is read the same way from the mean of its heads' maps (Garg
et al. 2019 read theirs from one layer's average).

  AER    Och & Ney (2003): 1 - (|A ∩ S| + |A ∩ P|) / (|A| + |S|), sure links S ⊆ possible links P, the counts
         summed over the corpus;
  share  of the target words that have a sure link, those whose links from the head include one;
  alignment head: AER <= the analysis' alignment_max_aer.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Collection, List, Optional, Sequence, Set, Tuple

import numpy as np
import pandas as pd
import torch

from ..errors import UserError

Links = Set[Tuple[int, int]]
_LINK = re.compile(r"^(\d+)([-?p])(\d+)$")


def read_pharaoh(path: Path) -> List[Tuple[Links, Links]]:
    """(sure, possible) links of every line; possible includes sure."""
    alignments = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        sure, possible = set(), set()
        for item in line.split():
            match = _LINK.match(item)
            if not match:
                raise UserError(f"{path}:{number}: '{item}' is not a Pharaoh link; write i-j (sure) or i?j "
                                "(possible), source word i and target word j counted from 0")
            link = (int(match.group(1)), int(match.group(3)))
            possible.add(link)
            if match.group(2) == "-":
                sure.add(link)
        alignments.append((sure, possible))
    return alignments


def read_unscored(path: Path, alignments: list) -> list:
    """The reference alignments with the target words to leave unscored (one line a sentence, word indices),
    where `path` (`<split>.exclude` beside `<split>.align`) exists; else as they are."""
    if not Path(path).is_file():
        return alignments
    lines = Path(path).read_text().splitlines()
    if len(lines) != len(alignments):
        raise UserError(f"{path} has {len(lines)} lines for {len(alignments)} sentences of alignments; the two files "
                        "must be line-parallel")
    return [(sure, possible, frozenset(int(j) for j in line.split())) for (sure, possible), line in
            zip(alignments, lines)]


def aer(links: Links, sure: Links, possible: Links) -> float:
    """The alignment error rate of one alignment (corpus AER sums the four counts first: AlignmentStats)."""
    if not links and not sure:
        return 0.0
    return 1 - (len(links & sure) + len(links & possible)) / (len(links) + len(sure))


def corpus_aer(predicted: Sequence[Links], reference: Sequence[tuple]) -> float:
    """The AER of alignments of a corpus against reference (sure, possible[, unscored target words]) links, the
    counts summed first."""
    counts = np.zeros(4)
    for links, (sure, possible, *unscored) in zip(predicted, reference):
        links = {(i, j) for i, j in links if not unscored or j not in unscored[0]}
        counts += (len(links), len(links & sure), len(links & possible), len(sure))
    a, a_sure, a_possible, sure = counts
    return float(1 - (a_sure + a_possible) / max(a + sure, 1))


def word_ids(pieces: Sequence[str], post_process: Optional[str], marks: Collection[str] = ()) -> List[int]:
    """Each piece's word index: BPE pieces continue their word after `@@`, sentencepiece pieces start one at
    `▁`; without subwords every token is a word. `marks` (a multilingual model's language tokens) belong to no
    word: -1."""
    ids, word = [], -1
    for i, piece in enumerate(pieces):
        if piece in marks:
            ids.append(-1)
            continue
        if post_process == "sentencepiece":
            word += 1 if piece.startswith("\u2581") or i == 0 else 0
        else:
            word += 1 if i == 0 or not (post_process == "subword_nmt" and pieces[i - 1].endswith("@@")) else 0
        ids.append(word)
    return ids


def word_texts(pieces: Sequence[str], post_process: Optional[str], marks: Collection[str] = ()) -> List[str]:
    """The words the pieces join into (their subword marks removed): the tokenized text."""
    joined: List[str] = []
    for piece, word in zip(pieces, word_ids(pieces, post_process, marks)):
        if word < 0:
            continue
        text = piece.replace("\u2581", "") if post_process == "sentencepiece" else \
            piece[:-2] if post_process == "subword_nmt" and piece.endswith("@@") else piece
        joined[word:] = [joined[word] + text] if word < len(joined) else [text]
    return joined


def eflomal_alignments(source: Sequence[Sequence[str]], target: Sequence[Sequence[str]],
                       sentences: int) -> List[Tuple[Links, Links]]:
    """Reference alignments of the first `sentences` word sequences, from eflomal (Östling & Tiedemann 2016)
    run on all of them (the rest give it statistics): sure links where its forward and reverse alignments
    agree, possible links where either has one (S ⊆ P, as AER wants). eflomal seeds its samplers from
    /dev/urandom: two runs differ a little."""
    try:
        import eflomal
    except ImportError:
        raise UserError("alignments=eflomal needs eflomal: pip install eflomal (or `make install`, which does)") \
            from None
    with tempfile.TemporaryDirectory() as folder:
        forward, reverse = Path(folder) / "forward", Path(folder) / "reverse"
        eflomal.Aligner().align([" ".join(w) + "\n" for w in source], [" ".join(w) + "\n" for w in target],
                                links_filename_fwd=str(forward), links_filename_rev=str(reverse))
        directions = [read_pharaoh(path)[:sentences] for path in (forward, reverse)]
    return [(f[0] & r[0], f[0] | r[0]) for f, r in zip(*directions)]


def head_links(weights: torch.Tensor, source_words: Sequence[int], target_words: Sequence[int]) -> List[Links]:
    """weights: (heads, target pieces + EOS, source pieces + EOS) of one sentence; each head's word links."""
    argmax = weights[:, :len(target_words)].argmax(-1).tolist()  # the EOS row aligns nothing
    return [{(source_words[s], target_words[t]) for t, s in enumerate(row)
             if s < len(source_words) and min(source_words[s], target_words[t]) >= 0} for row in argmax]


class AlignmentStats:
    """One encoder-decoder layer's alignment counts over sentences, per head and for the layer's mean map."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.counts = np.zeros((num_heads + 1, 4))  # |A|, |A ∩ S|, |A ∩ P|, |S|; the last row: the layer mean
        self.hits = np.zeros(num_heads + 1)
        self.words = 0  # target words with a sure link

    def add(self, weights: torch.Tensor, source_words: Sequence[int], target_words: Sequence[int], sure: Links,
            possible: Links, unscored: frozenset = frozenset()) -> None:
        """`unscored`: target words the reference leaves out of alignment (punctuation a manual alignment
        excludes): links to them are not counted."""
        if self.num_heads == 0:  # a layer pruned to no head aligns nothing
            return
        weights = weights.double()
        maps = torch.cat([weights, weights.mean(0, keepdim=True)])
        linked = {j for _, j in sure}
        self.words += len(linked)
        for row, links in enumerate(head_links(maps, source_words, target_words)):
            links = {(i, j) for i, j in links if j not in unscored}
            self.counts[row] += (len(links), len(links & sure), len(links & possible), len(sure))
            self.hits[row] += len({j for i, j in links if (i, j) in sure})

    def table(self, max_aer: float) -> Tuple[pd.DataFrame, float]:
        """One row per head (alignment_aer, alignment_share, alignment), and the layer mean's AER."""
        a, a_sure, a_possible, sure = self.counts.T
        rates = 1 - (a_sure + a_possible) / np.maximum(a + sure, 1)
        table = pd.DataFrame({"head": range(self.num_heads), "alignment_aer": rates[:-1],
                              "alignment_share": self.hits[:-1] / max(self.words, 1)})
        table["alignment"] = table["alignment_aer"] <= max_aer
        return table, float(rates[-1]) if self.num_heads else float("nan")


def pharaoh_lines(alignments: Sequence[Tuple[Links, Links]]) -> str:
    """Pharaoh text of (sure, possible) links: `i-j` sure, `i?j` possible only; read back by read_pharaoh."""
    return "".join(" ".join([f"{i}-{j}" for i, j in sorted(sure)] + [f"{i}?{j}" for i, j in sorted(possible - sure)])
                   + "\n" for sure, possible in alignments)
