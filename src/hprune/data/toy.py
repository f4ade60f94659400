"""The embedded synthetic translation task (`data=toy`).

A seeded grammar produces a parallel corpus whose translation forces attention heads to specialise the way
they do on real, subword-level language:

    source:  NP(subj) ga  NP(obj) wo  [ADV] VERB      or, as often,   NP(obj) wo  NP(subj) ga  [ADV] VERB
             NP = the ADJ* NOUN | NAME
    target:  NP'(subj)  NP'(obj)  [ADV']  VERB'-SUFFIX(class of the subject);   NP' = le NOUN' ADJ'* | NAME

* subword pieces, written as BPE writes them (`ba@@ ko`): every content word is a stem piece and an ending
  piece from one shared inventory, and neither piece alone tells the word, its part of speech or a noun's
  class (class = stem + ending, modulo the classes), so the encoder must assemble words from neighbours;
* free source order marked by case particles: who is the subject is said by the particle after a noun phrase,
  not by its place, so the noun phrases must learn their role from their context before the decoder can put
  the subject first (without encoder self-attention this cannot be done);
* reordering (adjectives follow their noun), agreement across a distance (the verb's suffix depends on the
  subject noun's class);
* many rare names, each seen only a few times in training and made of rare pieces, copied through piece by
  piece (rare-token heads);
* amod / advmod / dobj / nsubj relations, written as gold arcs between token positions (a word is its last
  piece) for every source sentence;
* gold word alignments (raw/<split>.align, Pharaoh `i-j`): each determiner, noun, adjective, name, adverb and
  verb to its translation; the case particles have none (with mark_offset they are translated, and aligned).

Opt-in levers, off by default, meant to make encoder heads specialise (docs/data.md): mark_offset,
whole_words, code_length, shared_pieces, object_agreement.

The text in raw/ is words (the references, as BLEU sees them); the pieces the model reads are in pieces/.
Every word is a pseudo-word made from syllables, so no real language leaks in. Same parameters, same corpus,
byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from .kinds import DataKind, register_kind

SRC, TGT = "src", "tgt"
ARC_LABELS = ("nsubj", "dobj", "amod", "advmod")  # the relations of the gold arcs (raw/<split>.arcs.jsonl)
SUBJECT_PARTICLE, OBJECT_PARTICLE = "ga", "wo"  # case markers after each noun phrase: they, not the order, say who
CONTINUATION = "@@"  # subword-nmt's mark on every piece but a word's last (fairseq --post-process subword_nmt)
NEIGHBOUR_MARKS, AGREEMENT_MARKS = "bcdfghjklmnpqrstvxz", "qwy"  # the letters of mark_offset and object_agreement
# with mark_offset the particles are translated too; vowel-initial, so no generated pseudo-word is one
CASE_WORDS = {SUBJECT_PARTICLE: "an", OBJECT_PARTICLE: "ot"}
CODE_WORDS = ("id", "ud")  # with code_length: the word before a code, and its translation (vowel-initial too)

Word = tuple  # a word's pieces, continuation marks included: ("ba@@", "ko")


@dataclass(frozen=True)
class ToyParams:
    seed: int = 1
    n_train: int = 20000
    n_valid: int = 400
    n_test: int = 400
    n_noun_classes: int = 3
    nouns_per_class: int = 10
    n_stems: int = 12
    n_endings: int = 8
    n_adjectives: int = 16
    n_verbs: int = 16
    n_adverbs: int = 8
    n_names: int = 5000
    name_min_count: int = 2  # occurrences of each name in the training split
    name_max_count: int = 6
    max_adjectives: int = 2
    p_adverb: float = 0.5
    p_object_first: float = 0.5  # source order object-subject-verb instead of subject-object-verb
    mark_offset: int = 0  # -1 / +1: every source token's translation is marked by its left / right neighbour
    whole_words: bool = False  # content words are one piece each (names stay in pieces)
    shared_pieces: bool = False  # a content word's two pieces come from one inventory (n_stems), in either place
    object_agreement: bool = False  # the object noun's translation agrees with the verb (its class)
    code_length: int = 0  # N > 1: every sentence ends with "id" and a code of 2..N pieces drawn from the stems


@dataclass
class Lexicon:
    nouns: list[list[tuple[Word, str]]]  # per class: (source pieces, target word)
    adjectives: list[tuple[Word, str]]
    verbs: list[tuple[Word, list[str]]]  # source pieces, target form per subject class
    adverbs: list[tuple[Word, str]]
    names: list[Word]
    code_pieces: list[str]  # the stems, without continuation marks


_ONSETS = "b d f g k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()


def _pseudo_words(rng: random.Random, count: int, syllables: int, taken: set[str], coda: bool = False) -> list[str]:
    """count new words of `syllables` CV syllables (CVC with coda=True: the rarer name pieces)."""
    words = []
    while len(words) < count:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + (rng.choice(_ONSETS) if coda else "")
                       for _ in range(syllables))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def join_pieces(pieces) -> list[str]:
    """Words from pieces, as fairseq's subword_nmt post-processing gives them back."""
    return " ".join(pieces).replace(CONTINUATION + " ", "").split()


