"""The registry of pruning methods: a method is one module and one `configs/prune/<name>.yaml`, nothing else.

A method is either an *order* (`score(session, cfg) -> DataFrame`: a score per head, higher = more important;
the order curve (methods/curve.py) prunes cumulatively in ascending order) or a *procedure* that finds its mask
its own way (`run(session, cfg, out) -> metrics dict`: Voita's gates and DSP train, Kwon et al.'s search does
not). Every method gets the verb's config (`cfg`; its own settings are `cfg.prune`) and reads nothing else.
A method declares:
  * its settings as a dataclass (`settings`): the composed `prune` settings are checked against it before any
    work (types, unknown and missing keys: one line), its `check` then refuses values that cannot work;
  * for a procedure that trains, its control (`Control`: the same extra training without the pressure to
    prune), which `hprune report` pairs it with;
  * what the report shows for it (`Report`: the settings its runs are swept over, its own columns, the per-head
    tables it draws, its name in titles), written into each run's metrics.json, which is all the report reads;
  * a mechanism it trains inside the model (gates, a selector) is the plugin's (hprune_fairseq/mechanisms/),
    registered with its own flags and fold: export, loading and CTranslate2 ask the model, not the method.

Modules of this package are found on their own (METHODS, a registry.Registry, imports each once); a method
kept elsewhere (your own repository) is imported from its yaml's `module:` (a module name on PYTHONPATH, or a
.py file), its yaml found through Hydra's `hydra.searchpath=[file://<folder holding prune/<name>.yaml>]`, and
shared with the training workers fairseq starts (a mechanism of its own registers there too). The name is the
one `prune.method`, `--method`, the report and the docs use:

    @register_method("michel", settings=CurveSettings)
    def michel(session, cfg): ...

    @register_method("voita", procedure=True, settings=VoitaSettings, check=check_settings,
                     control=Control(...), report=Report(...))
    def voita(session, cfg, out): ...
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from omegaconf import MISSING, DictConfig, OmegaConf

from ..errors import UserError
from ..registry import Registry, first_line, share_with_workers


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
class Report:
    """What `hprune report` shows for a method's runs, declared by the method and written into each run's
    metrics.json (`report_*` keys), so that the report names no method: `knobs`, the settings its runs are swept
    over (metrics keys, in order; the first is plotted against BLEU and heads kept where it varies); `columns`,
    its own result columns in the tables of trained methods and runs; `sweep_columns`, those a sweep's table
    shows; `heatmaps`, per-head tables it writes ((file, column, title) each: drawn per run); `title`, its name
    in figure titles."""
    knobs: Tuple[str, ...] = ()
    columns: Tuple[str, ...] = ()
    sweep_columns: Tuple[str, ...] = ()
    heatmaps: Tuple[Tuple[str, str, str], ...] = ()
    title: str = ""

    def fields(self) -> dict:
        return {"report_knobs": list(self.knobs), "report_columns": list(self.columns),
                "report_sweep_columns": list(self.sweep_columns),
                "report_heatmaps": [list(h) for h in self.heatmaps], "report_title": self.title}


@dataclass(frozen=True)
class Method:
    name: str
    score: Optional[Callable] = None  # orders: (session, cfg) -> (type, layer, head, importance)
    run: Optional[Callable] = None  # procedures: (session, cfg, run dir) -> metrics
    settings: Optional[type] = None  # the dataclass its `prune` settings are checked against
    check: Optional[Callable] = None  # (prune settings) -> None: raises UserError before any work is done
    needs_head_maps: bool = False  # per-head attention maps, which MoA experts do not have
    control: Optional[Control] = None  # procedures that train: their control
    report: Report = field(default_factory=Report)
    summary: str = field(default="")

    @property
    def procedure(self) -> bool:
        return self.run is not None

    def validate(self, p: DictConfig) -> None:
        """Refuse bad settings before any work: against the settings dataclass, then the procedure's own check,
        or the order curve's."""
        if self.settings is not None:
            check_settings_types(p, self.settings)
        if self.procedure:
            if self.check is not None:
                self.check(p)
        else:
            from .curve import check_settings

            check_settings(p, method_names(procedure=False))

    def prune(self, session, cfg: DictConfig, out: Path) -> dict:
        """The method's run on an opened model, writing into `out`; its metrics (with what pairs it with its
        control, for a method that has one, and what the report shows for it)."""
        from . import curve

        metrics = self.run(session, cfg, out) if self.procedure else curve.run(session, cfg, out)
        if self.control is not None:
            metrics.update(self.control.fields(cfg, metrics))
        metrics.update(self.report.fields())
        return metrics


def check_settings_types(p: DictConfig, settings: type) -> None:
    """`p` against the settings dataclass (OmegaConf's structured merge: types, unknown keys, mandatory values),
    in one line naming the setting."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.merge(OmegaConf.structured(settings), OmegaConf.to_container(p, resolve=True))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        reason = str(err).strip().splitlines()[0]
        raise UserError(f"prune.{key}: {reason} (configs/prune/{p.method}.yaml lists the settings)" if key
                        else f"prune settings of {p.method}: {reason}") from None


@dataclass
class MethodSettings:
    """What every method's settings hold (configs/prune.yaml and the method's yaml)."""
    method: str = MISSING
    types: List[str] = field(default_factory=lambda: ["enc-self", "dec-self", "dec-enc"])
    layout: str = "free"
    module: Optional[str] = None  # a method kept outside hprune: its module


METHODS: Registry[Method] = Registry("pruning method", package=__name__)


def register_method(name: str, procedure: bool = False, settings: Optional[type] = None,
                    check: Optional[Callable] = None, needs_head_maps: bool = False,
                    control: Optional[Control] = None, report: Optional[Report] = None) -> Callable:
    def method(fn: Callable) -> Method:
        return Method(name, score=None if procedure else fn, run=fn if procedure else None, settings=settings,
                      check=check, needs_head_maps=needs_head_maps, control=control, report=report or Report(),
                      summary=first_line(fn.__doc__))
    return METHODS.register(name, method)


def method_names(procedure: Optional[bool] = None) -> List[str]:
    """Registered names (all, only the orders, or only the procedures), in registration order."""
    return [name for name, m in METHODS.items() if procedure is None or m.procedure == procedure]


def get_method(name: str, module: Optional[str] = None) -> Method:
    """The method `name`; `module`: the plugin that registers it (a yaml's `module:`), which fairseq's training
    workers import too, since a mechanism it registers is theirs."""
    if module:
        share_with_workers(METHODS.load_plugin(module, "prune.module"))
    return METHODS.lookup(name)
