"""The registry of pruning methods: one name, one module, one `configs/prune/<name>.yaml` each.

A method is either an *order* (`score(session, settings) -> DataFrame`: a score per head, higher = more
important; `hprune prune` prunes cumulatively in ascending order and draws the curve) or a *procedure* that
finds its mask its own way (`run(session, cfg, out) -> metrics dict`: Voita's gates and DSP train,
Kwon et al.'s search does not). Register it in any module of this package (found on its own); the name is the
one `prune.method`, `--method`, the report and the docs use:

    @register_method("michel")
    def michel(session, p): ...

    @register_method("voita", procedure=True, check=check_settings)
    def voita(session, cfg, out): ...
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..errors import UserError


@dataclass(frozen=True)
class Method:
    name: str
    score: Optional[Callable] = None  # orders: (session, prune settings) -> (type, layer, head, importance)
    run: Optional[Callable] = None  # procedures: (session, cfg, run dir) -> metrics
    check: Optional[Callable] = None  # (prune settings) -> None: raises UserError before any work is done
    needs_head_maps: bool = False  # per-head attention maps, which MoA experts do not have
    summary: str = ""

    @property
    def procedure(self) -> bool:
        return self.run is not None


METHODS: Dict[str, Method] = {}


def register_method(name: str, procedure: bool = False, check: Optional[Callable] = None,
                    needs_head_maps: bool = False) -> Callable:
    def decorate(fn: Callable) -> Callable:
        if name in METHODS:
            raise ValueError(f"pruning method '{name}' is registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        METHODS[name] = Method(name, score=None if procedure else fn, run=fn if procedure else None,
                               check=check, needs_head_maps=needs_head_maps, summary=summary)
        return fn
    return decorate


def _discover() -> None:
    """Import every module of this package once, so each registers its methods."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def method_names(procedure: Optional[bool] = None) -> List[str]:
    """Registered names (all, only the orders, or only the procedures), in registration order."""
    _discover()
    return [name for name, m in METHODS.items() if procedure is None or m.procedure == procedure]


def get_method(name: str) -> Method:
    _discover()
    if name not in METHODS:
        raise UserError(f"unknown pruning method '{name}'; choose from {', '.join(METHODS)}")
    return METHODS[name]
