"""One home for a run directory: what every verb writes into its Hydra run dir, and how it is read back.

    <run>/.hydra/config.yaml     the composed config (its `verb` and every setting)
    <run>/.hydra/overrides.yaml  the command line's overrides
    <run>/metrics.json           the verb's results, written last: a run without it did not finish
    <run>/checkpoints/           fairseq's checkpoints (checkpoint_last.pt, checkpoint_best.pt, the averaged one),
                                 and a pruning's physically pruned checkpoint_pruned.pt
    <run>/head_mask.json         the head mask a prune run chose
    <run>/hypotheses/<name>.txt  translations kept so that `hprune report` can test any two of them for
                                 significance later (one hypothesis a line, in test-set order), and
    <run>/references.txt         their references. A pruning curve's points are `<order>.<step>` (step 0: the
                                 unpruned model, `control.<step>` its fine-tuning control); a procedure writes
                                 `unpruned` and `pruned`, and `finetuned`, `scratch` or its stages where it has them
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

import yaml

from .files import write_atomic

CONFIG, OVERRIDES, METRICS = ".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.json"
CHECKPOINTS, HEAD_MASK, HYPOTHESES, REFERENCES = "checkpoints", "head_mask.json", "hypotheses", "references.txt"
BEST, LAST, PRUNED, AVERAGED = "checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_pruned.pt", "checkpoint_averaged.pt"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    # ------------------------------------------------------------------------------------------- where
    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def checkpoint(self, name: str = BEST) -> Path:
        return self.checkpoints / name

    @property
    def head_mask(self) -> Path:
        return self.path / HEAD_MASK

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    # ------------------------------------------------------------------------------------------- what
    @property
    def is_run(self) -> bool:
        """A folder Hydra ran a verb in."""
        return (self.path / CONFIG).is_file()

    @property
    def finished(self) -> bool:
        return self.metrics_file.exists()

    def config(self) -> Optional[dict]:
        """The composed config, or None where it is missing or unreadable."""
        try:
            config = yaml.safe_load((self.path / CONFIG).read_text())
        except (OSError, yaml.YAMLError):
            return None
        return config if isinstance(config, dict) else None

    def overrides(self) -> List[str]:
        try:
            return yaml.safe_load((self.path / OVERRIDES).read_text()) or []
        except (OSError, yaml.YAMLError):
            return []

    def metrics(self) -> Optional[dict]:
        """metrics.json, or None for a run that did not finish (or whose file is unreadable)."""
        import json

        try:
            return json.loads(self.metrics_file.read_text())
        except (OSError, ValueError):
            return None

    def resume_command(self) -> str:
        """The command that ran it (its verb and overrides as Hydra recorded them), writing into it again: a train
        run resumes from its checkpoint_last.pt."""
        verb = (self.config() or {}).get("verb", "train")
        return " ".join(["hprune", verb, *map(shlex.quote, self.overrides()), shlex.quote(f"hydra.run.dir={self.path}")])

    # ------------------------------------------------------------------------------------------- translations
    def save_hypotheses(self, name: str, hypotheses: Iterable[str], references: Iterable[str]) -> None:
        write_atomic(self.path / HYPOTHESES / f"{name}.txt", "".join(h + "\n" for h in hypotheses))
        if not (self.path / REFERENCES).exists():
            write_atomic(self.path / REFERENCES, "".join(r + "\n" for r in references))

    def hypotheses(self, name: str) -> Optional[List[str]]:
        """The hypotheses saved under name, None when the run has none (older runs, or not written)."""
        path = self.path / HYPOTHESES / f"{name}.txt"
        return path.read_text().split("\n")[:-1] if path.exists() else None

    def references(self) -> Optional[List[str]]:
        path = self.path / REFERENCES
        return path.read_text().split("\n")[:-1] if path.exists() else None

    # ------------------------------------------------------------------------------------------- finding runs
    @classmethod
    def of(cls, path: Path) -> Optional["RunDir"]:
        """The run dir `path` is, or the one whose checkpoints/ holds it (a checkpoint file or that folder)."""
        path = Path(path)
        for candidate in (path, path.parent, path.parent.parent):
            if cls(candidate).is_run:
                return cls(candidate)
            if candidate.name != CHECKPOINTS and candidate != path:
                return None
        return None

    @classmethod
    def under(cls, root: Path) -> List["RunDir"]:
        """Every run dir under `root` (itself included), numbered job folders in numeric order; a number sorts
        before a name at the same depth (1, 2, ..., report)."""
        found = {config.parent.parent for config in Path(root).rglob(CONFIG)}
        return [cls(p) for p in sorted(found, key=lambda p: [(0, int(part), "") if part.isdigit() else (1, 0, part)
                                                             for part in p.parts])]


def save_hypotheses(run: Path, name: str, evaluation) -> None:
    """An evaluation's translations (its hypotheses and references) kept under `name` in the run dir."""
    RunDir(run).save_hypotheses(name, evaluation.hypotheses, evaluation.references)