def build_lexicon(params: ToyParams) -> Lexicon:
    rng = random.Random(f"lexicon-{params.seed}")
    taken = {"the", "le", SUBJECT_PARTICLE, OBJECT_PARTICLE}
    classes = params.n_noun_classes
    if classes > len(_VOWELS):
        raise ValueError(f"n_noun_classes must be at most {len(_VOWELS)}")
    stems = _pseudo_words(rng, params.n_stems, 2, taken)
    # shared_pieces: a word's two pieces come from one inventory, so that a piece cannot tell by itself which
    # neighbour is the other half of its word: only the position can (the piece before, or after)
    endings = stems if params.shared_pieces else _pseudo_words(rng, params.n_endings, 1, taken)
    # every content word is a stem and an ending from one shared inventory; a noun's class is (stem + ending)
    # mod classes, so that each piece occurs in every class and in every part of speech: only both tell the word
    combos = [(s, e) for s in range(len(stems)) for e in range(len(endings)) if not (params.shared_pieces and s == e)]
    rng.shuffle(combos)
    by_class = [[c for c in combos if sum(c) % classes == k] for k in range(classes)]
    if min(len(c) for c in by_class) < params.nouns_per_class:
        raise ValueError("n_stems x n_endings is too small for nouns_per_class nouns in each class")
    noun_combos = [c[:params.nouns_per_class] for c in by_class]
    rest = [c for c in combos if not any(c in chosen for chosen in noun_combos)]
    needed = params.n_adjectives + params.n_verbs + params.n_adverbs
    if len(rest) < needed:
        raise ValueError(f"n_stems x n_endings = {len(combos)} pieces pairs are too few for the "
                         f"{classes * params.nouns_per_class + needed} content words")

    def word(combo) -> Word:
        taken.add(stems[combo[0]] + endings[combo[1]])  # the joined word is unique too
        if params.whole_words:
            return (stems[combo[0]] + endings[combo[1]],)
        return stems[combo[0]] + CONTINUATION, endings[combo[1]]

    def translated(chosen, syllables: int) -> list:
        return list(zip((word(c) for c in chosen), _pseudo_words(rng, len(chosen), syllables, taken)))

    nouns = [translated(chosen, 3) for chosen in noun_combos]
    adjectives = translated(rest[:params.n_adjectives], 3)
    suffixes = [v + "x" for v in _VOWELS][:classes]
    verbs = [(src, [tgt + suffix for suffix in suffixes])
             for src, tgt in translated(rest[params.n_adjectives:params.n_adjectives + params.n_verbs], 2)]
    adverbs = translated(rest[params.n_adjectives + params.n_verbs:needed], 4)
    pieces = _pseudo_words(rng, 600, 1, taken, coda=True)
    names: list[Word] = []
    seen = set()
    while len(names) < params.n_names:
        name = rng.sample(pieces, rng.randint(2, 3))
        name[0] = name[0].capitalize()
        if tuple(name) not in seen:
            seen.add(tuple(name))
            names.append(tuple(p + CONTINUATION for p in name[:-1]) + (name[-1],))
    return Lexicon(nouns, adjectives, verbs, adverbs, names, stems)


