"""The registry of data kinds: a kind is one module of this package and one or more `configs/data/<name>.yaml` with
`kind: <name>`, nothing else.

A kind registers three functions and four optional ones (`register_kind` at the end of its module; its module's
docstring's first line describes it):

    key(data) -> str                       the prepared set's identity (its cache folder is <name>-<key>)
    check(data) -> None                    refuse bad settings before anything is written or downloaded
    build(data, data_root, staging) -> dict  fill staging with bin/ (a fairseq data-bin) and raw/<split>.<tgt>
                                           (the references), return the summary written to data.json
    bind(data, checkpoint, languages) -> data  complete the settings for one model (optional: as given)
    subwords(data, folder) -> [Path]       the files that turn text into the model's tokens, for a deployed
                                           model (optional: none)
    text_step(data) -> str | None          what a source line goes through before its subwords, as data/processing.py
                                           names the steps (`moses`, `normalize`, `moses_plain+lowercase`): a
                                           deployed model's README does the same (optional: the line as it is)
    beside_checkpoint(data, folder)        write beside a checkpoint derived from the model (a pruned one) what
                                           makes its folder the model's, so verbs given it need no data= (optional:
                                           nothing; pretrained's: dictionaries, codes, hprune.yaml)

`from_model`: the settings come from a model's folder (pretrained), so nothing can be bound without one. The
modules of this package are found on their own (KINDS, a registry.Registry, imports each once); a kind kept
outside hprune is imported from its yaml's `module:` (a module name on PYTHONPATH, or a .py file).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig

from ..registry import Registry, module_summary


@dataclass(frozen=True)
class DataKind:
    name: str
    key: Callable[[DictConfig], str]
    check: Callable[[DictConfig], None]
    build: Callable[[DictConfig, Path, Path], dict]
    bind: Optional[Callable[..., DictConfig]] = None
    from_model: bool = False
    subwords: Optional[Callable[[DictConfig, Path], list]] = None
    text_step: Optional[Callable[[DictConfig], Optional[str]]] = None
    beside_checkpoint: Optional[Callable[[DictConfig, Path], None]] = None

    def bound(self, data: DictConfig, checkpoint: Optional[Path] = None,
              languages: tuple[Optional[str], Optional[str]] = (None, None)) -> DictConfig:
        return data if self.bind is None else self.bind(data, checkpoint, languages)


KINDS: Registry[DataKind] = Registry("data kind", package=__package__,
                                     unknown="unknown data kind '{name}'; choose from {choices} (see configs/data/)")


def register_kind(kind: DataKind) -> DataKind:
    return KINDS.add(kind.name, kind, module_summary(kind.build))


def get_kind(data: DictConfig) -> DataKind:
    """The kind of a data config (`data.kind`); a kind of one's own is imported from `data.module`."""
    name = data.get("kind")
    if name not in KINDS and data.get("module"):
        KINDS.load_plugin(data.module, "data.module")
    return KINDS.lookup(name)
