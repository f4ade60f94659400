"""Text processing of fairseq's recipes, in Python: Moses punctuation normalisation and tokenization
(sacremoses: `tokenizer.perl -a` for WMT, `tokenizer.perl` alone for IWSLT), lowercasing, joint BPE (subword-nmt,
or sentencepiece), and `clean-corpus-n.perl`. A step of several functions joins their names with +
(`moses+lowercase`).

Files are processed in chunks by a pool of worker processes; output order is input order.
"""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import signal
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from hprune.errors import STOP_SIGNALS

CHUNK_LINES = 2000
_worker: Optional[Callable[[str], str]] = None  # the per-process line function, built once by _init


def _moses(lang: str) -> Callable[[str], str]:
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    # normalize-punctuation.perl + remove-non-printing-char.perl, then tokenizer.perl -a (escaping as Moses does)
    normalizer = MosesPunctNormalizer(lang=lang, pre_replace_unicode_punct=True, post_remove_control_chars=True)
    tokenizer = MosesTokenizer(lang=lang)
    return lambda line: tokenizer.tokenize(normalizer.normalize(line), aggressive_dash_splits=True,
                                           return_str=True, escape=True)


def _moses_plain(lang: str) -> Callable[[str], str]:
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)  # tokenizer.perl -l <lang>: no -a, no punctuation normalisation
    return lambda line: tokenizer.tokenize(line, return_str=True, escape=True)


def _lowercase(_: str) -> Callable[[str], str]:
    return str.lower  # lowercase.perl


def _normalize_only(lang: str) -> Callable[[str], str]:
    from sacremoses import MosesPunctNormalizer

    normalizer = MosesPunctNormalizer(lang=lang, pre_replace_unicode_punct=True, post_remove_control_chars=True)
    return lambda line: " ".join(normalizer.normalize(line).split())


def _subword_nmt(codes: str) -> Callable[[str], str]:
    from subword_nmt.apply_bpe import BPE

    with open(codes, encoding="utf-8") as f:
        bpe = BPE(f)
    return lambda line: bpe.segment(line.strip())


BOM = "\ufeff"  # a byte-order mark: Windows editors start UTF-8 files with it; it is no text


def read_lines(path: Path) -> list[str]:
    """A text file of yours as its lines: split at \\n only (as `wc -l` counts them, not at the other line
    boundaries str.splitlines knows), without CRLF's \\r or a byte-order mark at a line's start (a file's, or one
    concatenated in)."""
    lines = Path(path).expanduser().read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r").lstrip(BOM) for line in lines]


def fastbpe_codes_to_subword_nmt(src: Path, dest: Path) -> Path:
    """fastBPE's codes (WMT19 models: `left right count` a line, in merge order; the last character of a word
    carries `</w>`) as subword-nmt codes (version 0.2: the same merges and end-of-word convention, without the
    counts, under a `#version: 0.2` header), which subword-nmt then applies as fastBPE would (fastBPE does not
    build on Python 3.11). Codes already in subword-nmt's format are copied as they are."""
    from ..errors import UserError
    from ..files import write_atomic

    lines = Path(src).read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("#version"):
        return write_atomic(dest, "\n".join(lines) + "\n")
    merges = []
    for number, line in enumerate(lines, 1):
        fields = line.split(" ")
        if len(fields) != 3 or not fields[2].isdigit() or not fields[0] or not fields[1]:
            raise UserError(f"{src}:{number} is not a fastBPE merge ('left right count'): {line[:60]!r}; "
                            "pass the model's own bpecodes")
        merges.append(f"{fields[0]} {fields[1]}")
    return write_atomic(dest, "#version: 0.2\n" + "".join(m + "\n" for m in merges))


def _sentencepiece(model: str) -> Callable[[str], str]:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    return lambda line: " ".join(processor.encode(line.strip(), out_type=str))


FUNCTIONS = {"moses": _moses, "moses_plain": _moses_plain, "normalize": _normalize_only, "lowercase": _lowercase,
             "subword_nmt": _subword_nmt, "sentencepiece": _sentencepiece}