@dataclass
class Sentence:
    source: list[str]  # pieces
    target: list[str]  # pieces
    arcs: list[tuple[str, int, int]]  # (label, head, dependent): 0-based source token positions, a word's last piece
    alignment: list[tuple[int, int]]  # (source word, target word), 0-based word positions


class _Generator:
    def __init__(self, params: ToyParams, lexicon: Lexicon, rng: random.Random):
        self.params, self.lexicon, self.rng = params, lexicon, rng

    def noun_phrase(self, start: int, name: Word | None):
        """Returns source tokens, target tokens, noun class, position of the head noun, amod arcs and the word
        alignment within the phrase."""
        if name is not None:  # names agree like the last class ("persons") and are copied verbatim
            return list(name), list(name), self.params.n_noun_classes - 1, start + len(name) - 1, [], [(0, 0)]
        rng, lex = self.rng, self.lexicon
        noun_class = rng.randrange(self.params.n_noun_classes)
        noun_src, noun_tgt = rng.choice(lex.nouns[noun_class])
        adjectives = rng.sample(lex.adjectives, rng.randint(0, self.params.max_adjectives))
        source, ends = ["the"], []
        for pieces, _ in adjectives:
            source += pieces
            ends.append(start + len(source) - 1)
        source += noun_src
        target = ["le", noun_tgt] + [a for _, a in adjectives]
        head = start + len(source) - 1
        # words: the, the adjectives, the noun -> le, the noun, the adjectives
        alignment = [(0, 0), (len(adjectives) + 1, 1)] + [(1 + i, 2 + i) for i in range(len(adjectives))]
        return source, target, noun_class, head, [("amod", head, end) for end in ends], alignment

    def sentence(self, subject_name: Word | None, object_name: Word | None) -> Sentence:
        """Source: both noun phrases, each followed by its case particle, in either order, then the verb (the
        adverb before it); target: subject, object, adverb, verb."""
        rng, lex, p = self.rng, self.lexicon, self.params
        object_first = rng.random() < p.p_object_first
        source, arcs, heads = [], [], {}
        target_of, words_of = {}, {}  # per role: target tokens; (first source word, the phrase's alignment)
        for role in (("obj", "subj") if object_first else ("subj", "obj")):
            src, tgt, noun_class, head, np_arcs, np_alignment = self.noun_phrase(
                len(source), subject_name if role == "subj" else object_name)
            particle = SUBJECT_PARTICLE if role == "subj" else OBJECT_PARTICLE
            if p.mark_offset:  # the particle's translation follows its noun phrase's
                np_alignment = np_alignment + [(len(join_pieces(src)), len(join_pieces(tgt)))]
                tgt = tgt + [CASE_WORDS[particle]]
            words_of[role] = (len(join_pieces(source)), np_alignment)
            source += src + [particle]
            arcs += np_arcs
            heads[role], target_of[role] = head, tgt
            if role == "subj":
                subj_class = noun_class
        adverb = rng.choice(lex.adverbs) if rng.random() < p.p_adverb else None
        if adverb:
            source += adverb[0]
        adverb_end = len(source) - 1
        verb_src, verb_tgt = verb = rng.choice(lex.verbs)
        source += verb_src
        verb_pos = len(source) - 1
        target = target_of["subj"] + target_of["obj"] + ([adverb[1]] if adverb else []) + [verb_tgt[subj_class]]
        arcs += [("nsubj", verb_pos, heads["subj"]), ("dobj", verb_pos, heads["obj"])]
        if adverb:
            arcs.append(("advmod", verb_pos, adverb_end))
        alignment, target_start = [], 0
        for role in ("subj", "obj"):
            source_start, links = words_of[role]
            alignment += [(source_start + i, target_start + j) for i, j in links]
            target_start += len(join_pieces(target_of[role]))
        source_words = len(join_pieces(source))
        if adverb:
            alignment.append((source_words - 2, target_start))
        alignment.append((source_words - 1, len(join_pieces(target)) - 1))  # the verb
        if p.code_length:  # a code copied piece by piece: pieces repeat, only their order tells them apart
            code = [rng.choice(lex.code_pieces) for _ in range(rng.randint(2, p.code_length))]
            code = [piece + CONTINUATION for piece in code[:-1]] + code[-1:]
            alignment += [(source_words, len(join_pieces(target))), (source_words + 1, len(join_pieces(target)) + 1)]
            source, target = source + [CODE_WORDS[0]] + code, target + [CODE_WORDS[1]] + code
        if p.mark_offset or p.object_agreement:
            obj_start = len(join_pieces(target_of["subj"])) if object_name is None else None  # its "le"
            target = self.inflect(source, target, alignment, obj_start, lex.verbs.index(verb))
        return Sentence(source, target, sorted(arcs, key=lambda a: (a[2], a[0])), sorted(alignment))

    def inflect(self, source: list, target: list, alignment: list, obj_start: int | None, verb: int) -> list:
        """Marks meant to make roles needed: with mark_offset -1 (+1), every translated word ends with a letter
        naming the source token just before (after) its source word, and every piece of a copied name with one
        naming the piece before (after) it: a look one token aside for every query; with object_agreement, the
        object noun's translation also ends with its verb's class (along the dobj arc, at a distance that
        varies with the order and the adverb)."""
        starts = [i for i, piece in enumerate(source) if i == 0 or not source[i - 1].endswith(CONTINUATION)]
        spans = [i for i, piece in enumerate(target) if i == 0 or not target[i - 1].endswith(CONTINUATION)]
        words = [list(target[start:end]) for start, end in zip(spans, spans[1:] + [len(target)])]
        offset = self.params.mark_offset
        if offset:
            ends = [start - 1 for start in starts[1:]] + [len(source) - 1]
            for i, j in alignment:
                # a copied name: each piece marked by its neighbour piece; a word: by the word's neighbour token
                for k, piece in enumerate(words[j]):  # several pieces: a name
                    position = (starts[i] + k if len(words[j]) > 1 else starts[i] if offset < 0 else ends[i]) + offset
                    neighbour = source[position] if 0 <= position < len(source) else "</s>"
                    mark = NEIGHBOUR_MARKS[_mark(neighbour) % len(NEIGHBOUR_MARKS)]
                    stem = piece[:-len(CONTINUATION)] if piece.endswith(CONTINUATION) else piece
                    words[j][k] = stem + mark + piece[len(stem):]
        if self.params.object_agreement and obj_start is not None:
            words[obj_start + 1][0] += AGREEMENT_MARKS[verb % len(AGREEMENT_MARKS)]
        return [piece for word in words for piece in word]


