"""The synthetic task: deterministic, and built with the properties the head roles rely on."""
import collections
import hashlib
import json
from dataclasses import replace

import pytest

from hprune.data.toy import (
    AGREEMENT_MARKS,
    ARC_LABELS,
    CASE_WORDS,
    CODE_WORDS,
    CONTINUATION,
    NEIGHBOUR_MARKS,
    OBJECT_PARTICLE,
    SUBJECT_PARTICLE,
    ToyParams,
    build_lexicon,
    generate,
    join_pieces,
    write_corpus,
)

SMALL = ToyParams(n_train=1500, n_valid=50, n_test=50, n_names=200)


def test_same_seed_same_bytes_other_seed_other_corpus(tmp_path):
    for name, params in (("a", SMALL), ("b", SMALL), ("c", replace(SMALL, seed=2))):
        write_corpus(params, tmp_path / name / "raw", tmp_path / name / "pieces")
    for name in ("raw/train.src", "pieces/train.tgt", "raw/test.arcs.jsonl", "raw/params.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "pieces/train.src").read_bytes() != (tmp_path / "c" / "pieces/train.src").read_bytes()
    assert json.loads((tmp_path / "a" / "raw/params.json").read_text())["n_train"] == 1500
    # the references are the pieces joined as fairseq's subword_nmt post-processing joins them
    pieces = (tmp_path / "a" / "pieces/test.tgt").read_text().splitlines()
    words = (tmp_path / "a" / "raw/test.tgt").read_text().splitlines()
    assert [line.replace("@@ ", "") for line in pieces] == words and any("@@ " in line for line in pieces)


def test_words_need_both_pieces():
    """Every content word is a stem and an ending; neither piece alone tells the word, its part of speech or a
    noun's class: only the two together."""
    lexicon = build_lexicon(SMALL)
    words = {"noun": [p for nouns in lexicon.nouns for p, _ in nouns], "adjective": [p for p, _ in lexicon.adjectives],
             "verb": [p for p, _ in lexicon.verbs], "adverb": [p for p, _ in lexicon.adverbs]}
    every = [w for group in words.values() for w in group]
    assert len(set(every)) == len(every) and all(len(w) == 2 and w[0].endswith(CONTINUATION) for w in every)
    uses = collections.defaultdict(set)
    for kind, group in words.items():
        for stem, ending in group:
            uses[stem].add(kind)
            uses[ending].add(kind)
    assert sum(len(kinds) > 1 for kinds in uses.values()) >= 0.8 * len(uses)
    classes_of = collections.defaultdict(set)
    for c, nouns in enumerate(lexicon.nouns):
        for (stem, ending), _ in nouns:
            classes_of[stem].add(c)
            classes_of[ending].add(c)
    assert sum(len(c) > 1 for c in classes_of.values()) >= 0.8 * len(classes_of)
    assert len({t for nouns in lexicon.nouns for _, t in nouns}) == len(words["noun"])


def test_each_name_is_rare_in_training_made_of_rare_pieces_and_copied_through():
    corpus, lexicon = generate(SMALL), build_lexicon(SMALL)
    names = {" ".join(n) for n in lexicon.names}
    counts = collections.Counter()
    for s in corpus["train"]:
        text = " ".join(s.source)
        counts.update(n for n in names if f" {n} " in f" {text} ")
    assert set(counts) == names
    assert min(counts.values()) >= SMALL.name_min_count and max(counts.values()) <= SMALL.name_max_count
    tokens = collections.Counter(t for s in corpus["train"] for t in s.source)
    name_pieces = {p for n in lexicon.names for p in n}
    assert max(tokens[p] for p in name_pieces) < min(tokens[t] for t in tokens if t not in name_pieces)
    for sentence in corpus["train"] + corpus["test"]:  # copied, subject first: the same pieces, maybe reordered
        assert sorted(t for t in sentence.source if t in name_pieces) == sorted(t for t in sentence.target if t in name_pieces)
    assert sum(any(t in name_pieces for t in s.source) for s in corpus["test"]) >= 0.2 * len(corpus["test"])


def word_ending_at(source, i) -> tuple:
    """The pieces of the word whose last piece is at i."""
    start = i
    while start > 0 and source[start - 1].endswith(CONTINUATION):
        start -= 1
    return tuple(source[start:i + 1])


def test_arcs_point_at_the_words_last_pieces_and_the_verb_agrees():
    corpus, lexicon = generate(SMALL), build_lexicon(SMALL)
    noun_class = {pieces: c for c, nouns in enumerate(lexicon.nouns) for pieces, _ in nouns}
    noun_class.update({n: SMALL.n_noun_classes - 1 for n in lexicon.names})
    verb_forms = dict(lexicon.verbs)
    adjectives, adverbs = {a for a, _ in lexicon.adjectives}, {a for a, _ in lexicon.adverbs}
    orders = collections.Counter()
    for s in corpus["train"][:300]:
        assert all(0 <= i < len(s.source) and not s.source[i].endswith(CONTINUATION) for _, h, d in s.arcs for i in (h, d))
        arcs = {label: [(h, d) for lab, h, d in s.arcs if lab == label] for label in ARC_LABELS}
        (verb, subject), = arcs["nsubj"]
        (verb2, obj), = arcs["dobj"]
        assert verb == verb2 == len(s.source) - 1 and word_ending_at(s.source, verb) in verb_forms
        # each noun phrase is followed by its case particle, in either order
        assert s.source[subject + 1] == SUBJECT_PARTICLE and s.source[obj + 1] == OBJECT_PARTICLE
        orders[subject < obj] += 1
        # the target verb (the last word) agrees with the class of the subject, several tokens back
        assert s.target[-1] == verb_forms[word_ending_at(s.source, verb)][noun_class[word_ending_at(s.source, subject)]]
        for head, dep in arcs["amod"]:
            assert word_ending_at(s.source, dep) in adjectives and word_ending_at(s.source, head) in noun_class
            assert dep < head
        for head, dep in arcs["advmod"]:
            assert head == verb and dep == verb - 2 and word_ending_at(s.source, dep) in adverbs
    assert min(orders.values()) > 100  # both orders, about half each
    assert join_pieces(["Ba@@", "ko@@", "lu", "the"]) == ["Bakolu", "the"]


def test_the_target_puts_the_subject_first_with_adjectives_after_their_noun():
    corpus, lexicon = generate(SMALL), build_lexicon(SMALL)
    translation = dict(lexicon.adjectives + [pair for nouns in lexicon.nouns for pair in nouns])
    for s in corpus["train"][:100]:
        (_, _, subject), = [a for a in s.arcs if a[0] == "nsubj"]
        subject_word = word_ending_at(s.source, subject)
        first = s.target[:len(subject_word)] if subject_word in lexicon.names else s.target[1:2]
        assert first == (list(subject_word) if subject_word in lexicon.names else [translation[subject_word]])
    sentence = next(s for s in corpus["train"] if any(lab == "amod" for lab, _, _ in s.arcs))
    label, head, dep = next(a for a in sentence.arcs if a[0] == "amod")
    noun_at = sentence.target.index(translation[word_ending_at(sentence.source, head)])
    assert translation[word_ending_at(sentence.source, dep)] in sentence.target[noun_at + 1:]


def test_gold_alignments_link_each_word_to_its_translation():
    corpus, lexicon = generate(SMALL), build_lexicon(SMALL)
    translation = {"".join(src).replace(CONTINUATION, ""): tgt for src, tgt in lexicon.adjectives + lexicon.adverbs
                   + [pair for nouns in lexicon.nouns for pair in nouns]}
    translation.update({"".join(src).replace(CONTINUATION, ""): forms for src, forms in lexicon.verbs})
    for s in corpus["train"][:200]:
        source, target = join_pieces(s.source), join_pieces(s.target)
        assert len({j for _, j in s.alignment}) == len(s.alignment) == len(target)  # every target word, once
        for i, j in s.alignment:
            word = source[i].replace(CONTINUATION, "")
            expected = {"the": "le"}.get(word, translation.get(word, word))  # a name is copied
            assert target[j] in (expected if isinstance(expected, list) else [expected])
        assert {source[i] for i in set(range(len(source))) - {i for i, _ in s.alignment}} <= \
            {SUBJECT_PARTICLE, OBJECT_PARTICLE}  # only the particles are unaligned


def _words(pieces: list) -> list:
    """The pieces grouped by word."""
    words = [[]]
    for piece in pieces:
        words[-1].append(piece)
        if not piece.endswith(CONTINUATION):
            words.append([])
    return words[:-1]


def _neighbour_mark(token: str) -> str:  # the generator's rule, restated: md5 of the token, mod the letters
    return NEIGHBOUR_MARKS[int(hashlib.md5(token.encode()).hexdigest()[:8], 16) % len(NEIGHBOUR_MARKS)]


@pytest.mark.parametrize("offset", [-1, 1])
def test_the_role_levers_mark_what_they_promise(offset):
    marked = replace(SMALL, mark_offset=offset, object_agreement=True)
    plain, levers = generate(SMALL)["train"][:200], generate(marked)["train"][:200]
    lexicon = build_lexicon(marked)
    verbs = [src for src, _ in lexicon.verbs]
    for before, after in zip(plain, levers):
        assert after.source == before.source  # the source is the same; the target marked, the particles translated
        words, source, plain_words = join_pieces(after.target), join_pieces(before.source), join_pieces(before.target)
        starts = [i for i, p in enumerate(before.source) if i == 0 or not before.source[i - 1].endswith(CONTINUATION)]
        ends = [start - 1 for start in starts[1:]] + [len(before.source) - 1]

        def mark(position):
            return _neighbour_mark(before.source[position] if 0 <= position < len(before.source) else "</s>")

        (_, verb, obj), = [a for a in before.arcs if a[0] == "dobj"]
        object_noun = [k for k, start in enumerate(starts) if start <= obj][-1]
        plain_of = dict(before.alignment)
        assert sorted(i for i, _ in after.alignment) == list(range(len(source)))  # every word once, particles too
        for i, j in after.alignment:
            if source[i] in (SUBJECT_PARTICLE, OBJECT_PARTICLE):
                assert words[j] == CASE_WORDS[source[i]] + mark(starts[i] + offset)
            elif plain_words[plain_of[i]] == source[i]:  # a copied name: each piece marked by its neighbour piece
                assert words[j] == "".join(before.source[k].replace(CONTINUATION, "") + mark(k + offset)
                                           for k in range(starts[i], ends[i] + 1))
            else:
                expected = plain_words[plain_of[i]] + mark(starts[i] - 1 if offset < 0 else ends[i] + 1)
                if i == object_noun:  # agreement with the verb, along the dobj arc
                    expected += AGREEMENT_MARKS[verbs.index(tuple(before.source[-2:])) % len(AGREEMENT_MARKS)]
                assert words[j] == expected


def test_the_piece_levers_and_the_code():
    shared = build_lexicon(replace(SMALL, shared_pieces=True))
    stems, endings = ({src[k] for nouns in shared.nouns for src, _ in nouns} for k in (0, 1))
    assert {s.replace(CONTINUATION, "") for s in stems} & endings  # one inventory, either place
    pieces, whole = generate(SMALL)["test"], generate(replace(SMALL, whole_words=True))["test"]
    for before, after in zip(pieces, whole):
        assert join_pieces(after.source) == join_pieces(before.source) and after.target == before.target
        names = {w for w in join_pieces(before.target) if w[0].isupper()}
        assert all(len(w) == 1 or "".join(w).replace(CONTINUATION, "") in names
                   for w in _words(after.source))  # one piece a word, names aside
    coded, lexicon = generate(replace(SMALL, code_length=5))["test"], build_lexicon(replace(SMALL, code_length=5))
    assert _words(coded[0].source)[:-2] == _words(pieces[0].source)  # the code comes after the sentence
    for after in coded:
        source, target = _words(after.source), _words(after.target)
        assert [w[0] for w in (source[-2], target[-2])] == list(CODE_WORDS) and source[-1] == target[-1]  # copied
        assert 2 <= len(source[-1]) <= 5 and {p.replace(CONTINUATION, "") for p in source[-1]} <= set(lexicon.code_pieces)
        assert after.alignment[-2:] == [(len(source) - 2, len(target) - 2), (len(source) - 1, len(target) - 1)]
