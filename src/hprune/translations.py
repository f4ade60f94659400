"""A run's translations on disk, kept so that `hprune report` can test any two of them for significance later:
`<run>/hypotheses/<name>.txt` (one hypothesis per line, in test-set order) and `<run>/references.txt`.

Names: a pruning curve's points are `<order>.<step>` (step 0: the unpruned model); Voita runs write `unpruned`,
`pruned` and, when they run, `finetuned` and `scratch`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .files import write_atomic

REFERENCES = "references.txt"


def save(run: Path, name: str, result: dict) -> None:
    """result: an evaluation with "hypotheses" and "references" (Session.evaluate's)."""
    write_atomic(run / "hypotheses" / f"{name}.txt", "".join(h + "\n" for h in result["hypotheses"]))
    if not (run / REFERENCES).exists():
        write_atomic(run / REFERENCES, "".join(r + "\n" for r in result["references"]))


def load(run: Path, name: str) -> Optional[list[str]]:
    """The hypotheses saved under name, None when the run has none (older runs, or not written)."""
    path = Path(run) / "hypotheses" / f"{name}.txt"
    return path.read_text().split("\n")[:-1] if path.exists() else None


def references(run: Path) -> Optional[list[str]]:
    path = Path(run) / REFERENCES
    return path.read_text().split("\n")[:-1] if path.exists() else None
