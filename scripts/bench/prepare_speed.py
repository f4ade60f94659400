"""WMT preparation throughput on a generated 200k-pair corpus: sentence pairs/s of each stage hprune runs
(Moses tokenization, BPE learning and application, binarization), and hprune's binarization vs fairseq's own
`fairseq-preprocess` command on the same text, side by side in one run.

    .venv/bin/python scripts/bench/prepare_speed.py [--pairs 200000] [--workers 2] [--merges 10000]
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import BIN, run

os.environ.setdefault("TQDM_DISABLE", "1")  # subword-nmt's progress bar

from hprune import backend
from hprune.data.processing import learn_subword_nmt, map_file

SUFFIXES = ["en", "ung", "er", "lich", "keit", "s", "ed", "ing", "ation", "e"]


def vocabulary(rng: random.Random, n: int, alphabet: str) -> list[str]:
    stems = {"".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))) for _ in range(n)}
    return [stem + rng.choice(SUFFIXES) for stem in sorted(stems)]


def sentence(rng: random.Random, words: list[str], cum_weights: list[float]) -> str:
    tokens = rng.choices(words, cum_weights=cum_weights, k=rng.randint(4, 40))
    tokens[0] = tokens[0].capitalize()
    if len(tokens) > 8:
        tokens.insert(rng.randint(1, len(tokens) - 2), rng.choice([",", "-", "(5%)", "\"so\"", "it's", "U.S."]))
    return " ".join(tokens).replace(" ,", ",") + rng.choice([".", "?", "!"])


def write_corpus(folder: Path, pairs: int) -> None:
    """Zipf-distributed words, as in real text; both sides the same length distribution, different vocabularies."""
    rng = random.Random(1)
    sides = {"en": vocabulary(rng, 30000, "abcdefghijklmnoprstuvwy"), "de": vocabulary(rng, 40000, "abcdefghiklmnorstuwzäöüß")}
    for lang, words in sides.items():
        weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
        for split, n in (("train", pairs), ("valid", 1000), ("test", 1000)):
            with open(folder / f"{split}.{lang}", "w", encoding="utf-8") as f:
                f.writelines(sentence(rng, words, weights) + "\n" for _ in range(n))


def timed(label: str, pairs: int, fn) -> float:
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    print(f"  {label:<34} {seconds:7.1f} s  {pairs / seconds:9,.0f} pairs/s")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--merges", type=int, default=10_000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hprune-bench-prepare-"))
    try:
        raw, tok, bpe = tmp / "raw", tmp / "tok", tmp / "bpe"
        for folder in (raw, tok, bpe):
            folder.mkdir()
        write_corpus(raw, args.pairs)
        splits = ("train", "valid", "test")
        n = args.pairs + 2000
        print(f"{args.pairs:,} training pairs (+2,000 valid/test), {args.workers} workers, {args.merges:,} BPE merges")
        t_tok = timed("tokenize (Moses, both sides)", n, lambda: [
            map_file("moses", lang, raw / f"{s}.{lang}", tok / f"{s}.{lang}", args.workers)
            for s in splits for lang in ("en", "de")])
        t_learn = timed("learn joint BPE (subword-nmt)", args.pairs, lambda: learn_subword_nmt(
            [tok / "train.en", tok / "train.de"], tmp / "codes", args.merges))
        t_apply = timed("apply BPE (both sides)", n, lambda: [
            map_file("subword_nmt", str(tmp / "codes"), tok / f"{s}.{lang}", bpe / f"{s}.{lang}", args.workers)
            for s in splits for lang in ("en", "de")])
        t_ours = timed("binarize (hprune, in process)", n, lambda: backend.binarize(
            bpe, tmp / "bin-hprune", "en", "de", workers=args.workers))
        t_fairseq = timed("binarize (fairseq-preprocess)", n, lambda: run([
            str(BIN / "fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de", "--joined-dictionary",
            "--trainpref", str(bpe / "train"), "--validpref", str(bpe / "valid"), "--testpref", str(bpe / "test"),
            "--destdir", str(tmp / "bin-fairseq"), "--workers", str(args.workers),
            "--thresholdsrc", "0", "--thresholdtgt", "0"]))
        same = all((tmp / "bin-hprune" / f.name).read_bytes() == f.read_bytes()
                   for f in (tmp / "bin-fairseq").glob("*.bin"))
        total = t_tok + t_apply + t_ours
        print(f"tokenize + BPE + binarize: {n / total:,.0f} pairs/s ({total:.1f} s; BPE learning apart: {t_learn:.1f} s)")
        print(f"binarize ratio hprune / fairseq-preprocess (throughput): {t_fairseq / t_ours:.3f}"
              f"  (goal >= 0.9; identical .bin files: {same})")
        if not same:
            sys.exit("hprune's binarized data differs from fairseq-preprocess's")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
