"""Models handed to the runtimes people deploy with, built from hprune's models: one exporter registered per
format, each describing itself. An exporter checks the settings it needs before the model is opened (`check`),
then writes the model with the masked heads physically removed, verifies it against hprune's model under the
same mask before anything is kept, measures it, and returns its metrics (`export(evaluator, mask, out, cfg)`,
the evaluator an evaluation.Evaluator of the opened model). `hprune export format=NAME` only orchestrates
(runner/export.py). Adding a format touches its module, its config keys (configs/export.yaml), a test and the
docs.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..errors import UserError
from ..plugins import import_plugin


@dataclass(frozen=True)
class Exporter:
    name: str
    export: Callable  # (evaluator, mask, out, cfg) -> metrics
    check: Optional[Callable] = None  # (cfg) -> None: raises UserError before the model is opened
    summary: str = ""


EXPORTERS: Dict[str, Exporter] = {}


def register_exporter(name: str, check: Optional[Callable] = None) -> Callable:
    def decorate(fn: Callable) -> Callable:
        EXPORTERS[name] = Exporter(name, fn, check, ((fn.__doc__ or "").strip().splitlines() or [""])[0])
        return fn
    return decorate


def get_exporter(name: str, module: Optional[str] = None) -> Exporter:
    """The exporter of format `name`: this package's modules (each registers its format), or `module`'s (a format
    kept outside hprune: `format_module=`)."""
    if module:
        import_plugin(module, "format_module")
    for found in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{found.name}")
    if name not in EXPORTERS:
        raise UserError(f"format={name} is not one of {', '.join(sorted(EXPORTERS))}"
                        + ("" if module else " (a format of your own: format_module=<its module or .py file>)"))
    return EXPORTERS[name]
