"""The synthetic task: deterministic, and built with the properties the head roles rely on."""
import collections
import json
from dataclasses import replace

from hprune.data.toy import ARC_LABELS, ToyParams, build_lexicon, generate, write_corpus

SMALL = ToyParams(n_train=1500, n_valid=50, n_test=50, n_names=40)


def test_same_seed_same_bytes_other_seed_other_corpus(tmp_path):
    write_corpus(SMALL, tmp_path / "a")
    write_corpus(SMALL, tmp_path / "b")
    write_corpus(replace(SMALL, seed=2), tmp_path / "c")
    for name in ("train.src", "train.tgt", "test.arcs.jsonl", "params.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "train.src").read_bytes() != (tmp_path / "c" / "train.src").read_bytes()
    assert json.loads((tmp_path / "a" / "params.json").read_text())["n_train"] == 1500


def test_each_name_is_rare_in_training_and_copied_through():
    corpus, lexicon = generate(SMALL), build_lexicon(SMALL)
    names = set(lexicon.names)
    counts = collections.Counter(t for s in corpus["train"] for t in s.source if t in names)
    assert set(counts) == names
    assert min(counts.values()) >= SMALL.name_min_count and max(counts.values()) <= SMALL.name_max_count
    for sentence in corpus["train"] + corpus["test"]:
        assert [t for t in sentence.source if t in names] == [t for t in sentence.target if t in names]
    assert any(t in names for s in corpus["test"] for t in s.source)


def test_arcs_and_agreement():
    corpus, lexicon = generate(SMALL), build_lexicon(SMALL)
    noun_class = {src: c for c, nouns in enumerate(lexicon.nouns) for src, _ in nouns}
    noun_class.update({n: SMALL.n_noun_classes - 1 for n in lexicon.names})
    verb_forms = {src: forms for src, forms in lexicon.verbs}
    adjectives = {a for a, _ in lexicon.adjectives}
    for s in corpus["train"][:300]:
        arcs = {label: [(h, d) for lab, h, d in s.arcs if lab == label] for label in ARC_LABELS}
        (verb, subject), = arcs["nsubj"]
        (verb2, obj), = arcs["dobj"]
        assert verb == verb2 and s.source[verb] in verb_forms and subject < verb < obj
        # the target verb (the last word) agrees with the class of the subject, several tokens back
        assert s.target[-1] == verb_forms[s.source[verb]][noun_class[s.source[subject]]]
        for head, dep in arcs["amod"]:
            assert s.source[dep] in adjectives and s.source[head] in noun_class and dep < head
        for head, dep in arcs["advmod"]:
            assert head == verb and dep == verb - 1
        assert all(0 <= i < len(s.source) for _, h, d in s.arcs for i in (h, d))


def test_adjectives_follow_their_noun_in_the_target():
    corpus, lexicon = generate(SMALL), build_lexicon(SMALL)
    translation = dict(lexicon.adjectives + [pair for nouns in lexicon.nouns for pair in nouns])
    sentence = next(s for s in corpus["train"] if any(lab == "amod" for lab, _, _ in s.arcs))
    label, head, dep = next(a for a in sentence.arcs if a[0] == "amod")
    noun_at = sentence.target.index(translation[sentence.source[head]])
    assert translation[sentence.source[dep]] in sentence.target[noun_at + 1:]