def _mark(token: str) -> int:
    """A token's mark number: the same on every machine (unlike hash())."""
    return int(hashlib.md5(token.encode()).hexdigest()[:8], 16)


def generate(params: ToyParams) -> dict[str, list[Sentence]]:
    """The whole corpus, split by split. Every name occurs in training between min and max count times; valid and
    test sentences carry names at the training rate, names seen in training."""
    lexicon = build_lexicon(params)
    corpus: dict[str, list[Sentence]] = {}
    rng = random.Random(f"train-{params.seed}")
    # Each name is given a fixed small number of slots, spread over random noun-phrase positions.
    slots = [n for n in lexicon.names for _ in range(rng.randint(params.name_min_count, params.name_max_count))]
    if len(slots) > 2 * params.n_train:
        raise ValueError(f"n_train={params.n_train} is too small for {len(slots)} name occurrences")
    name_at = dict(zip(rng.sample(range(2 * params.n_train), len(slots)), slots))
    gen = _Generator(params, lexicon, rng)
    corpus["train"] = [gen.sentence(name_at.get(2 * i), name_at.get(2 * i + 1)) for i in range(params.n_train)]
    rate = len(slots) / (2 * params.n_train)
    for split, size in (("valid", params.n_valid), ("test", params.n_test)):
        rng = random.Random(f"{split}-{params.seed}")
        gen = _Generator(params, lexicon, rng)

        def pick():
            return rng.choice(lexicon.names) if rng.random() < rate else None

        corpus[split] = [gen.sentence(pick(), pick()) for _ in range(size)]
    return corpus


