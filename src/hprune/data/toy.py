"""The embedded synthetic translation task (`data=toy`).

A seeded grammar produces a parallel corpus whose translation forces attention heads to specialise the way
they do on real language:

    source:  [the ADJ* NOUN | NAME]subj  [ADV]  VERB  [the ADJ* NOUN | NAME]obj
    target:  [le NOUN' ADJ'* | NAME]subj  [... ]obj  [ADV']  VERB'-SUFFIX(class of subject)

* local reordering: adjectives follow their noun, the verb goes last (positional heads);
* agreement across a distance: the verb's suffix depends on the subject noun's class (syntactic heads);
* amod / advmod / dobj / nsubj relations, written as gold arcs for every source sentence;
* rare names, each seen only a few times in training, copied through unchanged (rare-token heads).

Every word is a pseudo-word made from syllables, so no real language leaks in. Same parameters, same
corpus, byte for byte.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

SRC, TGT = "src", "tgt"
ARC_LABELS = ("nsubj", "dobj", "amod", "advmod")  # the relations of the gold arcs (raw/<split>.arcs.jsonl)


@dataclass(frozen=True)
class ToyParams:
    seed: int = 1
    n_train: int = 20000
    n_valid: int = 400
    n_test: int = 400
    n_noun_classes: int = 3
    nouns_per_class: int = 10
    n_adjectives: int = 16
    n_verbs: int = 16
    n_adverbs: int = 8
    n_names: int = 800
    name_min_count: int = 2  # occurrences of each name in the training split
    name_max_count: int = 5
    max_adjectives: int = 2
    p_adverb: float = 0.5


@dataclass
class Lexicon:
    nouns: list[list[tuple[str, str]]]  # per class: (source, target)
    adjectives: list[tuple[str, str]]
    verbs: list[tuple[str, list[str]]]  # source, target form per subject class
    adverbs: list[tuple[str, str]]
    names: list[str]


_ONSETS = "b d f g k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()


def _pseudo_words(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    words = []
    while len(words) < count:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def build_lexicon(params: ToyParams) -> Lexicon:
    rng = random.Random(f"lexicon-{params.seed}")
    taken = {"the", "le"}
    n_nouns = params.n_noun_classes * params.nouns_per_class

    def pairs(count: int, syllables: int) -> list[tuple[str, str]]:
        return list(zip(_pseudo_words(rng, count, syllables, taken), _pseudo_words(rng, count, syllables + 1, taken)))

    noun_pairs = pairs(n_nouns, 2)
    nouns = [noun_pairs[c * params.nouns_per_class:(c + 1) * params.nouns_per_class]
             for c in range(params.n_noun_classes)]
    adjectives = pairs(params.n_adjectives, 2)
    suffixes = [v + "x" for v in _VOWELS][: params.n_noun_classes]
    if len(suffixes) < params.n_noun_classes:
        raise ValueError(f"n_noun_classes must be at most {len(_VOWELS)}")
    verb_stems = pairs(params.n_verbs, 2)
    verbs = [(src, [tgt + suffix for suffix in suffixes]) for src, tgt in verb_stems]
    adverbs = pairs(params.n_adverbs, 3)
    names = [w.capitalize() for w in _pseudo_words(rng, params.n_names, 3, taken)]
    return Lexicon(nouns, adjectives, verbs, adverbs, names)


@dataclass
class Sentence:
    source: list[str]
    target: list[str]
    arcs: list[tuple[str, int, int]]  # (label, head position, dependent position), 0-based source positions


class _Generator:
    def __init__(self, params: ToyParams, lexicon: Lexicon, rng: random.Random):
        self.params, self.lexicon, self.rng = params, lexicon, rng

    def noun_phrase(self, start: int, name: str | None):
        """Returns source tokens, target tokens, noun class, position of the head noun and amod arcs."""
        if name is not None:  # names agree like the last class ("persons") and are copied verbatim
            return [name], [name], self.params.n_noun_classes - 1, start, []
        rng, lex = self.rng, self.lexicon
        noun_class = rng.randrange(self.params.n_noun_classes)
        noun_src, noun_tgt = rng.choice(lex.nouns[noun_class])
        adjectives = rng.sample(lex.adjectives, rng.randint(0, self.params.max_adjectives))
        source = ["the"] + [a for a, _ in adjectives] + [noun_src]
        target = ["le", noun_tgt] + [a for _, a in adjectives]
        head = start + len(source) - 1
        arcs = [("amod", head, start + 1 + i) for i in range(len(adjectives))]
        return source, target, noun_class, head, arcs

    def sentence(self, subject_name: str | None, object_name: str | None) -> Sentence:
        rng, lex = self.rng, self.lexicon
        subj_src, subj_tgt, subj_class, subj_head, arcs = self.noun_phrase(0, subject_name)
        source, target = list(subj_src), list(subj_tgt)
        adverb = rng.choice(lex.adverbs) if rng.random() < self.params.p_adverb else None
        if adverb:
            source.append(adverb[0])
        verb_src, verb_tgt = rng.choice(lex.verbs)
        verb_pos = len(source)
        source.append(verb_src)
        obj_src, obj_tgt, _, obj_head, obj_arcs = self.noun_phrase(len(source), object_name)
        source += obj_src
        target += obj_tgt + ([adverb[1]] if adverb else []) + [verb_tgt[subj_class]]
        arcs += obj_arcs + [("nsubj", verb_pos, subj_head), ("dobj", verb_pos, obj_head)]
        if adverb:
            arcs.append(("advmod", verb_pos, verb_pos - 1))
        return Sentence(source, target, sorted(arcs, key=lambda a: (a[2], a[0])))


def generate(params: ToyParams) -> dict[str, list[Sentence]]:
    """The whole corpus, split by split. Every name occurs in training between min and max count times."""
    lexicon = build_lexicon(params)
    corpus: dict[str, list[Sentence]] = {}
    for split, size in (("train", params.n_train), ("valid", params.n_valid), ("test", params.n_test)):
        rng = random.Random(f"{split}-{params.seed}")
        gen = _Generator(params, lexicon, rng)
        if split == "train":
            # Each name is given a fixed small number of slots, spread over random noun-phrase positions.
            slots = [n for n in lexicon.names for _ in range(rng.randint(params.name_min_count, params.name_max_count))]
            if len(slots) > size:
                raise ValueError(f"n_train={size} is too small for {len(slots)} name occurrences")
            positions = rng.sample(range(2 * size), len(slots))
            name_at = dict(zip(positions, slots))
            corpus[split] = [gen.sentence(name_at.get(2 * i), name_at.get(2 * i + 1)) for i in range(size)]
        else:
            rate = 0.1

            def pick():
                return rng.choice(lexicon.names) if rng.random() < rate else None

            corpus[split] = [gen.sentence(pick(), pick()) for _ in range(size)]
    return corpus


def write_corpus(params: ToyParams, out_dir: Path) -> None:
    """Writes `{split}.src`, `{split}.tgt`, `{split}.arcs.jsonl` and `params.json` into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, sentences in generate(params).items():
        (out_dir / f"{split}.{SRC}").write_text("".join(" ".join(s.source) + "\n" for s in sentences))
        (out_dir / f"{split}.{TGT}").write_text("".join(" ".join(s.target) + "\n" for s in sentences))
        (out_dir / f"{split}.arcs.jsonl").write_text(
            "".join(json.dumps({"arcs": [list(a) for a in s.arcs]}) + "\n" for s in sentences))
    (out_dir / "params.json").write_text(json.dumps(asdict(params), indent=1, sort_keys=True) + "\n")
