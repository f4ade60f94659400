"""Models handed to the runtimes people deploy with, built from hprune's models: one exporter registered per
format, each describing itself. An exporter checks the settings it needs before the model is opened (`check`),
then writes the model with the masked heads physically removed, verifies it against hprune's model under the
same mask before anything is kept, measures it, and returns its metrics (`export(evaluator, mask, out, cfg)`,
the evaluator an evaluation.Evaluator of the opened model). `hprune export format=NAME` only orchestrates
(api.Model.export, which runner/export.py and hprune.open's model call). A format is one module here (found on
its own: EXPORTERS, a registry.Registry, imports each once) and, where it has settings of its own,
`configs/export/<format>.yaml` (the config group `format=` selects: docs/development.md, "Extensions"); one kept
outside hprune is imported from `format_module=`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..registry import Registry, first_line


@dataclass(frozen=True)
class Exporter:
    name: str
    export: Callable  # (evaluator, mask, out, cfg) -> metrics
    check: Optional[Callable] = None  # (cfg) -> None: raises UserError before the model is opened
    summary: str = ""


EXPORTERS: Registry[Exporter] = Registry("export format", package=__name__,
                                         unknown="format={name} is not one of {choices}")


def register_exporter(name: str, check: Optional[Callable] = None) -> Callable:
    return EXPORTERS.register(name, lambda export: Exporter(name, export, check, first_line(export.__doc__)))


def get_exporter(name: str, module: Optional[str] = None) -> Exporter:
    """The exporter of format `name`: this package's modules (each registers its format), or `module`'s (a format
    kept outside hprune: `format_module=`)."""
    if module:
        EXPORTERS.load_plugin(module, "format_module")
    return EXPORTERS.lookup(name, "" if module else " (a format of your own: format_module=<its module or .py file>)")
