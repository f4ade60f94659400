"""hprune as a library: the verbs' work on an opened model, for notebooks and scripts (docs/api.md).

    import hprune
    model = hprune.open("outputs/demo")                    # any checkpoint the CLI's ckpt= takes
    unpruned = model.evaluate()                             # BLEU, chrF, hypotheses: `hprune eval`
    scores = model.scores("michel")                         # a registered order's score per head
    mask = scores.mask(pct=50)                              # its least important half removed
    model.evaluate(mask).bleu                               # `hprune eval mask=...`
    mask.save("half.json")                                  # the head_mask.json the CLI reads
    run = model.prune("fisher", "runs/fisher", macs_budget=0.5)   # `hprune prune --method fisher`
    model.analyze("runs/roles", mask=run.folder / "head_mask.json")   # `hprune analyze`: which roles survived
    model.export("runs/ct2", mask=run.mask)                 # `hprune export`
    model.recover("runs/kd", mask=run.folder, **{"recovery.updates": 400})   # `hprune recover`: distilled back

Settings are the CLI's: keyword arguments are its overrides (`device="cpu"`, `**{"generation.beam": 4}`),
composed by Hydra into each verb's config as `hprune <verb>` composes them. Those given to `open` apply to every
verb whose config has them; those given to a call, to that call ("prune." is implied for a method's own keys).
The CLI's verbs open their model through `Model.from_config` and call the same methods.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from .errors import UserError
from .pruning.heads import HeadMask, Mask, check_layout, extend_pruned, heads_to_prune, michel_id, ranked
from .rundir import RunDir, model_provenance, writing_to

CONFIGS = "hprune_configs"
CONFIG_DIR = Path(importlib.util.find_spec(CONFIGS).origin).parent


def open(ckpt: str | Path, **settings) -> "Model":  # noqa: A001  (hprune.open, as the CLI's door is named)
    """The model `ckpt` names (a train run dir, a checkpoint file, an imported model's folder, a Hub id, a
    published name), opened on its data with `settings` (the CLI's overrides)."""
    from .checkpoint_ref import identify

    if "mask" in settings:
        raise UserError("a mask is given to each call (model.evaluate(mask), analyze(out, mask), export(out, mask)), "
                        "not to hprune.open")
    settings = dict(settings)
    tensorboard = bool(settings.pop("tensorboard", False))
    overrides = {"ckpt": str(ckpt), **settings}
    if "data" not in settings and identify(ckpt).brings_its_data:  # as the CLI: a model with its own vocabulary
        overrides["data"] = "pretrained"
    cfg = compose("eval", overrides)
    with open_dict(cfg):  # (fairseq's TensorBoard logs of the trainings a method runs: eval's config lacks the key)
        cfg.tensorboard = tensorboard
    return Model.from_config(cfg, overrides)


# ------------------------------------------------------------------------------------------ configs
def compose(verb: str, settings: dict) -> DictConfig:
    """The verb's config composed with `settings` as `hprune <verb> key=value ...` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [f"{key}={hydra_value(value)}" for key, value in settings.items()]
    try:
        with _own_hydra(), initialize_config_module(CONFIGS, version_base="1.3"):
            return hydra_compose(verb, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(f"hprune {verb}: {str(err).strip().splitlines()[0]}") from None


@functools.lru_cache(maxsize=None)
def verb_keys(verb: str) -> frozenset:
    """The top-level keys of the verb's config as its files compose it (composed once a process)."""
    return frozenset(compose(verb, {"ckpt": "-"}).keys())


@contextlib.contextmanager
def _own_hydra() -> Iterator[None]:
    """Hydra holds one global state; a Hydra app already running (a script's @hydra.main) gets its own back."""
    from hydra.core.global_hydra import GlobalHydra

    running = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        if running is not None:
            GlobalHydra.instance().initialize(running)


def hydra_value(value) -> str:
    """A Python value in Hydra's override grammar (a string quoted where Hydra would read it otherwise)."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # a numpy or torch scalar
        value = value.item()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[A-Za-z_/.][A-Za-z0-9_./@+-]*", text) and not _reads_as_other(text):
        return text  # as a user would type it (read back as the same string)
    return "'" + text.replace("'", "\\'") + "'"  # (Hydra keeps a backslash as it is, but before a quote)


def _reads_as_other(text: str) -> bool:
    """Whether Hydra reads `text` unquoted as something else than the string: a number, a bool, null."""
    try:
        float(text)
        return True
    except ValueError:
        return text.lower() in ("true", "false", "null", "nan", "inf")


# ------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Translation:
    """A split translated by beam search under a mask, scored by sacreBLEU against its raw references; with
    costs=True, the parameters and counted MACs per target token (and an MoA model's expert load)."""
    split: str
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    sentences: int
    tokens: int
    seconds: float
    hypotheses: list = field(repr=False)
    references: list = field(repr=False)
    costs: dict = field(default_factory=dict, repr=False)
    expert_load: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False)

    @property
    def sentences_per_s(self) -> float:
        return round(self.sentences / self.seconds, 2)

    @property
    def tokens_per_s(self) -> float:
        return round(self.tokens / self.seconds, 1)


@dataclass(frozen=True)
class HeadScores:
    """An order's score of every head (higher: more important), least important first, as `hprune prune` writes
    head_importance.csv; `mask` removes the least important as the order's curve does."""
    order: str
    table: pd.DataFrame
    full: HeadMask = field(repr=False)
    min_heads_per_layer: int = 0
    layout: str = "free"

    def mask(self, prune: Optional[int] = None, pct: Optional[float] = None) -> HeadMask:
        """The `prune` (or `pct` % of the scored) least important heads removed, never a layer below
        min_heads_per_layer heads (the order's settings)."""
        if (prune is None) == (pct is None):
            raise UserError("say how many heads go: mask(prune=N) or mask(pct=P)")
        pool = set(self.table[["type", "layer", "head"]].itertuples(index=False, name=None))
        n = prune if prune is not None else heads_to_prune(len(pool), pct)
        return self.full.without(*extend_pruned(self.table, set(), n, pool, self.min_heads_per_layer, self.layout))


@dataclass(frozen=True)
class Pruned:
    """A method's run (`hprune prune`): its metrics (as metrics.json holds them), the mask it chose, its folder."""
    method: str
    folder: Path
    metrics: dict = field(repr=False)
    mask: Optional[HeadMask]


# ------------------------------------------------------------------------------------------ the model
class Model:
    """An opened model (hprune.session.Session) with the verbs' work as methods."""

    def __init__(self, session, cfg: DictConfig, settings: dict):
        self.session, self.cfg, self.settings = session, cfg, settings

    @classmethod
    def from_config(cls, cfg: DictConfig, settings: Optional[dict] = None) -> "Model":
        """The model a verb's composed config names (the CLI's door)."""
        from .session import Session  # imports fairseq, which fills Hydra's config store: only once composed

        return cls(Session.open(cfg), cfg, dict(settings or {}))

    def __repr__(self) -> str:
        return f"Model({self.session.checkpoint}, {self.session.n_params():,} parameters, data {self.session.data.name})"

    @property
    def module(self):
        """The torch module (hprune_fairseq's transformer: heads masked, removed, and read through it)."""
        return self.session.model

    def config(self, verb: str, **settings) -> DictConfig:
        """The verb's config with this model's settings (those the verb's config has) and `settings`."""
        return compose(verb, self._settings(verb, settings))

    def _settings(self, verb: str, settings: dict) -> dict:
        opening = sorted(k for k in settings if k.split(".")[0] in OPENING)
        if opening:
            raise UserError(f"{', '.join(opening)} open the model: give them to hprune.open (the model is opened "
                            "once, on its data and device), and open it again to change them")
        fitting = {k: v for k, v in self.settings.items()
                   if (k.split(".")[0] in verb_keys(verb) or k in GROUPS) and k.split(".")[0] not in PER_CALL}
        return {"ckpt": str(self.session.checkpoint), **fitting, **settings}

    def _run(self, verb: str, out: str | Path, settings: dict, cfg: Optional[DictConfig], work) -> dict:
        """A verb's work into the folder `out`: with the CLI's config as given (the CLI's wrapper records the run),
        or composed from this model's and the call's settings, the run recorded as the CLI records it (its config
        and overrides in .hydra/, metrics.json last: `hprune report` reads it as any run) and the model put back
        as it was (_unchanged)."""
        library = cfg is None
        if library:
            settings = self._settings(verb, settings)
            cfg = compose(verb, settings)
        with writing_to(Path(out)) as folder, self._unchanged(library):
            metrics = work(cfg, folder)
        if library:
            overrides = [f"{key}={hydra_value(value)}" for key, value in settings.items()]
            metrics = RunDir(folder).record(cfg, overrides, metrics)
        return metrics

    # -------------------------------------------------------------------------------------- masks
    def mask(self, path: Optional[str | Path] = None, soft: bool = False) -> HeadMask:
        """Every head kept, or the head_mask.json at `path` (checked against this model)."""
        return HeadMask.read(path, self.module, soft) if path else HeadMask.full(self.module)

    # -------------------------------------------------------------------------------------- eval
    def evaluate(self, mask: Optional[Mask] = None, split: Optional[str] = None, costs: bool = False,
                 cfg: Optional[DictConfig] = None) -> Translation:
        """Beam search on `split` (default: the config's) under `mask` (None: no mask at all), as `hprune eval`."""
        from .evaluation import Evaluator

        evaluator = Evaluator.of(self.session, cfg or self.cfg)
        split = split or evaluator.measure.split
        with self.session.masked(mask):
            result, quality = evaluator.translate(split)
            measured, load = evaluator.costs(split) if costs else ({}, pd.DataFrame())
        return Translation(split, quality.bleu, quality.chrf, quality.bleu_signature, quality.chrf_signature,
                           result.sentences, result.tokens, result.seconds, result.hypotheses,
                           evaluator.references(split, result.sentences), measured, load)

    # -------------------------------------------------------------------------------------- prune
    def scores(self, order: str = "michel", mask: Optional[Mask] = None, **settings) -> HeadScores:
        """A registered order's head scores (methods/: michel, confidence, lrp, magnitude, random, ... or your
        own) of the heads of `prune.types`, computed under `mask` (which conditions the scores only), with the
        order's settings (`prune.<key>` of its yaml), checked as `hprune prune` checks them."""
        from .methods import get_method
        from .methods.curve import check_pool, head_scores
        from .pruning.heads import pool_of

        cfg = self.config("prune", **{"prune": order, **self._prune_settings(settings)})
        if get_method(order, cfg.prune.get("module")).procedure:
            raise UserError(f"{order} is a procedure, not an order: run it with .prune('{order}', folder)")
        checked_method(cfg)
        pool = pool_of(self.module, cfg.prune.types)
        check_pool(self.module, cfg.prune, [order], [0], pool)
        scores = head_scores(self.session, cfg, order, mask)
        table = ranked(scores[[h in pool for h in scores[["type", "layer", "head"]].itertuples(index=False, name=None)]])
        table.insert(3, "id", [michel_id(h) for h in table[["type", "layer", "head"]].itertuples(index=False, name=None)])
        return HeadScores(order, table, HeadMask.full(self.module), cfg.prune.get("min_heads_per_layer", 0),
                          cfg.prune.layout)

    def prune(self, method: str, out: str | Path, cfg: Optional[DictConfig] = None, **settings) -> Pruned:
        """A method's whole run into the folder `out`, as `hprune prune --method METHOD` (its curve, or its
        procedure; the latency in CTranslate2 with latency.measure=true)."""
        def work(cfg: DictConfig, folder: Path) -> dict:
            from . import recovery

            found, p = checked_method(cfg), cfg.prune
            if cfg.get("recovery") is not None:
                recovery.check(cfg.recovery)
            if recovery.wanted(cfg):  # recovery trains the physically pruned checkpoint the method writes
                with open_dict(cfg):
                    p.export = True
            metrics = found.prune(self.session, cfg, folder)
            if (cfg.latency.measure or p.get("latency_budget") is not None) and RunDir(folder).head_mask.exists():
                self._add_latency(cfg, metrics, self.session.read_mask(RunDir(folder).head_mask))
            if recovery.wanted(cfg):
                metrics.update(self._recovered(cfg, folder))
            return metrics

        metrics = self._run("prune", out, {"prune": method, **self._prune_settings(settings)}, cfg, work)
        mask_file = RunDir(Path(out)).head_mask
        return Pruned(method, Path(out), metrics, HeadMask.read(mask_file, self.module) if mask_file.exists() else None)

    def _recovered(self, cfg: DictConfig, folder: Path) -> dict:
        """The recovery stage of a method's run: its pruned checkpoint trained on (recovery.py), the teacher the
        unpruned model as its checkpoint holds it (the method may have changed this session's in place)."""
        from . import recovery
        from .evaluation import Evaluator
        from .rundir import PRUNED

        start = RunDir(folder).checkpoint(PRUNED)
        if not start.exists():
            raise UserError(f"prune.method={cfg.prune.method} wrote no pruned checkpoint ({start}) to recover from")
        with self.session.parked(folder):
            found = recovery.recover(Evaluator.of(self.session.reopen(self.session.checkpoint), cfg), cfg, start,
                                     folder)
        print(recovery.summary(found))
        return found

    def recover(self, out: str | Path, mask: str | Path, cfg: Optional[DictConfig] = None, **settings) -> dict:
        """The model pruned by `mask` (a `hprune prune` run folder, whose pruned checkpoint is the start when it
        wrote one, or a head_mask.json) trained on for recovery.updates updates with recovery.loss, this model
        its teacher, into the folder `out` (`hprune recover`); returns its metrics."""
        from . import recovery
        from .evaluation import Evaluator
        from .pruning.heads import kept_columns

        def work(cfg: DictConfig, folder: Path) -> dict:
            recovery.check(cfg.recovery)
            if cfg.recovery.updates < 1:
                raise UserError("recovery.updates=0 trains nothing; pass recovery.updates=N (Adam updates)")
            start, mask_file, written = recovery.start_of(self.session, Path(cfg.mask), folder)
            found = {"mask": str(mask_file.resolve()), "recovery_start": str(start.resolve()),
                     "recovery_start_written": written,
                     **kept_columns(self.session.read_mask(mask_file)), **model_provenance(self.session),
                     **recovery.recover(Evaluator.of(self.session, cfg), cfg, start, folder)}
            print(recovery.summary(found))
            return found

        return self._run("recover", out, {**settings, "mask": str(mask)}, cfg, work)

    def _prune_settings(self, settings: dict) -> dict:
        top = verb_keys("prune") | {"hydra"} | OPENING
        return {k if k.split(".")[0] in top else f"prune.{k}": v for k, v in settings.items()}

    def _add_latency(self, cfg: DictConfig, metrics: dict, mask: Mask) -> None:
        if "latency_pct_measured" not in metrics:  # (a latency budget's search measured its own mask)
            metrics.update(latency_of(self.session, cfg, mask))
        if "macs_per_token_pruned" not in metrics:  # (an export counted them): the frontier's MACs panel
            metrics.update(model_macs_of(self.session, cfg, mask))
        metrics["latency_settings"] = {k: v for k, v in OmegaConf.to_container(cfg.latency).items() if k != "measure"}
        if "latency_pct_predicted" in metrics:  # how far a latency table's prediction held
            metrics["latency_prediction_ratio"] = round(metrics["latency_pct_predicted"]
                                                        / metrics["latency_pct_measured"], 4)

    # -------------------------------------------------------------------------------------- analyze
    def analyze(self, out: str | Path, mask: Optional[str | Path] = None, cfg: Optional[DictConfig] = None,
                **settings) -> dict:
        """What each head does (`hprune analyze`): roles, alignment heads, confidence and LRP per head, written into
        the folder `out` (head_roles.csv, summary.txt, `dump=N` sentences' attention maps), with `mask` (a
        head_mask.json) which roles survived it; returns the summary's figures."""
        from .head_analysis import analyze

        if mask is not None:
            settings["mask"] = str(mask)
        return self._run("analyze", out, settings, cfg, lambda cfg, folder: analyze(self.session, cfg, folder))

    # -------------------------------------------------------------------------------------- export
    def export(self, out: str | Path, mask: Optional[Mask] = None, cfg: Optional[DictConfig] = None,
               **settings) -> dict:
        """The model with the heads `mask` removes taken out, written in a runtime's format into the folder `out`,
        checked and measured there (`hprune export`; format="ctranslate2" or "fairseq")."""
        from .evaluation import Evaluator
        from .pruning.heads import kept_columns

        def work(cfg: DictConfig, folder: Path) -> dict:
            exporter = checked_exporter(cfg)
            kept = self.session.fold_mechanisms(mask) or self.session.unpruned_mask()
            metrics = {"format": cfg.format, "mask": cfg.get("mask"), **kept_columns(kept),
                       **model_provenance(self.session)}
            metrics.update(exporter.export(Evaluator.of(self.session, cfg), kept, folder, cfg))
            return metrics

        if "format" in settings and "export" not in settings and (CONFIG_DIR / "export" / f"{settings['format']}.yaml").is_file():
            settings["export"] = settings.pop("format")  # the format with its own settings, as the CLI chooses it
        if mask is not None and cfg is None:  # recorded as the CLI records mask=FILE
            settings["mask"] = str(HeadMask(mask).save(Path(out) / "export_mask.json"))
        return self._run("export", out, settings, cfg, work)

    @contextlib.contextmanager
    def _unchanged(self, keep: bool) -> Iterator[None]:
        """The model as it was after a method or an export changed it in place (Kwon et al.'s tuning scales its
        heads, a gated model's gates are folded, a curve fine-tunes): the next call from Python starts from the
        same model. (A verb's process ends after it: the CLI spares the copy.)"""
        if not keep:
            yield
            return
        state, mask = self.session.state(), self.session.mask
        try:
            yield
        finally:
            if set(self.session.model.state_dict()) == set(state):
                self.session.load_state(state)
                self.session.set_mask(mask)
            else:  # folded (a gated model's gates are gone): the checkpoint opened again
                self.session = self.session.reopen(self.session.checkpoint)
                self.session.set_mask(mask)


def checked_method(cfg: DictConfig):
    """The method a prune config names, its settings checked before any work."""
    from .methods import get_method

    p = cfg.prune
    method = get_method(p.method, p.get("module"))
    method.validate(p)
    check_layout(p.layout, p.types)
    if cfg.latency.measure and importlib.util.find_spec("ctranslate2") is None:
        raise UserError("latency.measure=true needs the ctranslate2 package (latency is measured in it): pip install "
                        "'hprune[deploy]'")
    return method


def checked_exporter(cfg: DictConfig):
    """The exporter an export config names, its settings checked before any work."""
    from .deploy import get_exporter

    exporter = get_exporter(cfg.format, cfg.get("format_module"))
    if exporter.check is not None:
        exporter.check(cfg)
    return exporter


GROUPS = {"data", "generation", "paths", "measure", "prune", "model", "optim", "experiment", "distributed"}
OPENING = {"ckpt", "data", "paths", "device", "precision", "tensorboard"}  # what the session was opened with
PER_CALL = {"mask"}  # a call's own (evaluate(mask), export(out, mask), analyze(out, mask)), never carried over


def model_macs_of(session, cfg: DictConfig, mask: Mask) -> dict:
    """The whole model's MACs per target token under `mask`, counted on its physically pruned copy over the loss
    split, against the model's own (as an export counts them)."""
    from .evaluation import Evaluator
    from .flops import pruned_macs

    lengths = Evaluator.of(session, cfg).lengths()
    with session.masked(None):
        return pruned_macs(session.model, session.pruned_copy(mask), lengths)


def latency_of(session, cfg: DictConfig, mask: Mask) -> dict:
    """The pruned model's latency in CTranslate2 against the unpruned model's (deploy/latency.py), as metrics."""
    from .deploy.latency import LatencySettings, latency_metrics, seconds_per_sentence

    settings = LatencySettings(**cfg.latency)
    seconds = seconds_per_sentence(session, mask, settings)
    metrics = latency_metrics(seconds["pruned"] / seconds["unpruned"], seconds["ratios"])
    print(f"latency in CTranslate2 ({settings.compute_type}, {settings.threads} thread(s), beam {settings.beam}): "
          f"{metrics['latency_pct_measured']:g} % of the unpruned model's ({1 / seconds['pruned']:.1f} against "
          f"{1 / seconds['unpruned']:.1f} sentences/s)")
    return metrics
