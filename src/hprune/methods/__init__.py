"""The registry of pruning methods: a method is one module and one `configs/prune/<name>.yaml`, nothing else.

A method is either an *order* (`score(session, settings) -> DataFrame`: a score per head, higher = more
important; the order curve (methods/curve.py) prunes cumulatively in ascending order) or a *procedure* that
finds its mask its own way (`run(session, cfg, out) -> metrics dict`: Voita's gates and DSP train, Kwon et al.'s
search does not). A procedure that trains declares its control (`Control`: the same extra training without the
pressure to prune); the prune verb writes what the report needs to pair them into metrics.json.

Modules of this package are found on their own; a method kept elsewhere (your own repository) is imported
from its yaml's `module:` (a module name on PYTHONPATH, or a .py file), its yaml found through Hydra's
`hydra.searchpath=[file://<folder holding prune/<name>.yaml>]`. The name is the one `prune.method`,
`--method`, the report and the docs use:

    @register_method("michel")
    def michel(session, p): ...

    @register_method("voita", procedure=True, check=check_settings, control=Control(...))
    def voita(session, cfg, out): ...
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError


@dataclass(frozen=True)
class Control:
    """The run a trained method's runs are measured against: the same extra training without the pressure to
    prune. `is_control(prune settings, metrics)` says whether a run is it; `shares` are the (dotted) config keys
    a run and its control have in common."""
    label: str
    is_control: Callable[[DictConfig, dict], bool]
    shares: tuple = ("ckpt", "seed", "split", "prune.method", "prune.types", "prune.optim")

    def fields(self, cfg: DictConfig, metrics: dict) -> dict:
        """What metrics.json records so that `hprune report` pairs the run with its control."""
        shared = {key: OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
                  for key in self.shares for value in [OmegaConf.select(cfg, key)]}
        key = hashlib.sha1(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:10]
        return {"control_key": key, "is_control": bool(self.is_control(cfg.prune, metrics)), "control_label": self.label}


@dataclass(frozen=True)
class Method:
    name: str
    score: Optional[Callable] = None  # orders: (session, prune settings) -> (type, layer, head, importance)
    run: Optional[Callable] = None  # procedures: (session, cfg, run dir) -> metrics
    check: Optional[Callable] = None  # (prune settings) -> None: raises UserError before any work is done
    needs_head_maps: bool = False  # per-head attention maps, which MoA experts do not have
    control: Optional[Control] = None  # procedures that train: their control
    summary: str = field(default="")

    @property
    def procedure(self) -> bool:
        return self.run is not None

    def validate(self, p: DictConfig) -> None:
        """Refuse bad settings before any work: the procedure's own check, or the order curve's."""
        if self.procedure:
            if self.check is not None:
                self.check(p)
        else:
            from .curve import check_settings

            check_settings(p, method_names(procedure=False))

    def prune(self, session, cfg: DictConfig, out: Path) -> dict:
        """The method's run on an opened model, writing into `out`; its metrics (with what pairs it with its
        control, for a method that has one)."""
        from . import curve

        metrics = self.run(session, cfg, out) if self.procedure else curve.run(session, cfg, out)
        if self.control is not None:
            metrics.update(self.control.fields(cfg, metrics))
        return metrics


METHODS: Dict[str, Method] = {}


def register_method(name: str, procedure: bool = False, check: Optional[Callable] = None,
                    needs_head_maps: bool = False, control: Optional[Control] = None) -> Callable:
    def decorate(fn: Callable) -> Callable:
        if name in METHODS and METHODS[name].score is not fn and METHODS[name].run is not fn:
            raise ValueError(f"pruning method '{name}' is registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        METHODS[name] = Method(name, score=None if procedure else fn, run=fn if procedure else None,
                               check=check, needs_head_maps=needs_head_maps, control=control, summary=summary)
        return fn
    return decorate


def _discover() -> None:
    """Import every module of this package once, so each registers its methods."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "curve":
            importlib.import_module(f"{__name__}.{module.name}")


def import_module(module: Optional[str]) -> None:
    """Import a method kept outside this package (a yaml's `module:`): a module name, or a path to a .py file."""
    if not module:
        return
    path = Path(str(module)).expanduser()
    try:
        if path.suffix == ".py":
            if not path.is_file():
                raise UserError(f"prune.module={module}: no such file; give a .py file or a module on PYTHONPATH")
            name = f"hprune_method_{path.stem}"
            if name not in sys.modules:
                spec = importlib.util.spec_from_file_location(name, path)
                sys.modules[name] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(sys.modules[name])
        else:
            importlib.import_module(str(module))
    except ModuleNotFoundError as err:
        raise UserError(f"prune.module={module}: {err}; put its folder on PYTHONPATH or give the .py file's path") from None


def method_names(procedure: Optional[bool] = None) -> List[str]:
    """Registered names (all, only the orders, or only the procedures), in registration order."""
    _discover()
    return [name for name, m in METHODS.items() if procedure is None or m.procedure == procedure]


def get_method(name: str, module: Optional[str] = None) -> Method:
    _discover()
    import_module(module)
    if name not in METHODS:
        raise UserError(f"unknown pruning method '{name}'; choose from {', '.join(METHODS)}")
    return METHODS[name]
