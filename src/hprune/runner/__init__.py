"""One module per verb: a function from the composed config to a result dict, wrapped in a Hydra app.

The wrapper (`hydra_app`) is the one place that
  * refuses a config with a mandatory value left unset (`ckpt: ???`), in one line;
  * turns a UserError into one line on stderr and exit 2 (a JobFailed: exit 3; errors.py lists the statuses),
    and torch's SignalException into Interrupted, which the CLI says in one line (exit 128 + N);
  * writes metrics.json, last and atomically: the verb's result plus the shared provenance (verb, data,
    seed, precision, code version). A run dir without metrics.json did not finish;
  * of a training's many workers (torchrun, SLURM tasks), lets rank 0 alone write it, and refuses the verbs
    that run once.
A verb never imports another verb; what they share lives in hprune.session (an opened model) and below.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ..console import quiet_console
from ..errors import UserError, as_interrupted
from ..files import write_json
from ..launch import check_verb, is_rank_zero
from ..rundir import RunDir, provenance, run_dir

CONFIG_PATH = "pkg://hprune_configs"
# what to say when a mandatory setting is left out
MISSING = {"ckpt": "which model? pass ckpt=<a train run dir or a .pt checkpoint>, e.g. ckpt=outputs/demo",
           "runs": "which runs? give their folder(s): `hprune report outputs/` (or runs=[DIR,...])",
           "mask": "which cut? pass mask=<a `hprune prune` run folder or a head_mask.json>"}


def check_missing(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        raise UserError(MISSING.get(key, f"{key} is not set; pass {key}=<value>"))


def hydra_app(config_name: str, writes_metrics: bool = True) -> Callable:
    """Turn `verb(cfg) -> dict` into the verb's Hydra entry point; bad input ends as one line and exit 2."""
    def decorate(verb: Callable[[DictConfig], dict]) -> Callable:
        @hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)
        @functools.wraps(verb)
        def main(cfg: DictConfig):
            quiet_console(bool(cfg.get("verbose")) or bool(HydraConfig.get().verbose), errors_only=not is_rank_zero())
            try:
                check_missing(cfg)
                check_verb(cfg.verb)
                result = verb(cfg)
            except UserError as err:
                print(f"hprune {cfg.verb}: error: {err}", file=sys.stderr)
                sys.exit(err.exit_status)
            except Exception as err:  # torch's elastic launcher's SignalException: a stop, not an error (Hydra
                stop = as_interrupted(err)  # would print it as a traceback); the CLI says it in one line
                if stop is None:
                    raise
                raise stop from None
            if not writes_metrics or not is_rank_zero():
                return result
            metrics = {**provenance(cfg), **result}
            write_json(RunDir(run_dir()).metrics_file, metrics)
            return metrics
        return main
    return decorate
