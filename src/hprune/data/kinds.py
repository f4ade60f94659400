"""The registry of data kinds: a kind is one module of this package (named as the kind) and one or more
`configs/data/<name>.yaml` with `kind: <name>`, nothing else.

A kind registers three functions and four optional ones (`register_kind` at the end of its module):

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

`from_model`: the settings come from a model's folder (pretrained), so nothing can be bound without one. A kind
kept outside hprune is imported from its yaml's `module:` (a module name on PYTHONPATH).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

from omegaconf import DictConfig

from ..errors import UserError
from ..plugins import import_plugin


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


KINDS: Dict[str, DataKind] = {}


def register_kind(kind: DataKind) -> DataKind:
    if kind.name in KINDS and KINDS[kind.name] != kind:
        raise ValueError(f"data kind '{kind.name}' is registered twice")
    KINDS[kind.name] = kind
    return kind


def get_kind(data: DictConfig) -> DataKind:
    """The kind of a data config (`data.kind`), its module imported on first use."""
    name = data.get("kind")
    if name not in KINDS and data.get("module"):
        import_plugin(data.module, "data.module")
    elif name not in KINDS and isinstance(name, str) and name.isidentifier():
        module = f"{__package__}.{name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # the kind's module is there but needs something missing
                raise UserError(f"data kind '{name}' ({module}) cannot be imported: {err}") from None
    if name not in KINDS:
        for found in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
            importlib.import_module(f"{__package__}.{found.name}")  # to list every kind there is
        raise UserError(f"unknown data kind '{name}'; use one of {', '.join(sorted(KINDS))} (see configs/data/)")
    return KINDS[name]