def write_corpus(params: ToyParams, raw_dir: Path, pieces_dir: Path) -> None:
    """Writes words to raw_dir (`{split}.src`, `{split}.tgt`, `{split}.arcs.jsonl`, `{split}.align`, `params.json`)
    and the pieces the model reads to pieces_dir (`{split}.src`, `{split}.tgt`)."""
    for folder in (raw_dir, pieces_dir):
        folder.mkdir(parents=True, exist_ok=True)
    for split, sentences in generate(params).items():
        for lang, side in ((SRC, "source"), (TGT, "target")):
            lines = [getattr(s, side) for s in sentences]
            (pieces_dir / f"{split}.{lang}").write_text("".join(" ".join(p) + "\n" for p in lines))
            (raw_dir / f"{split}.{lang}").write_text("".join(" ".join(join_pieces(p)) + "\n" for p in lines))
        (raw_dir / f"{split}.arcs.jsonl").write_text(
            "".join(json.dumps({"arcs": [list(a) for a in s.arcs]}) + "\n" for s in sentences))
        (raw_dir / f"{split}.align").write_text(
            "".join(" ".join(f"{i}-{j}" for i, j in s.alignment) + "\n" for s in sentences))
    (raw_dir / "params.json").write_text(json.dumps(asdict(params), indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------- the data kind
FORMAT_VERSION = 4  # bump when the generator or the binarization changes (4: gold word alignments)


def params_of(data: DictConfig) -> ToyParams:
    params = OmegaConf.to_container(data.params, resolve=True)
    unknown = set(params) - set(ToyParams.__dataclass_fields__)
    if unknown:
        raise UserError(f"unknown toy data parameter(s) {sorted(unknown)}; "
                        f"valid ones: {', '.join(ToyParams.__dataclass_fields__)}")
    least = {"n_train": 1, "n_valid": 1, "n_noun_classes": 1, "nouns_per_class": 1, "n_adjectives": 1, "n_verbs": 1,
             "n_adverbs": 1, "n_names": 1, "name_min_count": 1, "n_stems": 1, "n_endings": 1}  # others may be 0
    probabilities = ("p_adverb", "p_object_first")
    if params.get("mark_offset", 0) not in (-1, 0, 1):
        raise UserError(f"data.params.mark_offset={params['mark_offset']} must be -1 (left neighbour), 0 (none) or "
                        "1 (right neighbour)")
    for key, value in params.items():
        if key in ("seed", "mark_offset") or key in probabilities:
            continue
        if not isinstance(value, int) or value < least.get(key, 0):
            raise UserError(f"data.params.{key}={value} must be a whole number >= {least.get(key, 0)}; "
                            f"e.g. data.params.{key}={getattr(ToyParams, key)}")
    if params.get("code_length", 0) == 1:
        raise UserError("data.params.code_length=1: a code has 2 pieces or more; use 0 (no code) or 2 and up")
    if params.get("name_max_count", ToyParams.name_max_count) < params.get("name_min_count", ToyParams.name_min_count):
        raise UserError("data.params.name_max_count must be >= data.params.name_min_count")
    for key in probabilities:
        if not isinstance(params.get(key, 0), (int, float)) or not 0 <= params.get(key, 0) <= 1:
            raise UserError(f"data.params.{key}={params[key]} is a probability; use 0..1")
    toy = ToyParams(**params)
    try:
        build_lexicon(toy)  # a few milliseconds: refuses inventories too small for the words asked for
    except ValueError as err:
        raise UserError(f"data.params: {err}") from None
    if toy.n_names * toy.name_max_count > 2 * toy.n_train:
        raise UserError(f"data.params.n_train={toy.n_train} has too few noun phrases for n_names x name_max_count "
                        f"= {toy.n_names * toy.name_max_count} name occurrences; raise n_train or lower n_names")
    return toy


def key(data: DictConfig) -> str:
    params = json.dumps({"kind": "toy", "params": asdict(params_of(data)), "format": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha1(params.encode()).hexdigest()[:12]


def build(data: DictConfig, data_root: Path, staging: Path) -> dict:
    from .. import backend  # fairseq is needed only to build

    write_corpus(params_of(data), staging / "raw", staging / "pieces")
    backend.binarize(staging / "pieces", staging / "bin", SRC, TGT)
    return {}


register_kind(DataKind("toy", key=key, check=params_of, build=build))
