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

import contextlib
import contextvars
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

import yaml

from .files import git_sha, write_atomic, write_json

CONFIG, OVERRIDES, METRICS = ".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.json"
CHECKPOINTS, HEAD_MASK, HYPOTHESES, REFERENCES = "checkpoints", "head_mask.json", "hypotheses", "references.txt"
BEST, LAST, PRUNED, AVERAGED = "checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_pruned.pt", "checkpoint_averaged.pt"
_WRITING_TO: contextvars.ContextVar[Optional[Path]] = contextvars.ContextVar("run_dir", default=None)


def run_dir() -> Path:
    """The folder the running verb writes into: Hydra's run dir, or the one the library named (writing_to)."""
    named = _WRITING_TO.get()
    if named is not None:
        return named
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


@contextlib.contextmanager
def writing_to(folder: Path) -> Iterator[Path]:
    """A verb's work called from Python (hprune.open's model) writes into `folder` (created) meanwhile."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    token = _WRITING_TO.set(folder)
    try:
        yield folder
    finally:
        _WRITING_TO.reset(token)


def provenance(cfg) -> dict:
    """The metrics.json keys every measuring verb shares (a session adds the model's: checkpoint, data_bin, ...)."""
    keys = {"verb": cfg.verb, "git_sha": git_sha()}
    for key in ("seed", "precision"):
        if key in cfg:
            keys[key] = cfg[key]
    if cfg.get("data") is not None:
        keys["data"] = cfg.data.name
    return keys


def model_provenance(session) -> dict:
    """The keys of metrics.json that say which model, data and device a verb measured (an opened model:
    hprune.session.Session)."""
    return {"checkpoint": str(session.checkpoint.absolute()), "data_bin": str(session.data_bin),
            "device": session.device, "n_params": session.n_params(), "imported_from": session.imported_from}


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

    def record(self, cfg, overrides: List[str], result: dict) -> dict:
        """What a run from Python leaves as Hydra and the CLI's wrapper leave it (the composed config, the
        overrides, metrics.json last), so that `hprune report` reads it as any run; the metrics written."""
        from omegaconf import OmegaConf

        write_atomic(self.path / CONFIG, OmegaConf.to_yaml(cfg))
        write_atomic(self.path / OVERRIDES, yaml.safe_dump(list(overrides)))
        metrics = {**provenance(cfg), **result}
        write_json(self.metrics_file, metrics)
        return metrics

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