def line_function(step: str, arg: str) -> Callable[[str], str]:
    """The line function of a step (`a+b`: a, then b), each built with `arg` (a language, a model file)."""
    functions = [FUNCTIONS[name](arg) for name in step.split("+")]
    if len(functions) == 1:
        return functions[0]

    def chained(line: str) -> str:
        for function in functions:
            line = function(line)
        return line

    return chained


def _init(step: str, arg: str, mask: set[int]) -> None:
    global _worker
    # a worker ends as the signal ends any process (no traceback of its own: its parent says it in one line),
    # and only then takes the stop signals its parent held back while forking it (see _pool)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _worker = line_function(step, arg)


@contextlib.contextmanager
def _pool(workers: int, step: str, arg: str) -> Iterator[multiprocessing.pool.Pool]:
    """A pool of forked workers, ended (terminated) when the block ends. The stop signals are held back while
    the workers are forked: a signal that reaches a child before its interpreter has finished forking is dropped
    by Python (it clears the flags of signals caught around a fork), so a pool ending a worker that had only just
    started lost its SIGTERM and waited for that worker forever (on a queue lock the pool itself holds). Held
    back, the signal stays pending until _init lets it in."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, list(STOP_SIGNALS))
    try:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_init, initargs=(step, arg, mask))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    with pool:  # a stop held back meanwhile is taken here, and ends the pool
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        yield pool


def _run_chunk(lines: list[str]) -> list[str]:
    return [_worker(line) for line in lines]


def _chunks(lines: Iterable[str]) -> Iterator[list[str]]:
    it = iter(lines)
    while chunk := list(itertools.islice(it, CHUNK_LINES)):
        yield chunk


def map_file(step: str, arg: str, src: Path, dest: Path, workers: int = 1) -> int:
    """Write `line_function(step, arg)` of every line of src to dest; returns the number of lines."""
    n = 0
    with open(src, encoding="utf-8") as fin, open(dest, "w", encoding="utf-8") as fout:
        lines = (line.rstrip("\n") for line in fin)
        if workers <= 1:
            fn = line_function(step, arg)
            results: Iterable[list[str]] = ([fn(line) for line in chunk] for chunk in _chunks(lines))
            for chunk in results:
                fout.writelines(out + "\n" for out in chunk)
                n += len(chunk)
            return n
        with _pool(workers, step, arg) as pool:
            for chunk in pool.imap(_run_chunk, _chunks(lines)):
                fout.writelines(out + "\n" for out in chunk)
                n += len(chunk)
    return n


def learn_subword_nmt(files: list[Path], codes: Path, merges: int) -> None:
    """Joint BPE over all files (the recipes' `cat train.src train.tgt | learn_bpe.py -s 40000`)."""
    from subword_nmt.learn_bpe import learn_bpe

    handles = [open(f, encoding="utf-8") for f in files]
    try:
        with open(codes, "w", encoding="utf-8") as out:
            learn_bpe(itertools.chain(*handles), out, merges)
    finally:
        for h in handles:
            h.close()


def learn_sentencepiece(files: list[Path], model_prefix: Path, vocab_size: int, seed_sentences: int = 10_000_000) -> None:
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        input=",".join(str(f) for f in files), model_prefix=str(model_prefix), vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, input_sentence_size=seed_sentences, shuffle_input_sentence=True,
        hard_vocab_limit=False, minloglevel=2)


MAX_WORD_LENGTH = 1000  # clean-corpus-n.perl's -max-word-length (its default, which no recipe changes)


def keep_pair(src: str, tgt: str, min_len: int, max_len: int, max_ratio: float,
              max_word_length: int = MAX_WORD_LENGTH) -> bool:
    """clean-corpus-n.perl: both sides within [min_len, max_len] words, neither more than max_ratio times longer
    than the other, and no word longer than max_word_length characters (the script drops a pair when either side
    matches `[^\\s|]{max_word_length + 1}` after deleting `|`, which only a factored corpus keeps: a word's
    characters other than `|` are counted)."""
    ns, nt = len(src.split()), len(tgt.split())
    if not (min_len <= ns <= max_len and min_len <= nt <= max_len):
        return False
    if not (ns <= max_ratio * nt and nt <= max_ratio * ns):
        return False
    return not any(len(word) - word.count("|") > max_word_length for side in (src, tgt) for word in side.split()
                   if len(word) > max_word_length)
