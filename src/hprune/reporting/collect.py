"""Find hprune runs under some folders and read them into pandas: one row per finished run.

A run dir is any folder with `.hydra/config.yaml` (a single run or one job of a multirun sweep). It is finished
when its `metrics.json` is there (the verbs write it last, atomically); otherwise it is listed as incomplete
(failed, killed or still running), never dropped silently. Each row holds the run's path, its verb, its
command-line overrides, the settings that decide whether two BLEU scores can be compared, the recipe and seed
of the model it used (runs that differ by seed only are aggregated over), and every scalar of metrics.json (a
trained method's run records there the key it shares with its control: methods/__init__.py, Control).
Prune runs with a curve (curve.csv) also give one row per curve point.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from ..errors import UserError
from ..rundir import RunDir

# config keys that must agree for two runs' BLEU scores to be comparable
SCORING_KEYS = ("data.name", "data.src_lang", "data.tgt_lang", "split", "generation.beam", "generation.lenpen")
SKIPPED_VERBS = ("report", "data")  # they write no results of their own
# what a train run's seed does not change: runs of checkpoints with the same recipe differ by the seed only
RECIPE_KEYS = ("data", "model", "optim", "average_last", "head_mask")
# what does not make two runs different settings: runs whose configs differ only here (and in the seed of the
# model's training, its recipe being the same) are the same setting's seeds
NOT_A_SETTING = ("seed", "ckpt", "paths", "verbose", "tensorboard", "device")


@dataclass
class Collection:
    runs: pd.DataFrame                  # one row per finished run
    curves: pd.DataFrame                # one row per point of a pruning curve (prune runs' curve.csv)
    incomplete: list = field(default_factory=list)  # (run dir, why)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def run_dirs(roots: list[Path]) -> list[Path]:
    found: dict = {}
    for root in roots:
        if not root.is_dir():
            raise UserError(f"{root} is not a folder; pass the folder(s) holding hprune run dirs, e.g. "
                            "`hprune report outputs/`")
        found.update(dict.fromkeys(run.path for run in RunDir.under(root)))
    return sorted(found, key=lambda p: [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in p.parts])


def _label(run: Path, roots: list[Path]) -> str:
    for root in roots:
        if run == root or root in run.parents:
            return str(run.relative_to(root.parent)) if run != root else run.name
    return str(run)


def read_overrides(run: Path) -> list[str]:
    """The command-line overrides Hydra recorded for a run (or a sweep job)."""
    return RunDir(run).overrides()


def _digest(tree) -> str:
    return hashlib.sha1(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:10]


def trained_by(checkpoint) -> tuple[str, Optional[int]]:
    """(recipe, seed) of the `hprune train` run a checkpoint comes from (<run>/checkpoints/<file>.pt): the digest
    of its settings without the seed, and its seed; for any other checkpoint (published, imported), its path and
    no seed."""
    path = Path(str(checkpoint))
    run = RunDir.of(path) if path.suffix == ".pt" else None
    train = run.config() if run is not None else None
    if not isinstance(train, dict) or train.get("verb") != "train":
        return str(path), None
    return _digest({key: train.get(key) for key in RECIPE_KEYS}), train.get("seed")


def read_run(run: Path, complete: Optional[Callable[[dict, dict], dict]] = None
             ) -> tuple[Optional[dict], Optional[str]]:
    """(row, None) for a finished run; (None, why) for an incomplete one; (None, None) for one to skip.
    `complete(config, metrics)`: what a run written before its method declared it lacks (control and report
    fields), from the method's own declaration (the report verb asks the methods' registry)."""
    rundir = RunDir(run)
    config = rundir.config()
    if config is None:
        return None, "unreadable .hydra/config.yaml"
    if config.get("verb") in SKIPPED_VERBS:
        return None, None
    if not rundir.finished:
        return None, "no metrics.json (failed, killed or still running)"
    metrics = rundir.metrics()
    if metrics is None:
        return None, "unreadable metrics.json"
    if complete is not None:
        metrics = {**complete(config, metrics), **metrics}
    settings = _flatten(config)
    row = {"verb": config.get("verb"), **{k: settings.get(k) for k in SCORING_KEYS},
           "overrides": " ".join(read_overrides(run))}
    row.update({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))})
    row.update({k: v for k, v in metrics.items() if k.startswith("report_")})  # what its method declared
    row["types"] = ",".join(metrics["types"]) if isinstance(metrics.get("types"), list) else metrics.get("types")
    row["seed"] = config.get("seed")
    if row.get("checkpoint") is not None:
        row["recipe"], row["train_seed"] = trained_by(row["checkpoint"])
    unset = {"recovery"} if not (config.get("recovery") or {}).get("updates") else set()  # (runs before it and
    # runs without one are the same setting)
    row["setting"] = _digest({"config": {k: v for k, v in config.items() if k not in NOT_A_SETTING and k not in unset},
                              "recipe": row.get("recipe")})
    return row, None


def collect(roots: list[Path], complete: Optional[Callable[[dict, dict], dict]] = None) -> Collection:
    roots = [Path(r).expanduser().absolute() for r in roots]
    rows, curves, incomplete = [], [], []
    for run in run_dirs(roots):
        row, why = read_run(run, complete)
        label = _label(run, roots)
        if why:
            incomplete.append((label, why))
        if row is None:
            continue
        row = {"run": label, **row, "path": str(run)}
        rows.append(row)
        if (run / "curve.csv").exists():
            curve = pd.read_csv(run / "curve.csv")
            curve.insert(0, "run", label)
            for key in ("checkpoint", "types", "heads_pool", "bleu_unpruned", "recipe", "train_seed", "seed", "path",
                        "setting", *SCORING_KEYS):
                curve[key] = row.get(key)
            curves.append(curve.rename(columns={"order": "method"}))
    if not rows:
        where = ", ".join(str(r) for r in roots)
        extra = f" ({len(incomplete)} incomplete)" if incomplete else ""
        raise UserError(f"no finished hprune runs under {where}{extra}; a run dir holds .hydra/config.yaml and "
                        "metrics.json: pass the folder of train, eval or prune runs (e.g. outputs/)")
    return Collection(pd.DataFrame(rows), pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(),
                      incomplete)
