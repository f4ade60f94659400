"""Models handed to the runtimes people deploy with, built from hprune's models: one exporter registered per
format, each describing itself. An exporter checks the settings it needs before the model is opened (`check`),
then writes the model with the masked heads physically removed, verifies it against hprune's model under the
same mask before anything is kept, measures it, and returns its metrics (`export(session, mask, out, cfg)`).
`hprune export format=NAME` only orchestrates (runner/export.py). Adding a format touches its module, its
config keys (configs/export.yaml), a test and the docs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..errors import UserError


@dataclass(frozen=True)
class Exporter:
    name: str
    export: Callable  # (session, mask, out, cfg) -> metrics
    check: Optional[Callable] = None  # (cfg) -> None: raises UserError before the model is opened
    summary: str = ""


EXPORTERS: Dict[str, Exporter] = {}


def register_exporter(name: str, check: Optional[Callable] = None) -> Callable:
    def decorate(fn: Callable) -> Callable:
        EXPORTERS[name] = Exporter(name, fn, check, ((fn.__doc__ or "").strip().splitlines() or [""])[0])
        return fn
    return decorate


def get_exporter(name: str) -> Exporter:
    from . import ctranslate2, fairseq_checkpoint  # noqa: F401  (each registers its format)

    if name not in EXPORTERS:
        raise UserError(f"format={name} is not one of {', '.join(sorted(EXPORTERS))}")
    return EXPORTERS[name]
