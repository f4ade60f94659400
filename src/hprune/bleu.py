"""sacreBLEU's BLEU as hprune computes it: the tokenization a data set is scored with (`bleu_tokenize`; 13a where
it names none), and the tokenization a score was computed with, read back from its signature. Measuring
(evaluation.py) and the reports' significance tests (reporting/) both take it from here, so that a paired test
tokenizes as the BLEU it tests."""
from __future__ import annotations

import re
from typing import Optional

DEFAULT_TOKENIZE = "13a"  # sacreBLEU's default; a data set's `bleu_tokenize` may choose another (none: its tokens)


def tokenize_of(signature: Optional[str]) -> str:
    """sacreBLEU's tokenization named in a BLEU signature (`...|tok:13a|...`); 13a where none is."""
    found = re.search(r"tok:([\w.-]+)", signature or "")
    return found.group(1) if found else DEFAULT_TOKENIZE
