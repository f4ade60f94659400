"""Paired bootstrap resampling over test sentences (Koehn 2004), computed by sacreBLEU's own code
(`sacrebleu.significance`, what `sacrebleu --paired-bs` runs), not by hand: a system against its reference
system on the same sentences, with the p-value of their BLEU difference and each one's 95 % interval.

sacreBLEU takes its seed from SACREBLEU_SEED; it is set for the call and recorded with the result, as is the
number of resamples, so the same inputs give the same numbers. Two systems that translate every sentence
alike are given p = 1: every resample's difference is then zero, and sacreBLEU's strict count (resamples whose
centred difference exceeds the observed one, plus one, over n + 1) would give them its smallest p, 1/(n+1),
which a table reads as a significant change. Where the translations differ the p-value is sacreBLEU's, and a
difference of zero BLEU is never marked significant.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Sequence

from ..bleu import DEFAULT_TOKENIZE

DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 12345
ALPHA = 0.05


@contextmanager
def _sacrebleu_seed(seed: int) -> Iterator[None]:
    previous = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = previous


def paired_bootstrap(reference_system: Sequence[str], system: Sequence[str], references: Sequence[str],
                     resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                     tokenize: str = DEFAULT_TOKENIZE) -> dict:
    """BLEU of `system` against `reference_system` (both translations of `references`, line by line): the two
    scores, their bootstrap means and 95 % half-widths, the difference, its p-value and whether p < 0.05.
    `tokenize`: sacreBLEU's tokenization, as the runs' BLEU was computed (bleu.tokenize_of their signature)."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    if not len(reference_system) == len(system) == len(references):
        raise ValueError(f"paired test on {len(reference_system)}, {len(system)} hypotheses and {len(references)} "
                         "references: both systems must translate the same sentences")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, not {resamples}")
    with _sacrebleu_seed(seed):
        test = PairedTest([("reference", list(reference_system)), ("system", list(system))], {"BLEU": BLEU(tokenize=tokenize)},
                          [list(references)], test_type="bs", n_samples=resamples)
        signatures, scores = test()
    (name, results), = ((k, v) for k, v in scores.items() if k != "System")
    base, other = results
    p_value = 1.0 if list(system) == list(reference_system) else other.p_value
    return {"bleu": other.score, "reference_bleu": base.score, "delta": other.score - base.score,
            "bleu_mean": other.mean, "bleu_ci95": other.ci, "reference_bleu_mean": base.mean,
            "reference_bleu_ci95": base.ci, "p_value": p_value,
            "significant": bool(p_value < ALPHA and other.score != base.score),
            "resamples": resamples, "seed": seed, "signature": str(signatures[name])}
